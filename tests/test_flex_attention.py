"""Ragged attention: one flex_attention call over the flat batch, without padding, computes
what the padded call computes, and the engine generates the same tokens with it.

On the CPU flex_attention runs eagerly (its unfused reference implementation); on CUDA
(``DEVICES``) it is compiled to one Triton kernel, so the same tests check the real kernel
there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisrv.configs import CITYLM
from minisrv.engine import Engine
from minisrv.kv import KVPool
from minisrv.model import (
    FLEX_AVAILABLE,
    CityLM,
    FlatBatch,
    available_devices,
    flex_index,
)
from minisrv.model.ragged import (
    FLEX_BLOCK_SIZE,
    flex_attention,
    flex_kernel,
    ragged_layout,
    ragged_mask_mod,
    ragged_tiles,
)
from minisrv.runner import ModelBackend
from minisrv.runner.attention import make_attention
from minisrv.runner.attention.choice import choose_attention
from minisrv.tokenizer import Tokenizer

DEVICES = available_devices()  # cpu always, cuda when a GPU is visible

pytestmark = pytest.mark.skipif(not FLEX_AVAILABLE, reason="torch has no flex_attention (< 2.5)")

CFG = CITYLM.with_(name="flex-test", vocab_size=Tokenizer().vocab_size, n_layers=2,
                   d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=320)


def random_model(dtype: torch.dtype, device: str = "cpu") -> CityLM:
    torch.manual_seed(0)
    model = CityLM(CFG)
    model.reset_parameters(std=0.3)
    return model.to(device=device, dtype=dtype).eval()


MODELS: dict[tuple[torch.dtype, str], CityLM] = {}


def model_for(dtype: torch.dtype, device: str) -> CityLM:
    if (dtype, device) not in MODELS:
        MODELS[dtype, device] = random_model(dtype, device)
    return MODELS[dtype, device]


def step_logits(
    model: CityLM, mix: list[tuple[int, int]], attention: str, seed: int = 0
) -> torch.Tensor:
    """Logits of one flat step over ``mix`` ((cached prefix, new tokens) per request).

    Each prefix is first written to the pool by a padded step, as earlier steps would have,
    so the attention under test reads every request's cached KV from the pool.
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, CFG.vocab_size, (p + n,), generator=gen).tolist() for p, n in mix]
    pool = KVPool.for_model(model, sum(p + n for p, n in mix) + 5)
    pool.alloc(5)  # so request slots do not start at 0
    slots = [pool.alloc(p + n) for p, n in mix]
    for (p, _), seq, s in zip(mix, seqs, slots):
        if p:
            model.forward_flat(FlatBatch([seq[:p]], [s[:p]], model.device), pool,
                               attention="padded")
    new_ids = [seq[p:] for (p, _), seq in zip(mix, seqs)]
    return model.forward_flat(FlatBatch(new_ids, slots, model.device), pool, attention=attention)


def expected_mask(mix: list[tuple[int, int]]) -> torch.Tensor:
    """The [T, S_total] mask spelled out: request r's new token at position p sees request
    r's keys at positions 0..p, nothing of any other request."""
    total = sum(p + n for p, n in mix)
    rows = []
    key_start = 0
    for p, n in mix:
        for pos in range(p, p + n):
            row = torch.zeros(total, dtype=torch.bool)
            row[key_start : key_start + pos + 1] = True
            rows.append(row)
        key_start += p + n
    return torch.stack(rows)


request = st.tuples(st.integers(0, 20), st.integers(1, 12))  # (cached prefix, new tokens)


