"""CityLM, the model minisrv serves, and the pieces it is made of.

- ``layers``: RMSNorm, rotary positions (``rope_table``), grouped-query attention with
  fused q/k/v, SwiGLU with fused gate/up, ``Block`` (one layer's step, with the attention
  function passed in), and the fusing of unfused checkpoints (``fuse_weights``);
- ``onednn``: ``Linear``, the CPU's float32 products through oneDNN with packed weights;
- ``kvcache``: ``DenseKVCache``, one request's K/V, and its attention;
- ``flat``: ``FlatBatch`` and the attention of many requests over a shared ``KVPool``
  (loop, padded or ragged: ``ATTENTION_FUNCTIONS``, the teaching forms of the runner's
  backends of the same names);
- ``ragged``: one ``flex_attention`` call over a flat batch, its block mask from lengths;
- ``citylm``: ``CityLM`` with ``forward`` (one request), ``forward_flat`` (a flat batch) and
  ``reference_generate`` (the oracle);
- ``loading``: ``load_model`` (the shipped CityLM or a local checkpoint), ``load_citylm``;
  ``load_tokenizer`` (the tokenizer alone) lives in ``minisrv.tokenizer``, without torch;
- ``device``: ``resolve_device``, ``default_dtype``, ``available_devices``;
- ``hf``: ``from_hf_llama``, a Hugging Face Llama checkpoint as a ``CityLM``
  (its tokenizer, ``HFTokenizer``, lives in ``minisrv.tokenizer``).

Every public name is re-exported here, so ``from minisrv.model import X`` is all a user needs.
"""

from __future__ import annotations

from minisrv.model.attention_metadata import flex_index, padded_groups
from minisrv.model.citylm import CityLM
from minisrv.model.device import available_devices, default_dtype, resolve_device
from minisrv.model.flat import (
    ATTENTION_FUNCTIONS,
    FlatBatch,
    PaddedGroup,
    flat_attention_flex,
    flat_attention_loop,
    flat_attention_padded,
    padded_attention,
    padded_sdpa,
    pool_attention,
)
from minisrv.model.hf import (
    config_from_hf,
    from_hf_llama,
    hf_names,
)
from minisrv.model.kvcache import DenseKVCache, cache_attention
from minisrv.model.layers import (
    UNFUSED_PARTS,
    Attend,
    Attention,
    Block,
    LayerAttend,
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    apply_rope_,
    causal_mask,
    fuse_weights,
    fused_row_split,
    grouped_attention,
    joint_kv,
    rope_inv_freq,
    rope_table,
    split_fused_weights,
)
from minisrv.model.loading import (
    CITYLM_NAME,
    META_FILE,
    WEIGHTS_FILE,
    load_citylm,
    load_model,
)
from minisrv.model.ragged import FLEX_AVAILABLE, ragged_block_mask, ragged_tiles
from minisrv.tokenizer import HFTokenizer, folder_eos_ids, load_tokenizer, merge_eos_ids

__all__ = [
    "ATTENTION_FUNCTIONS",
    "FLEX_AVAILABLE",
    "CITYLM_NAME",
    "META_FILE",
    "WEIGHTS_FILE",
    "Attend",
    "Attention",
    "Block",
    "CityLM",
    "DenseKVCache",
    "FlatBatch",
    "HFTokenizer",
    "LayerAttend",
    "Linear",
    "PaddedGroup",
    "flex_index",
    "padded_groups",
    "RMSNorm",
    "SwiGLU",
    "UNFUSED_PARTS",
    "apply_rope",
    "apply_rope_",
    "available_devices",
    "cache_attention",
    "causal_mask",
    "config_from_hf",
    "folder_eos_ids",
    "default_dtype",
    "flat_attention_flex",
    "flat_attention_loop",
    "flat_attention_padded",
    "from_hf_llama",
    "fuse_weights",
    "fused_row_split",
    "grouped_attention",
    "joint_kv",
    "hf_names",
    "load_citylm",
    "load_model",
    "load_tokenizer",
    "merge_eos_ids",
    "padded_attention",
    "padded_sdpa",
    "pool_attention",
    "ragged_block_mask",
    "ragged_tiles",
    "resolve_device",
    "rope_inv_freq",
    "rope_table",
    "split_fused_weights",
]
