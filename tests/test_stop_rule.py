"""The one stop rule: ``BatchCompleter.accept`` decides for both loops when a request ends.

The blocking loop appends each token at the end of the output; the overlapped loop writes
it over the placeholder it left at a position, which the next step's placeholder may
already follow; a speculative check offers several tokens, of which those past a stop are
dropped. Each case is decided by ``accept`` alone.
"""

from __future__ import annotations

import pytest

from minisrv.configs import LLAMA3_8B
from minisrv.core import Entry
from minisrv.request import Req
from minisrv.sampling import SamplingParams
from minisrv.scheduler import Scheduler
from minisrv.sim import SimBackend

EOS = 2


def _completer(clock: float = 3.0):
    """A scheduler's completer over a simulated GPU whose end-of-sequence id is ``EOS``."""
    backend = SimBackend(LLAMA3_8B)
    backend.eos_ids = (EOS,)
    sched = Scheduler(backend, kv_capacity=64, max_running=2)
    sched.recorder.clock = clock
    return sched.completer


def _req(max_new_tokens: int, output: list[int] | None = None, ignore_eos: bool = False) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    return Req(0, [5, 6, 7], params, output=list(output or []))


def test_an_ordinary_token_is_appended_and_stamped_and_stops_nothing() -> None:
    completer, req = _completer(clock=3.0), _req(4, [9])
    assert completer.accept(req, 11, 1) is None
    assert req.output == [9, 11] and req.token_times == [3.0]
    assert req.finish_reason is None


def test_eos_stops_a_request_before_its_length() -> None:
    completer, req = _completer(), _req(10)
    assert completer.accept(req, EOS, 0) == "eos"
    assert req.output == [EOS] and req.finish_reason == "eos"


def test_ignore_eos_runs_past_eos_until_the_length() -> None:
    completer, req = _completer(), _req(2, ignore_eos=True)
    assert completer.accept(req, EOS, 0) is None
    assert completer.accept(req, EOS, 1) == "length"
    assert req.output == [EOS, EOS] and req.finish_reason == "length"


def test_the_max_new_tokens_th_token_stops_for_length() -> None:
    completer, req = _completer(), _req(3, [8, 9])
    assert completer.accept(req, 10, 2) == "length"
    assert req.output == [8, 9, 10] and req.finish_reason == "length"


def test_eos_wins_over_length_on_the_last_token() -> None:
    """Both rules hold on the last token: the reason is the model's own stop."""
    completer, req = _completer(), _req(1)
    assert completer.accept(req, EOS, 0) == "eos"


@pytest.mark.parametrize(("token", "limit", "reason"),
                         [(11, 5, None), (EOS, 5, "eos"), (11, 2, "length")])
def test_the_overlapped_loop_writes_over_its_placeholder_at_a_position(
        token: int, limit: int, reason: str | None) -> None:
    """Output ``[8, -1, -2]``: the token of the step being completed replaces placeholder -1
    at position 1 while the next step's placeholder -2 follows it. The length rule counts
    the position, not the output (which the later placeholder makes one longer)."""
    completer, req = _completer(clock=7.0), _req(limit, [8, -1, -2])
    assert completer.accept(req, token, 1) == reason
    assert req.output == [8, token, -2] and req.token_times == [7.0]
    assert req.finish_reason == reason


CHECKS = [  # a check's tokens after an output of one token: (tokens, limit, kept, reason)
    ([11, 12, 13], 10, [11, 12, 13], None),   # every guess accepted, no stop
    ([11, EOS, 13, 14], 10, [11, EOS], "eos"),  # eos mid-run: the rest is dropped
    ([11, 12, 13, 14], 3, [11, 12], "length"),  # the limit mid-run
    ([11, EOS, 13], 3, [11, EOS], "eos"),  # eos on the last token the limit allows
]


@pytest.mark.parametrize(("tokens", "limit", "kept", "reason"), CHECKS)
def test_a_speculative_check_stops_mid_run(tokens: list[int], limit: int, kept: list[int],
                                           reason: str | None) -> None:
    """An entry of a check gets several tokens back; ``append_tokens`` gives them to
    ``accept`` one by one and keeps (and streams) none past the one that stops."""
    completer, req = _completer(), _req(limit, [9])
    streamed: list[int] = []
    completer.on_token = lambda r, t: streamed.append(t)
    entry = Entry(req, req.seq_len - 1, len(tokens), True)
    finished = completer.append_tokens((entry,), [tokens])
    assert req.output == [9, *kept] and streamed == kept
    assert len(req.token_times) == len(kept)
    assert finished == ([req] if reason else []) and req.finish_reason == reason


@pytest.mark.parametrize(("tokens", "limit", "kept", "reason"), CHECKS)
def test_the_runner_cuts_a_check_where_the_completer_stops(tokens: list[int], limit: int,
                                                           kept: list[int],
                                                           reason: str | None) -> None:
    """The runner cuts a verified check at its stop before answering (``cut_at_stop``) by
    the same rule, ``Req.stop_reason``: it keeps what ``accept`` keeps."""
    from minisrv.runner.speculative import cut_at_stop

    req = _req(limit, [9])
    assert cut_at_stop(tokens, req, (EOS,)) == kept
    assert req.stop_reason(kept[-1], len(kept), (EOS,)) == reason