def dense_tiles(counts: torch.Tensor, indices: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A BlockMask's (counts, indices) as a boolean [query tiles, key tiles] matrix."""
    dense = torch.zeros(counts.shape[-1], n_cols, dtype=torch.bool)
    for i, (n, row) in enumerate(zip(counts[0, 0].tolist(), indices[0, 0])):
        dense[i, row[:n].long()] = True
    return dense


@settings(max_examples=40, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.sampled_from([4, 8, 16]))
def test_mask_mod_is_the_padded_rule_on_the_ragged_layout(
    mix: list[tuple[int, int]], block: int
) -> None:
    """Evaluated on every (row, column), padding included, the mask_mod is ``expected_mask``
    on the real part and False on the padding up to whole tiles."""
    from torch.nn.attention.flex_attention import create_mask

    new, cached = [n for _, n in mix], [p for p, _ in mix]
    layout = ragged_layout(new, cached, torch.device("cpu"), block)
    n_rows, n_cols = layout[0].shape[0], layout[2].shape[0]
    assert n_rows % block == 0 and n_cols % block == 0
    mask_mod = ragged_mask_mod(*layout)
    dense = create_mask(mask_mod, None, None, n_rows, n_cols, device="cpu")[0, 0]
    want = expected_mask(mix)
    assert torch.equal(dense[: want.shape[0], : want.shape[1]], want)
    assert dense.sum() == want.sum()  # nothing on the padding


@settings(max_examples=40, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.sampled_from([4, 8, 16]))
def test_tiles_from_lengths_equal_create_block_mask(
    mix: list[tuple[int, int]], block: int
) -> None:
    """``ragged_tiles`` (O(requests + tiles), no T x S evaluation) classifies every tile
    exactly as torch's ``create_block_mask`` does by evaluating the mask on each pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    new, cached = [n for _, n in mix], [p for p, _ in mix]
    layout = ragged_layout(new, cached, torch.device("cpu"), block)
    n_rows, n_cols = sum(new), sum(new) + sum(cached)
    ref = create_block_mask(ragged_mask_mod(*layout), None, None, n_rows, n_cols,
                            device="cpu", BLOCK_SIZE=block)
    partial, full = ragged_tiles(new, cached, block)
    assert torch.equal(partial, dense_tiles(ref.kv_num_blocks, ref.kv_indices, partial.shape[1]))
    assert torch.equal(full, dense_tiles(ref.full_kv_num_blocks, ref.full_kv_indices,
                                         full.shape[1]))


def test_block_mask_skips_the_tiles_no_request_sees() -> None:
    """Two prefills longer than a tile: the tiles pairing one's queries with the other's
    keys are empty, some tiles need no mask at all, and the rest are partial."""
    mix = [(0, 300), (40, 140)]
    partial, full = ragged_tiles([n for _, n in mix], [p for p, _ in mix], FLEX_BLOCK_SIZE)
    mask = expected_mask(mix)
    b = FLEX_BLOCK_SIZE
    tiles = torch.tensor([[bool(mask[i * b:(i + 1) * b, j * b:(j + 1) * b].any())
                           for j in range(partial.shape[1])] for i in range(partial.shape[0])])
    assert torch.equal(partial | full, tiles) and not (partial & full).any()
    assert full.any() and not tiles.all()  # unmasked tiles, and skipped ones
    batch = FlatBatch([[1] * n for _, n in mix], [list(range(300)), list(range(300, 480))])
    key_slots, block_mask = flex_index(batch)
    assert key_slots.tolist() == list(range(480))  # no padding of the keys
    assert block_mask.seq_lengths == (440, 480)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=st.lists(request, min_size=1, max_size=6))
def test_flex_equals_padded_in_float32(device: str, mix: list[tuple[int, int]]) -> None:
    """Within 1e-5 of the logits' scale: float32 rounding through two layers (logits reach
    about 5 here; hypothesis found a mix whose logits differ by 1.2e-5)."""
    model = model_for(torch.float32, device)
    flex = step_logits(model, mix, "flex", seed=1)
    padded = step_logits(model, mix, "padded", seed=1)
    assert flex.shape == padded.shape
    scale = max(1.0, padded.abs().max().item())
    assert (flex - padded).abs().max().item() < 1e-5 * scale


def test_flex_equals_each_request_alone_in_float64() -> None:
    """A long prefill beside decodes and a chunk, against the dense cache: its 260 rows span
    three query tiles, the second wholly its own, so full (unmasked) tiles are computed too."""
    model = model_for(torch.float64, "cpu")
    mix = [(0, 260), (30, 1), (100, 1), (9, 20), (0, 1)]
    assert ragged_tiles([n for _, n in mix], [p for p, _ in mix])[1].any()
    got = step_logits(model, mix, "flex", seed=2)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, CFG.vocab_size, (p + n,), generator=gen) for p, n in mix]
    with torch.no_grad():
        want = torch.cat([model(seq)[p:] for (p, _), seq in zip(mix, seqs)])
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_engine_with_flex_generates_the_reference_tokens(device: str) -> None:
    """Greedy outputs through ``Engine`` with the radix cache: flex, padded and each request
    alone give the same tokens (shared prefixes make later prefills read cached KV)."""
    model = model_for(torch.float32, device)
    shared = [0, 5, 9, 13, 7, 21, 30, 2, 44]
    prompts = [shared + [3, 4], shared + [8], [0, 11, 12], shared + [3, 4, 50, 6], [0, 60]]
    lengths = [12, 20, 7, 15, 9]
    outputs = {}
    for attention in ("flex", "padded"):
        engine = Engine(ModelBackend(model, attention=attention), kv_capacity=400,
                        max_running=3, cache="radix")
        outputs[attention] = engine.generate(prompts, max_new_tokens=lengths)
        assert engine.stats.cached_tokens > 0
        engine.scheduler.check_integrity()
    alone = [model.reference_generate(p, n) for p, n in zip(prompts, lengths)]
    assert outputs["flex"] == outputs["padded"] == alone


def test_auto_is_padded_on_the_cpu_and_narrow_heads_run_flex_eagerly() -> None:
    """``auto``'s table (``tests/test_choice.py`` checks its GPU rows) keeps the CPU padded;
    the compiled kernel needs heads of >= 16 (this file's model has 8), so an explicit
    "flex" runs eagerly there instead of failing to compile."""
    assert make_attention("auto", "cpu", torch.float32, 8).kind == "padded"
    assert choose_attention("cuda", (9, 0), torch.float32, 8).backend == "padded"
    assert flex_kernel(torch.device("cuda"), torch.float32, 8) is flex_attention
    assert make_attention("flex", "cpu", torch.float32, 8).kind == "flex"  # asked for: obeyed
    assert ModelBackend(model_for(torch.float32, "cpu")).attention == "padded"


def test_unknown_attention_is_named() -> None:
    with pytest.raises(ValueError, match="unknown attention 'ragged'.*'flex'.*'auto'"):
        make_attention("ragged", "cpu", torch.float32, 8)
    with pytest.raises(ValueError, match="unknown attention"):
        ModelBackend(model_for(torch.float32, "cpu"), attention="flash")


def test_a_failed_compile_falls_back_to_the_padded_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the compiled kernel fails (torch 2.11 on an H200 raised NoValidChoicesError for some
    small steps), the step still gets the right attention, from the padded call, with a
    warning naming the failure; later steps go straight to the padded call."""
    from minisrv.model import ragged

    calls = []

    def failing_kernel(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("NoValidChoicesError: No choices to select")

    monkeypatch.setattr(ragged, "compile_errors", lambda: (RuntimeError,))
    monkeypatch.setattr(ragged, "flex_kernel", lambda *args: failing_kernel)
    monkeypatch.setattr(ragged, "compile_failure", None)
    model = model_for(torch.float32, "cpu")
    mix = [(0, 5), (7, 1), (3, 4)]
    padded = step_logits(model, mix, "padded", seed=3)
    with pytest.warns(RuntimeWarning, match="NoValidChoicesError.*padded attention"):
        first = step_logits(model, mix, "flex", seed=3)
    assert ragged.compile_failure.startswith("RuntimeError: NoValidChoicesError")
    again = step_logits(model, mix, "flex", seed=3)
    assert len(calls) == 1  # tried once (first layer), then never again
    assert torch.equal(first, padded) and torch.equal(again, padded)


def test_the_flex_backend_falls_back_to_the_padded_call_too(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The runner's flex backend builds its own metadata from the step's ``TableBatch`` and
    makes the same ragged call: where the compiled kernel fails, the padded backend's call
    over the same batch answers instead, equal to the padded backend's own output."""
    from minisrv.model import ragged
    from minisrv.runner.table_batch import TableBatch

    def failing_kernel(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("NoValidChoicesError: No choices to select")

    gen = torch.Generator().manual_seed(5)
    slots = [[4, 9, 1, 7], [3], [8, 0, 2, 6, 5]]
    batch = TableBatch.of_slots([[1, 2], [3], [4, 5, 6]], slots, fill=10)
    kv = torch.randn(11, 2, 2, 16, generator=gen)
    q = torch.randn(batch.num_tokens, 4, 16, generator=gen)
    flex = make_attention("flex", "cpu", torch.float32, 16, 2)
    padded = make_attention("padded", "cpu", torch.float32, 16, 2)
    want = padded.forward(q, kv, padded.prepare(batch))
    torch.testing.assert_close(flex.forward(q, kv, flex.prepare(batch)), want)
    monkeypatch.setattr(ragged, "compile_errors", lambda: (RuntimeError,))
    monkeypatch.setattr(ragged, "flex_kernel", lambda *args: failing_kernel)
    monkeypatch.setattr(ragged, "compile_failure", None)
    with pytest.warns(RuntimeWarning, match="NoValidChoicesError"):
        fell_back = flex.forward(q, kv, flex.prepare(batch))
    assert torch.equal(fell_back, want)
