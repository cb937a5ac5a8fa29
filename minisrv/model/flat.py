"""Selective batching's data: ``FlatBatch`` (the new tokens of many requests end to end) and
the attention that runs over it, with every request's K/V in a shared ``KVPool``.

``pool_attention`` is what ``CityLM.forward_flat`` hands to each layer: it writes the new
tokens' K/V into their slots, then attends with one of the strategies of
``ATTENTION_FUNCTIONS`` (``flat_attention_loop``, ``flat_attention_padded``, and
``flat_attention_flex``, whose block mask and kernel come from ``ragged``). These are the
chapters' teaching forms and the correctness oracle of the runner's backends of the same
names (``minisrv.runner.attention.BACKENDS``, the one table of attention names, where
``"auto"`` is chosen); they read a ``FlatBatch``, the runner's backends a ``TableBatch``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minisrv.model import ragged
from minisrv.model.attention_metadata import PaddedGroup, flex_index, padded_groups
from minisrv.model.layers import causal_mask, grouped_attention
from minisrv.model.ragged import BlockMask

if TYPE_CHECKING:
    from minisrv.kv import KVPool

class FlatBatch:
    """The new tokens of many requests laid end to end, with where their KV lives.

    ``new_ids[r]`` are request r's tokens to compute this step (a whole prompt for a prefill,
    one token for a decode, anything in between for a chunk). ``slots[r]`` lists ALL of
    request r's KV slots in position order: the first ``len(slots[r]) - len(new_ids[r])``
    already hold its prefix, the last ``len(new_ids[r])`` receive the new tokens' K/V. So a
    token's position is its index in ``slots[r]``, which is what RoPE needs.

    The forward's inputs (flat ids, positions, write slots) are computed here once per step
    and shared by all layers; each attention builds its own metadata from the batch's slot
    lists (``minisrv.model.attention_metadata``).
    """

    def __init__(
        self,
        new_ids: Sequence[Sequence[int]],
        slots: Sequence[Sequence[int]],
        device: str | torch.device = "cpu",
    ) -> None:
        if len(new_ids) != len(slots):
            raise ValueError(f"{len(new_ids)} requests' ids but {len(slots)} slot lists")
        if not new_ids:
            raise ValueError("a flat batch needs at least one request")
        self.device = torch.device(device)
        self.new_lens: list[int] = []
        self.cached_lens: list[int] = []
        write: list[int] = []
        positions: list[int] = []
        for r, (ids, req_slots) in enumerate(zip(new_ids, slots)):
            n_new, n_all = len(ids), len(req_slots)
            if n_new == 0:
                raise ValueError(f"request {r} of the batch has no new tokens")
            if n_all < n_new:
                raise ValueError(f"request {r}: {n_new} new tokens but only {n_all} slots")
            self.new_lens.append(n_new)
            self.cached_lens.append(n_all - n_new)
            write.extend(req_slots[n_all - n_new :])
            positions.extend(range(n_all - n_new, n_all))
        if len(set(write)) != len(write):
            raise ValueError("two new tokens of the batch are written to the same KV slot")
        self.max_slot = max(max(s) for s in slots)  # checked against the pool by the forward
        if min(min(s) for s in slots) < 0:
            raise ValueError("KV slot indices must be >= 0")
        flat_ids = [int(t) for ids in new_ids for t in ids]
        self.id_range = (min(flat_ids), max(flat_ids))  # checked on the host by the forward
        self.ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.write_slots = torch.tensor(write, dtype=torch.long, device=self.device)
        self.slot_lists = [list(s) for s in slots]  # tensors made only where an attention asks
        self._slots: list[torch.Tensor] | None = None
        ends = list(itertools.accumulate(self.new_lens))
        self.starts = [end - n for end, n in zip(ends, self.new_lens)]
        self.last_rows = torch.tensor([end - 1 for end in ends], device=self.device)

    def to(self, device: str | torch.device) -> FlatBatch:
        """This batch with its tensors on ``device`` (itself when already there), so a batch
        built for the CPU runs on a model on a GPU; the attentions' metadata is built there."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = copy.copy(self)
        moved.device = device
        for name in ("ids", "positions", "write_slots", "last_rows"):
            setattr(moved, name, getattr(self, name).to(device))
        moved._slots = None
        return moved

    @property
    def slots(self) -> list[torch.Tensor]:
        """Each request's KV slots as a tensor on the batch's device (built on first use)."""
        if self._slots is None:
            self._slots = [torch.tensor(s, dtype=torch.long, device=self.device)
                           for s in self.slot_lists]
        return self._slots

    def __len__(self) -> int:
        """Requests in the batch."""
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens in all (the rows of the flat matrix)."""
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return f"FlatBatch(requests={len(self)}, tokens={self.num_tokens})"


def flat_attention_loop(
    q: torch.Tensor, batch: FlatBatch, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """Attention of a flat batch, one request at a time: the plain, obviously right version.

    ``q`` [T, n_heads, head_dim]; ``k_layer``/``v_layer`` [capacity, n_kv_heads, head_dim]
    are one layer of the pool, already holding this step's new K/V. Request r's queries see
    its own slots only: all of its prefix, and its new tokens causally. Returns
    [T, n_heads * head_dim]. Costs one small attention call per request per layer.
    """
    outs = []
    for start, n_new, n_cached, slots in zip(
        batch.starts, batch.new_lens, batch.cached_lens, batch.slots
    ):
        mask = causal_mask(n_cached, n_new, q.device)
        outs.append(
            grouped_attention(q[start : start + n_new], k_layer[slots], v_layer[slots], mask)
        )
    return torch.cat(outs, dim=0)


def flat_attention_padded(
    q: torch.Tensor, batch: FlatBatch, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """The same attention as ``flat_attention_loop`` in one call per group of requests.

    Requests are padded to the longest new-token run (T_max) and the longest context
    (S_max) and a mask hides what each query must not see; PyTorch's
    ``scaled_dot_product_attention`` then runs once per layer whatever the batch size.
    Decodes and prefills are padded apart (``padded_groups``), so a step of both
    makes two calls; otherwise a long prefill would pad every decode beside it to its
    length. What padding remains (prompts of different lengths, contexts of different
    lengths) is wasted work, which ragged kernels (FlashInfer, ``flat_attention_flex`` on a
    GPU) skip.
    """
    outs = [padded_attention(q[group.tokens], group, k_layer, v_layer)
            for group in padded_groups(batch, q.dtype)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def padded_attention(
    q: torch.Tensor, group: PaddedGroup, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """One padded SDPA call for the queries ``q`` [T, n_heads, head_dim] of ``group``."""
    n_b, s_max = group.key_slots.shape
    n_kv, head_dim = k_layer.shape[1], k_layer.shape[2]
    # The pool's K/V are gathered once per KV head (index_select: one call for all B x S_max
    # slots, several times faster than k_layer[key_slots]); SDPA shares each KV head among
    # its group of query heads (enable_gqa) instead of copying it for each.
    flat_slots = group.key_slots.reshape(-1)
    k = k_layer.index_select(0, flat_slots).view(n_b, s_max, n_kv, head_dim).transpose(1, 2)
    v = v_layer.index_select(0, flat_slots).view(n_b, s_max, n_kv, head_dim).transpose(1, 2)
    return padded_sdpa(q, group, k, v)


def padded_sdpa(
    q: torch.Tensor, group: PaddedGroup, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The padded call itself, over ``group``'s gathered keys and values ``k``, ``v``
    [B, n_kv_heads, S_max, head_dim]: the queries padded to [B, heads, T_max, head_dim],
    one SDPA under the group's bias, the outputs back to the flat rows [T, heads * dim].
    The one home of the padded attention: ``padded_attention`` gathers from separate K and
    V layers, the runner's backend from the pool's joint layer (``runner.attention``)."""
    n_b, n_kv, _, head_dim = k.shape
    t_max, n_heads = group.bias.shape[2], q.shape[1]
    if t_max == 1:  # decodes only (one query each, so no padded rows)
        return decode_sdpa(q, k, v, group.bias)
    if group.rows is not None:  # each flat token to its row of the padded [B * T_max] block
        q = q.new_zeros(n_b * t_max, n_heads, head_dim).index_copy_(0, group.rows, q)
    q_pad = q.reshape(n_b, t_max, n_heads, head_dim).transpose(1, 2)  # [B, heads, T_max, d]
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=group.bias,
                                         enable_gqa=n_heads > n_kv)
    out = out.transpose(1, 2).reshape(n_b * t_max, n_heads * head_dim)
    return out if group.rows is None else out.index_select(0, group.rows)


def decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
    """``padded_sdpa``'s shortcut for a group of decodes (one query per request, a bias
    [B, 1, 1, S_max] the same for every head): each KV head's query heads become that
    head's rows, [B, kv_heads, heads per KV head, head_dim] against [B, kv_heads, S_max,
    head_dim], so nothing is broadcast (on the CPU 1.1x faster than ``enable_gqa`` at
    CityLM's shapes, 1.8x at 12 x 512's)."""
    n_b, n_kv, _, head_dim = k.shape
    rows = q.reshape(n_b, n_kv, q.shape[1] // n_kv, head_dim)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=bias).reshape(n_b, -1)


def flat_attention_flex(
    q: torch.Tensor, batch: FlatBatch, k_layer: torch.Tensor, v_layer: torch.Tensor
) -> torch.Tensor:
    """The same attention as ``flat_attention_padded`` in one ragged call, without padding.

    Queries stay the flat [T] rows and keys are every request's slots laid end to end
    [S_total]; the block mask (``flex_index``) keeps each query to its own request,
    its prefix and its new tokens causally. Work scales with the tiles requests really
    occupy, not with (requests x longest context), which is what a long prefill beside many
    short decodes wastes in the padded call. Grouped-query heads are shared by the kernel
    (``enable_gqa``), not copied.
    """
    key_slots, block_mask = flex_index(batch)
    out = ragged_attention(q, key_slots, block_mask, k_layer, v_layer)
    return flat_attention_padded(q, batch, k_layer, v_layer) if out is None else out


def ragged_attention(q: torch.Tensor, key_slots: torch.Tensor, block_mask: BlockMask,
                     k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor | None:
    """The one ragged ``flex_attention`` call over the keys of ``key_slots`` [S_total] laid
    end to end, under ``block_mask``: [T, heads * head_dim], or None where the compiled
    kernel failed in this process (``ragged.compile_failed``: the caller runs the padded
    call instead). The runner's flex backend makes this call too."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    k = k_layer[key_slots].transpose(0, 1)[None]  # [1, n_kv_heads, S_total, head_dim]
    v = v_layer[key_slots].transpose(0, 1)[None]
    attend = ragged.flex_kernel(q.device, q.dtype, head_dim)
    if attend is not ragged.flex_attention and ragged.compile_failure is not None:
        return None
    try:
        out = attend(q.transpose(0, 1)[None], k, v, block_mask=block_mask, enable_gqa=True)
    except ragged.compile_errors() as err:  # only the compiled kernel raises these
        ragged.compile_failed(err)
        return None
    return out[0].transpose(0, 1).reshape(q.shape[0], n_heads * head_dim)


ATTENTION_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "loop": flat_attention_loop,
    "padded": flat_attention_padded,
    "flex": flat_attention_flex,
}
"""The teaching forms by name, each the oracle of the runner's backend of that name
(``minisrv.runner.attention.BACKENDS``; ``tests/test_runner.py`` checks their logits agree)."""


def pool_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    batch: FlatBatch,
    pool: KVPool,
    write: torch.Tensor,
    kind: str = "padded",
) -> torch.Tensor:
    """A flat batch's attention at ``layer``: write the new K/V to slots ``write``, then attend.

    Each token's K/V go to its request's slot in ``pool`` before anyone attends, so the
    request's other new tokens see them now and its later steps find them there; ``kind``
    picks the strategy of ``ATTENTION_FUNCTIONS``. This is ``CityLM.forward_flat``'s
    ``LayerAttend``.
    """
    pool.k[layer, write] = k
    pool.v[layer, write] = v
    return ATTENTION_FUNCTIONS[kind](q, batch, pool.k[layer], pool.v[layer])
