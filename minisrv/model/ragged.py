"""Ragged attention: a flat batch's attention as ONE ``flex_attention`` call, without padding.

The queries are the flat batch's rows [T] and the keys are every request's slots laid end to
end [S_total]. Which query may see which key is document masking plus causality: the same
request, and a key position no later than the query's (so the request's whole cached prefix
from the pool, and its new tokens causally). flex_attention takes that rule twice:

* as ``mask_mod(b, h, q, kv)``, evaluated per element inside tiles that need it;
* as a ``BlockMask``: per tile of ``FLEX_BLOCK_SIZE`` queries x keys, empty (skipped), full
  (no mask needed) or partial. ``ragged_tiles`` derives it from the requests' lengths alone,
  in O(requests + tiles), where ``create_block_mask`` would evaluate the mask on every one of
  the T x S_total pairs (gigabytes for a step that prefills many long prompts).

On a GPU the call is compiled to one fused Triton kernel; elsewhere it runs eagerly (the
unfused reference implementation), which is how the CPU tests check its numbers. The call
itself, ``flat_attention_flex``, sits in ``flat`` beside the padded call it falls back to;
this module knows nothing of flat batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

try:  # torch >= 2.5; Colab and the pinned CPU wheel have it, an old torch falls back to padded
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    BlockMask = flex_attention = None


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed ``torch.compile`` raises. Imported when asked: ``torch._dynamo`` takes
    about 2 s to import, which every engine process (a server worker, a restarted one, each
    chapter's kernel) would pay at start without ever compiling; an ``except`` clause calls
    this only once an exception is on its way (private modules: guarded)."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._inductor.exc import InductorError
    except ImportError:  # pragma: no cover - depends on the installed torch
        return ()
    return (BackendCompilerFailed, InductorError)


FLEX_AVAILABLE: bool = flex_attention is not None
"""Whether this torch has ``torch.nn.attention.flex_attention`` (2.5 and later)."""

FLEX_BLOCK_SIZE = 128
"""Side of a block-mask tile (queries x keys); flex_attention's default and its kernel's."""

FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the compiled (Triton) flex kernel takes on a GPU; others run eagerly there."""

FLEX_MIN_HEAD_DIM = 16
"""Narrowest head the compiled flex kernel takes (torch 2.11 on an H200 refused 8: "embedding
dimension ... must be at least 16"); narrower heads run eagerly on a GPU too."""


