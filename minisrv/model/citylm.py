"""CityLM: a small LLaMA-style decoder, its two forward passes, and the one-request oracle.

The architecture is LLaMA's: token embedding, then ``n_layers`` blocks of
(RMSNorm -> grouped-query attention with rotary positions -> residual;
RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an LM head.

``CityLM.forward`` processes new tokens of ONE request against that request's
``DenseKVCache``; ``CityLM.forward_flat`` processes the new tokens of MANY requests as one
flat batch over a shared ``KVPool`` (selective batching). Both run the same layer step,
``Block.forward``, and differ only in the attention function they hand it, so they give the
same numbers.

``reference_generate`` decodes one request alone. It is the correctness oracle of the book:
every batched, cached, retracted or overlapped run is compared with it token by token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minisrv.configs import CITYLM, ModelConfig
from minisrv.model.flat import ATTENTION_FUNCTIONS, FlatBatch, pool_attention
from minisrv.model.kvcache import DenseKVCache, cache_attention
from minisrv.model.layers import (
    Block,
    LayerAttend,
    Linear,
    RMSNorm,
    causal_mask,
    rope_inv_freq,
    rope_table,
)
from minisrv.sampling import SamplingParams, make_generator, sample_next
from minisrv.tokenizer import EOS_ID, merge_eos_ids

if TYPE_CHECKING:
    from minisrv.kv import KVPool


class CityLM(nn.Module):
    """A LLaMA-style decoder-only language model (CityLM, or any small Llama checkpoint).

    ``rope_scaling`` is ``None`` or a dict of HF's ``"llama3"`` RoPE parameters; it is kept
    beside the config because ``ModelConfig`` describes shapes, not position encodings.
    ``eos_id`` is the token that ends a generation, or a sequence of them (a checkpoint may
    have several, e.g. end-of-text and end-of-turn; ``None``: none does). ``eos_ids`` keeps
    them all, ``eos_id`` the first. CityLM's is the tokenizer's ``<eos>``.

    ``tokenizer`` is the tokenizer whose ids the model reads and writes, when its loader
    knows it (``load_model`` and ``load_citylm`` set it; ``None`` for a model built by
    hand). An engine builds its structured-output vocabulary from it on first use, so a
    loaded checkpoint takes a ``json_schema`` or ``regex`` with no further call; it is a
    plain attribute, not the grammar vocabulary itself, so loading never needs xgrammar.
    """

    def __init__(
        self,
        config: ModelConfig = CITYLM,
        rope_scaling: Mapping[str, Any] | None = None,
        eos_id: int | Sequence[int] | None = EOS_ID,
    ) -> None:
        super().__init__()
        for field in ("vocab_size", "d_ff", "max_seq_len"):
            if getattr(config, field) < 1:
                raise ValueError(f"{config.name}: {field} must be >= 1 to build a model")
        if config.head_dim % 2:
            raise ValueError(
                f"{config.name}: head_dim must be even for RoPE, got {config.head_dim}"
            )
        self.config = config
        self.rope_scaling = dict(rope_scaling) if rope_scaling is not None else None
        self.eos_ids: tuple[int, ...] = merge_eos_ids(eos_id)
        self.tokenizer: Any = None  # a Tokenizer or HFTokenizer; see the class docstring
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = Linear(config.d_model, config.vocab_size)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Not a buffer: module.to(dtype) would round it to the weights' dtype, and RoPE
        # angles must stay float32 (as in HF Llama) even for a bf16 model.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, self.rope_scaling)
        self._rope_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init: normal(0, std) for matrices, ones for norm gains.

        Output projections (``o_proj``, ``down_proj``) are scaled by 1/sqrt(2 * n_layers) so the
        residual stream does not grow with depth (GPT-2's recipe).
        """
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, 0.0, out_std)
            else:
                nn.init.normal_(param, 0.0, std)

    @property
    def eos_id(self) -> int | None:
        """The first of ``eos_ids`` (``None`` when no token ends a generation)."""
        return self.eos_ids[0] if self.eos_ids else None

    @eos_id.setter
    def eos_id(self, value: int | None) -> None:
        self.eos_ids = merge_eos_ids(value)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' floating-point type (float32 unless converted)."""
        return self.embed.weight.dtype

    def new_cache(self) -> DenseKVCache:
        """An empty KV cache for one request."""
        return DenseKVCache(self.config.n_layers)

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the angles of ``positions`` [T]: two [T, 1, head_dim] views
        of one indexing of ``rope_table`` (see ``layers.rope_table``)."""
        key = (positions.device, self.dtype)
        table = self._rope_on.get(key)
        if table is None:  # first use on this device and dtype: every position's row, once
            table = self._rope_on[key] = rope_table(
                self.inv_freq, self.config.max_seq_len, self.dtype, positions.device)
        rows = table.index_select(0, positions)  # on the CPU about half of table[positions]
        return rows[:, 0], rows[:, 1]

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise ValueError unless ``ids`` is a non-empty 1-D tensor of in-vocabulary ids.

        Reads the ids' range back from the device: for one request's ``forward`` (the oracle),
        not for a serving step, whose ids are checked on the host (``check_id_range``).
        """
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must be a 1-D tensor of token ids, got {shape}")
        if ids.numel() == 0:
            raise ValueError("ids is empty: forward needs at least one new token")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        self.check_id_range(int(ids.min()), int(ids.max()))

    def check_id_range(self, low: int, high: int) -> None:
        """Raise ValueError unless ids from ``low`` to ``high`` are all in the vocabulary."""
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )

    def run_layers(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: LayerAttend
    ) -> torch.Tensor:
        """The residual stream [T, d] after the last layer, for tokens ``ids`` at ``positions``.

        The part both forwards share: embed, then every layer's step with ``attend(i, ...)``
        as layer i's attention. The final norm and LM head are left to the caller, which
        may need only some rows.
        """
        cos, sin = self.rope_cos_sin(positions)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, partial(attend, i))
        return x

    def forward(self, ids: torch.Tensor, cache: DenseKVCache | None = None) -> torch.Tensor:
        """Logits [T, vocab] for ``ids`` [T], the next tokens of one request.

        The new tokens take positions ``len(cache) .. len(cache) + T - 1`` and attend
        causally to everything cached plus each other; their K/V are appended to
        ``cache`` when one is given. Prefill is one call with the whole prompt, each decode
        step one call with a single token. Errors are raised before the cache is touched.
        """
        self.check_ids(ids)
        n_cached, n_new = (len(cache) if cache is not None else 0), ids.shape[0]
        if n_cached + n_new > self.config.max_seq_len:
            raise ValueError(
                f"sequence too long: {n_cached} cached + {n_new} new tokens exceeds "
                f"max_seq_len={self.config.max_seq_len}"
            )
        positions = torch.arange(n_cached, n_cached + n_new, device=self.device)
        mask = causal_mask(n_cached, n_new, self.device)
        attend = partial(cache_attention, cache=cache, mask=mask)
        return self.forward_tokens(ids.to(self.device), positions, attend)

    @torch.inference_mode()
    def forward_flat(
        self,
        batch: FlatBatch,
        pool: KVPool,
        *,
        attention: str = "padded",
        last_only: bool = False,
    ) -> torch.Tensor:
        """Selective batching (ORCA): one forward over the new tokens of many requests.

        All new tokens form one [T_total, d] matrix, so embeddings, norms, projections, the
        MLP and the LM head each run once for the whole step. Only attention is per request:
        each token is rotated by its own position, its K/V go to its request's slot in
        ``pool``, and it attends to its request's slots (``"loop"``: a call per request;
        ``"padded"``: one per group, decodes apart from prefills; ``"flex"``: one for all;
        ``minisrv.runner.attention`` picks per device). Returns logits [T_total, vocab], or
        with ``last_only`` [requests, vocab] for the last tokens. Checks precede any pool write.
        """
        batch = batch.to(self.device)
        self.check_flat(batch, pool, attention)
        attend = partial(pool_attention, batch=batch, pool=pool, write=batch.write_slots,
                         kind=attention)
        rows = batch.last_rows if last_only else None
        return self.forward_tokens(batch.ids, batch.positions, attend, rows)

    def forward_tokens(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: LayerAttend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The device's whole work for a step: logits of tokens ``ids`` at ``positions`` (or
        of their ``rows`` only), each layer attending with ``attend``.

        Checks nothing and reads nothing back from the device (the callers check on the
        host first), so a GPU runs it without waiting for the host: a test runs it on the
        ``meta`` device, where any read-back raises.
        """
        x = self.run_layers(ids, positions, attend)
        if rows is not None:
            x = x[rows]
        return self.lm_head(self.norm(x))

    def check_flat(self, batch: FlatBatch, pool: KVPool, attention: str) -> None:
        """Raise ValueError unless ``forward_flat`` can run ``batch`` over ``pool``.

        The ids must be in the vocabulary, the pool shaped, typed and placed for this model
        and hold every slot of the batch, and no request may outgrow ``max_seq_len``. All
        from host values: nothing is read back from the device.
        """
        if attention not in ATTENTION_FUNCTIONS:
            raise ValueError(f"unknown attention {attention!r}; the flat batch's are "
                             f"{tuple(ATTENTION_FUNCTIONS)}")
        self.check_id_range(*batch.id_range)
        cfg = self.config
        want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        have = (pool.k.shape[0], pool.k.shape[2], pool.k.shape[3])
        if have != want:
            raise ValueError(f"pool shaped for (layers, kv_heads, head_dim)={have}, model {want}")
        if pool.k.dtype != self.dtype or pool.k.device != self.device:
            raise ValueError(
                f"pool is {pool.k.dtype} on {pool.k.device}, model {self.dtype} on {self.device}"
            )
        if batch.max_slot >= pool.capacity:
            raise ValueError(f"slot {batch.max_slot} is outside the pool (0..{pool.capacity - 1})")
        longest = max(c + n for c, n in zip(batch.cached_lens, batch.new_lens))
        if longest > cfg.max_seq_len:
            raise ValueError(f"a request reaches {longest} tokens, max_seq_len={cfg.max_seq_len}")

    @torch.inference_mode()
    def reference_generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Generate for ONE request, alone: the oracle every serving strategy must match.

        Prefill the prompt, then feed back one token at a time through a private KV cache.
        Returns the generated ids only. A generated eos id (any of ``eos_ids``) is included
        as the last id and ends generation, unless ``ignore_eos``. Sampling goes through
        ``sample_next`` with the request's own generator, exactly as the batched engine does.
        """
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: encode at least <bos>")
        if len(prompt) + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_seq_len={self.config.max_seq_len}"
            )
        generator = make_generator(params)
        cache = self.new_cache()
        logits = self(torch.tensor(prompt, dtype=torch.long, device=self.device), cache)
        out: list[int] = []
        while True:
            token = sample_next(logits[-1], params, generator)
            out.append(token)
            if token in self.eos_ids and not ignore_eos:
                break
            if len(out) == max_new_tokens:
                break
            logits = self(torch.tensor([token], dtype=torch.long, device=self.device), cache)
        return out
