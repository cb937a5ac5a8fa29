"""Wide decode entries: jump-forward's catch-up is its own thing, not a speculation.

Jump-forward alone widens each decode entry to the tokens its grammar forced (they have no
KV yet) and guesses nothing, so its batches carry no drafts; speculative decoding's
checks do. Both are driven by the scheduler through the same ``WideDecode`` calls.
"""

from __future__ import annotations

from minisrv.core import Batch
from minisrv.request import Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler.config import EngineConfig
from minisrv.scheduler.speculative import Speculation
from minisrv.scheduler.wide import JumpForward, make_wide
from minisrv.sim import SimBackend


class Slots:
    """A KV manager's ``alloc_tokens`` alone: hands out consecutive slot numbers."""

    def __init__(self) -> None:
        self.next = 0

    def alloc_tokens(self, req: Req, n: int) -> None:
        req.kv_len += n
        self.next += n


def running(prompt_len: int, output: list[int], with_kv: int) -> Req:
    req = Req(rid=len(output), prompt=list(range(1, prompt_len + 1)),
              params=SamplingParams(max_new_tokens=20))
    req.output.extend(output)
    req.kv_len = with_kv
    return req


def test_jump_forward_widens_each_decode_to_its_tokens_without_kv() -> None:
    plain = running(4, [7], with_kv=4)  # its newest token has no KV: a one-token decode
    jumped = running(4, [7, 8, 9, 10], with_kv=4)  # 3 forced tokens appended without KV
    wide, slots = JumpForward(), Slots()
    assert [wide.tokens(r) for r in (plain, jumped)] == [1, 4]
    wide.alloc([plain, jumped], slots)
    assert [r.kv_len for r in (plain, jumped)] == [plain.seq_len, jumped.seq_len]
    batch = wide.expand(Batch.of([], [plain, jumped]))
    assert [(e.start, e.n_tokens, e.sample) for e in batch.entries] == [(4, 1, True),
                                                                      (4, 4, True)]
    assert batch.drafts is None  # nothing guessed, nothing for the runner to check
    assert wide.expand(batch) is batch  # the plan is used once


def test_each_option_gets_its_own_wide_decode() -> None:
    sim = SimBackend()
    assert make_wide(EngineConfig(), sim) is None
    wide = make_wide(EngineConfig(jump_forward=True), sim)
    assert isinstance(wide, JumpForward) and not isinstance(wide, Speculation)