def flex_compiles(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flex_attention runs as the compiled kernel here: CUDA, a ``FLEX_DTYPES``
    dtype and heads of at least ``FLEX_MIN_HEAD_DIM``."""
    return (torch.device(device).type == "cuda" and dtype in FLEX_DTYPES
            and head_dim >= FLEX_MIN_HEAD_DIM)


def ragged_layout(
    new_lens: Sequence[int], cached_lens: Sequence[int], device: torch.device, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_req, q_pos, k_req, k_pos)``: whose row / column each index is, and its position.

    Rows are request 0's new tokens, then request 1's, ...; columns are request 0's
    ``cached + new`` keys, then request 1's, .... Both are padded to whole tiles with request
    ids that never match (-1 for rows, -2 for columns), so ``mask_mod`` is defined (and False)
    on the padding flex_attention evaluates at a ragged edge.
    """
    cpu = torch.device("cpu")  # explicit: a default device set by the caller must not apply
    new = torch.tensor(new_lens, dtype=torch.long, device=cpu)
    total = new + torch.tensor(cached_lens, dtype=torch.long, device=cpu)
    reqs = torch.arange(len(new_lens), device=cpu)

    def run_positions(lens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Per index of runs of ``lens`` laid end to end: ``first`` of its run + its offset."""
        starts = torch.cumsum(lens, 0) - lens
        index = torch.arange(int(lens.sum()), device=cpu)
        return index - torch.repeat_interleave(starts - first, lens)

    def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
        pad = values.new_full((-len(values) % block,), fill)
        return torch.cat([values, pad]).to(device)

    # Built with whole-tensor ops (a decode step of 256 requests at context 512 has 131,328
    # keys: Python lists took 44 ms per step here), then moved to the device once.
    q_req = torch.repeat_interleave(reqs, new)
    q_pos = run_positions(new, total - new)  # request r's new tokens: cached_r, cached_r + 1, ...
    k_req = torch.repeat_interleave(reqs, total)
    k_pos = run_positions(total, torch.zeros_like(total))
    return padded(q_req, -1), padded(q_pos, 0), padded(k_req, -2), padded(k_pos, 0)


def ragged_mask_mod(
    q_req: torch.Tensor, q_pos: torch.Tensor, k_req: torch.Tensor, k_pos: torch.Tensor
) -> Callable[..., torch.Tensor]:
    """The rule as flex_attention's ``mask_mod``: same request, key position <= query's."""

    def same_request_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (q_req[q] == k_req[kv]) & (k_pos[kv] <= q_pos[q])

    return same_request_causal


def ragged_tiles(
    new_lens: Sequence[int], cached_lens: Sequence[int], block: int = FLEX_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: boolean [query tiles, key tiles] on the CPU, from lengths alone.

    Request r's new token t (row ``q_start + t``) sees columns ``k_start .. k_start +
    cached + t``: a staircase. For each query tile a request's rows touch, the key tiles up
    to the tile holding its last visible column are touched. A tile is full when all its
    rows are this request's and all its columns lie at or before what its first row sees;
    every other touched tile is partial (the mask is applied per element there).
    """
    n_rows, n_cols = sum(new_lens), sum(n + c for n, c in zip(new_lens, cached_lens))
    shape = (math.ceil(n_rows / block), math.ceil(n_cols / block))
    touched = torch.zeros(shape, dtype=torch.bool, device="cpu")  # built here, then moved
    full = torch.zeros_like(touched)
    q_start = k_start = 0
    for n, c in zip(new_lens, cached_lens):
        for i in range(q_start // block, (q_start + n - 1) // block + 1):
            t0 = max(q_start, i * block) - q_start  # first and last of r's rows in tile i
            t1 = min(q_start + n, (i + 1) * block) - 1 - q_start
            touched[i, k_start // block : (k_start + c + t1) // block + 1] = True
            if t1 - t0 + 1 == block:  # the whole query tile is this request's
                first = -(-k_start // block)  # key tiles wholly inside what row t0 sees
                last = (k_start + c + t0 + 1) // block - 1
                full[i, first : last + 1] = True
        q_start += n
        k_start += c + n
    return touched & ~full, full


def _tiles_to_blocks(tiles: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A boolean tile matrix as BlockMask's (counts [1,1,nQ], indices [1,1,nQ,nK]) in int32:
    each row's touched key tiles first, in order."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None].to(device), order.to(torch.int32)[None, None].to(device)


def ragged_block_mask(
    new_lens: Sequence[int],
    cached_lens: Sequence[int],
    device: torch.device,
    block: int = FLEX_BLOCK_SIZE,
) -> BlockMask:
    """The BlockMask of a flat batch's ragged attention (``ragged_tiles`` + the mask_mod)."""
    if not FLEX_AVAILABLE:
        raise ValueError(f"torch {torch.__version__} has no flex_attention (needs >= 2.5)")
    partial, full = ragged_tiles(new_lens, cached_lens, block)
    mask_mod = ragged_mask_mod(*ragged_layout(new_lens, cached_lens, device, block))
    n_rows, n_cols = sum(new_lens), sum(n + c for n, c in zip(new_lens, cached_lens))
    return BlockMask.from_kv_blocks(
        *_tiles_to_blocks(partial, device), *_tiles_to_blocks(full, device),
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n_rows, n_cols),
        compute_q_blocks=False,  # the query-major index serves only the backward pass
    )


_COMPILED_FLEX: dict[str, Callable[..., torch.Tensor]] = {}

compile_failure: str | None = None
"""Why the compiled flex kernel failed in this process, if it did (then the padded call runs).

torch 2.11 on an H200 compiled it for most steps but raised ``NoValidChoicesError`` for some
small ones; a server must not stop on that, so the first failure switches the ragged call
to the padded one for the rest of the process, with a warning that says why."""


def flex_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int = FLEX_MIN_HEAD_DIM
) -> Callable[..., torch.Tensor]:
    """flex_attention as it should run on ``device``: compiled to one fused Triton kernel
    where ``flex_compiles`` (``dynamic=True``, so a new batch shape does not recompile),
    eager elsewhere (the CPU, float64 tests on a GPU, heads narrower than 16).

    Eager flex_attention is the unfused reference implementation (it materializes the
    scores and warns so): right for checking numbers, never fast.
    """
    if not flex_compiles(device, dtype, head_dim):
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX["cuda"]


def compile_failed(err: BaseException) -> None:
    """Remember (and say once) that the compiled kernel failed: the padded call takes over."""
    global compile_failure
    compile_failure = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
    warnings.warn(f"compiled flex_attention failed ({compile_failure}); attention='flex' runs "
                  "the padded attention for the rest of this process", RuntimeWarning,
                  stacklevel=3)

