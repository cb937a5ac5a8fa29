"""Triton kernels that attend over the KV pool in place, through a request-to-token table.

A request's K/V sit in pool slots scattered anywhere (``minisrv.kv.pool``: one layer is
[slots, 2, kv_heads, head_dim], a slot's key then its value). The padded backend gathers
every request's slots into a padded copy before it attends; these kernels never do: each
program reads ``table[row, position]`` for the slot of a position and loads that slot's
key and value straight from the pool. The table is int32 [rows, width]; a step names each
request's ``row``, its ``context`` (tokens it attends over, the new ones included) and its
``new`` token count; positions ``context - new .. context - 1`` are the new tokens.

Three kernels, as SGLang's Triton backend has for page size 1 (0.5.23 imports them from
``sglang.kernels.ops.attention``: ``decode_attention``, ``extend_attention``), written here
from the same ideas, not copied:

* decode (one query per request): the context is cut into up to ``max_splits`` pieces,
  each program runs an online softmax over one piece for all query heads that share a KV
  head, and writes its partial output with its log-sum-exp; a second kernel merges the
  pieces. A long context thus occupies many programs even at batch 1 (flash decoding).
* extend (any number of new tokens per request, after a cached prefix or none): a program
  per request, query head and block of new tokens walks the key blocks up to its last
  query's position, with the causal rule ``key position <= query position``. Decodes in
  a mixed step are extends of one token.
* write: the step's new keys and values into their slots, found through the same table.

Only Triton API present in both 3.6 and 3.9 is used. On the CPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported): that is how the
tests check their numbers against the padded backend. On a GPU they compile; no GPU run has
measured them yet, so the block sizes below are SGLang's choices, not tuned ones.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from minisrv.runner.attention.splits import (
    DECODE_BLOCK_N,
    DEFAULT_MAX_SPLITS,
    SPLIT_TOKENS,
    kv_splits,
)

__all__ = [
    "DEFAULT_MAX_SPLITS",
    "INTERPRETED",
    "SPLIT_TOKENS",
    "decode_attention",
    "extend_attention",
    "kv_splits",
    "write_kv_table",
]

MIN_ROWS = 16  # tl.dot takes no operand narrower than 16: query heads padded to this


def _dot_precision(dtype: torch.dtype) -> str:
    """16-bit products as the tensor cores make them; wider ones in full precision (a GPU
    would otherwise round float32 to tf32)."""
    return "tf32" if dtype in (torch.float16, torch.bfloat16) else "ieee"


@triton.jit
def _decode_piece_kernel(
    Q, K, V, Table, Rows, Contexts, Splits, Mid, Lse, sm_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (request b, KV head, piece): online softmax over one piece of b's context
    for the GROUP query heads reading this KV head; partial output and log-sum-exp out."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    piece = tl.program_id(2)
    context = tl.load(Contexts + b)
    pieces = tl.load(Splits + b)
    row = tl.load(Rows + b).to(tl.int64)
    per_piece = tl.cdiv(tl.cdiv(context, pieces), BLOCK_N) * BLOCK_N
    lo = piece * per_piece
    hi = tl.minimum(lo + per_piece, context)
    if hi > lo:
        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        mask_h = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(Table + row * stride_table + offs_n, mask=mask_n, other=0)
            slots = slots.to(tl.int64)
            k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * sm_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        tl.store(Mid + b * stride_mb + heads[:, None] * stride_mh + piece * stride_ms
                 + offs_d[None, :], acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Lse + b * stride_lb + heads * stride_lh + piece, m_i + tl.log(l_i),
                 mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Mid, Lse, Out, Contexts, Splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (request b, query head): the pieces' partial outputs weighted by their
    share of the softmax's denominator (their log-sum-exps)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    context = tl.load(Contexts + b)
    pieces = tl.load(Splits + b)
    per_piece = tl.cdiv(tl.cdiv(context, pieces), BLOCK_N) * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for piece in range(0, pieces):
        if piece * per_piece < context:  # the last pieces of a short context may be empty
            part = tl.load(Mid + b * stride_mb + head * stride_mh + piece * stride_ms + offs_d,
                           mask=mask_d, other=0.0)
            lse = tl.load(Lse + b * stride_lb + head * stride_lh + piece)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            weight = tl.exp(lse - m_new)
            acc = acc * alpha + weight * part
            l_i = l_i * alpha + weight
            m_i = m_new
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, acc / l_i, mask=mask_d)


def _check_pool(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                table: torch.Tensor) -> tuple[int, int]:
    """(query heads per KV head, head dim) after checking what the kernels rely on."""
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3:
        raise ValueError(f"K and V pools must be [slots, kv_heads, head_dim], got "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_pool.shape[1]
    if head_dim != k_pool.shape[2] or n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads of {head_dim} cannot read {n_kv} KV heads "
                         f"of {k_pool.shape[2]}")
    if q.dtype != k_pool.dtype or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"queries {q.dtype} and pool {k_pool.dtype}/{v_pool.dtype} differ")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("each head's head_dim values must be contiguous")
    if table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError("the request-to-token table must be a row-major int32 [rows, width]")
    return n_heads // n_kv, head_dim


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, contexts: torch.Tensor,
                     splits: torch.Tensor, max_splits: int = DEFAULT_MAX_SPLITS,
                     sm_scale: float | None = None) -> torch.Tensor:
    """One query per request over its whole context: [B, heads, head_dim] out.

    ``q`` [B, heads, head_dim]; ``k_pool``/``v_pool`` [slots, kv_heads, head_dim] (views of
    a pool layer); request b reads slots ``table[rows[b], :contexts[b]]``, cut into
    ``splits[b]`` (1..``max_splits``, ``kv_splits``) pieces. ``rows``, ``contexts`` and
    ``splits`` are int32 [B]. The grid depends on B and ``max_splits`` only, so a CUDA
    graph captured for a batch size replays for any contexts.
    """
    group, head_dim = _check_pool(q, k_pool, v_pool, table)
    n_b, n_heads = q.shape[0], q.shape[1]
    block_d = max(MIN_ROWS, triton.next_power_of_2(head_dim))
    mid = torch.empty(n_b, n_heads, max_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(n_b, n_heads, max_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    _decode_piece_kernel[(n_b, k_pool.shape[1], max_splits)](
        q, k_pool, v_pool, table, rows, contexts, splits, mid, lse, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), table.stride(0),
        mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_H=max(MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N,
        PRECISION=_dot_precision(q.dtype), num_warps=4, num_stages=2)
    _decode_merge_kernel[(n_b, n_heads)](
        mid, lse, out, contexts, splits,
        mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, num_warps=4)
    return out


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, Rows, Contexts, News, Starts, sm_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (request b, query head, block of b's new tokens): online softmax over b's
    keys up to the block's last position, each query seeing positions <= its own."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    new = tl.load(News + b)
    if block * BLOCK_M < new:
        context = tl.load(Contexts + b)
        start = tl.load(Starts + b)
        row = tl.load(Rows + b).to(tl.int64)
        kv_head = head // GROUP
        prefix = context - new
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < new
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        tokens = (start + offs_m).to(tl.int64)
        q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = tl.minimum(context, prefix + (block + 1) * BLOCK_M)
        for key0 in range(0, end, BLOCK_N):
            offs_n = key0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(Table + row * stride_table + offs_n, mask=mask_n, other=0)
            slots = slots.to(tl.int64)
            k = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * sm_scale
            # every row sees key 0, so no row's maximum stays -inf (no NaN); rows past the
            # request's new tokens compute garbage that is never stored
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        tl.store(Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 acc / l_i[:, None], mask=mask_m[:, None] & mask_d[None, :])


def extend_blocks(head_dim: int, device: torch.device) -> tuple[int, int]:
    """(new tokens, keys) per extend block: SGLang's sizes for compute capability 8 and 9,
    smaller below 8.0 (a T4's shared memory) and on the CPU (the interpreter's programs are
    numpy calls: small blocks keep the tests' padding work small)."""
    if device.type != "cuda":
        return 16, 32
    major = torch.cuda.get_device_capability(device)[0]
    if major >= 9:
        return (128, 64) if head_dim <= 128 else (32, 64)
    if major >= 8:
        return (128, 128) if head_dim <= 64 else (64, 64)
    return (64, 64) if head_dim <= 64 else (32, 32)


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, contexts: torch.Tensor,
                     news: torch.Tensor, starts: torch.Tensor, max_new: int,
                     sm_scale: float | None = None) -> torch.Tensor:
    """Each request's new tokens against its cached prefix and themselves, causally.

    ``q`` [T, heads, head_dim] are the new tokens of all requests end to end; request b's
    are rows ``starts[b] .. starts[b] + news[b] - 1``, at positions ``contexts[b] - news[b]``
    on, and their K/V already sit in the pool at ``table[rows[b], position]``. ``max_new``
    is the largest ``news[b]`` (it sizes the grid). Returns [T, heads, head_dim].
    """
    group, head_dim = _check_pool(q, k_pool, v_pool, table)
    block_m, block_n = extend_blocks(head_dim, q.device)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    grid = (rows.shape[0], q.shape[1], triton.cdiv(max_new, block_m))
    _extend_kernel[grid](
        q, k_pool, v_pool, out, table, rows, contexts, news, starts, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(MIN_ROWS, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
        num_warps=4 if head_dim <= 64 else 8, num_stages=1)
    return out


@triton.jit
def _write_kernel(
    K_new, V_new, K, V, Table, Rows, Contexts, News, Starts,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program (request b, block of its new tokens, KV head): each new token's key and value
    into the slot the table gives its position."""
    b = tl.program_id(0)
    block = tl.program_id(1)
    kv_head = tl.program_id(2)
    new = tl.load(News + b)
    if block * BLOCK_T < new:
        prefix = tl.load(Contexts + b) - new
        start = tl.load(Starts + b)
        row = tl.load(Rows + b).to(tl.int64)
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < new
        offs_d = tl.arange(0, BLOCK_D)
        mask = mask_t[:, None] & (offs_d[None, :] < HEAD_DIM)
        slots = tl.load(Table + row * stride_table + prefix + offs_t, mask=mask_t, other=0)
        slots = slots.to(tl.int64)
        tokens = (start + offs_t).to(tl.int64)
        k = tl.load(K_new + tokens[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :],
                    mask=mask, other=0.0)
        v = tl.load(V_new + tokens[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=mask, other=0.0)
        tl.store(K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], k,
                 mask=mask)
        tl.store(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], v,
                 mask=mask)


WRITE_BLOCK_T = 16  # new tokens per write program


def write_kv_table(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                   contexts: torch.Tensor, news: torch.Tensor, starts: torch.Tensor,
                   max_new: int) -> None:
    """The new tokens' keys and values ``k``/``v`` [T, kv_heads, head_dim] (laid out as the
    queries of ``extend_attention``) into the pool at ``table[rows[b], position]``."""
    if k.shape != v.shape or k.shape[1:] != k_pool.shape[1:]:
        raise ValueError(f"new K/V {tuple(k.shape)}/{tuple(v.shape)} do not fit a pool of "
                         f"{tuple(k_pool.shape[1:])} per slot")
    if k.dtype != k_pool.dtype or v.dtype != v_pool.dtype:
        raise ValueError(f"new K/V {k.dtype} cannot go into a {k_pool.dtype} pool")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("each head's head_dim values must be contiguous")
    head_dim = k.shape[2]
    grid = (rows.shape[0], triton.cdiv(max_new, WRITE_BLOCK_T), k.shape[1])
    _write_kernel[grid](
        k, v, k_pool, v_pool, table, rows, contexts, news, starts,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), table.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=max(MIN_ROWS, triton.next_power_of_2(head_dim)),
        BLOCK_T=WRITE_BLOCK_T, num_warps=4)


INTERPRETED: bool = (isinstance(_write_kernel, InterpretedFunction)
                     and isinstance(tl.cdiv, InterpretedFunction))
"""Whether these kernels run under Triton's interpreter, which is decided at import:
``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function, triton's own
``tl.cdiv`` and kin when triton is first imported (torch's compiler imports it, and
``minisrv.model`` imports that), this module's kernels when it is. So this, not the
environment now, says whether they can run on CPU tensors."""
