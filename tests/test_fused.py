"""Fused projections (q/k/v in one, gate/up in one) and the rotary table compute what the
unfused layers computed; unfused checkpoints load into them and the trainer still writes
the unfused file layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from minisrv.configs import CITYLM
from minisrv.kv import KVPool
from minisrv.model import (
    UNFUSED_PARTS,
    CityLM,
    FlatBatch,
    RMSNorm,
    apply_rope,
    joint_kv,
    load_citylm,
    onednn,
    rope_inv_freq,
    rope_table,
    split_fused_weights,
)

GQA = CITYLM.with_(name="gqa", n_layers=2, d_model=48, n_heads=6, n_kv_heads=2, head_dim=8,
                   d_ff=80, max_seq_len=64)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotation helper, as the layers computed it before the table."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with the primitive the model's ``Linear`` uses, so that fusing is
    the only difference between the model and ``unfused_logits``."""
    if onednn.ONEDNN_LINEAR is not None and x.dtype == torch.float32:
        return onednn.ONEDNN_LINEAR(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def unfused_logits(model: CityLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one request from the unfused weights, written out op by op (HF's recipe)."""
    cfg = model.config
    w = split_fused_weights(model.state_dict(), cfg)
    n, heads, kv_heads, hd = len(ids), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    angles = torch.arange(n).float()[:, None] * model.inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    mask = torch.ones(n, n, dtype=torch.bool).tril()

    def norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps))

    x = w["embed.weight"][ids]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = product(h, w[p + "attn.wq.weight"]).view(n, heads, hd)
        k = product(h, w[p + "attn.wk.weight"]).view(n, kv_heads, hd)
        v = product(h, w[p + "attn.wv.weight"]).view(n, kv_heads, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", weights, v).reshape(n, heads * hd)
        x = x + product(out, w[p + "attn.wo.weight"])
        h = norm(x, w[p + "mlp_norm.weight"])
        gate, up = product(h, w[p + "mlp.w_gate.weight"]), product(h, w[p + "mlp.w_up.weight"])
        x = x + product(F.silu(gate) * up, w[p + "mlp.w_down.weight"])
    return product(norm(x, w["norm.weight"]), w["lm_head.weight"])


def random_model(config=GQA, std: float = 0.2) -> CityLM:
    torch.manual_seed(0)
    model = CityLM(config)
    model.reset_parameters(std=std)
    return model.eval()


@pytest.fixture(scope="module")
def shipped() -> CityLM:
    return load_citylm("cpu")[0]


@pytest.mark.parametrize("use_onednn", [True, False])
def test_shipped_fused_model_gives_the_unfused_logits(
    shipped: CityLM, use_onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not use_onednn:  # F.linear (MKL) for the model and the reference
        monkeypatch.setattr(onednn, "ONEDNN_LINEAR", None)
    ids = torch.randint(0, shipped.config.vocab_size, (40,),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused, unfused = shipped(ids), unfused_logits(shipped, ids)
    assert fused.dtype == torch.float32
    assert (fused - unfused).abs().max().item() < 1e-5


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=5))
def test_flat_forward_gives_the_unfused_logits(mix: list[tuple[int, int]]) -> None:
    """The engine's path (a flat batch over the pool) against the unfused recipe, per request."""
    model = random_model()
    gen = torch.Generator().manual_seed(len(mix))
    seqs = [torch.randint(0, GQA.vocab_size, (p + n,), generator=gen) for p, n in mix]
    pool = KVPool.for_model(model, 20 * len(mix))
    slots = [pool.alloc(len(seq)) for seq in seqs]
    for (p, _), seq, s in zip(mix, seqs, slots):
        if p:
            model.forward_flat(FlatBatch([seq[:p].tolist()], [s[:p]]), pool)
    got = model.forward_flat(FlatBatch([seq[p:].tolist() for (p, _), seq in zip(mix, seqs)],
                                       slots), pool)
    with torch.no_grad():
        want = torch.cat([unfused_logits(model, seq)[p:] for (p, _), seq in zip(mix, seqs)])
    assert (got - want).abs().max().item() < 1e-5


def test_shipped_file_keeps_the_unfused_layout_and_loads_fused(shipped: CityLM) -> None:
    from importlib import resources

    path = resources.files("minisrv") / "weights" / "citylm.safetensors"
    on_disk = load_file(str(path))
    assert "layers.0.attn.wq.weight" in on_disk and "layers.0.attn.qkv_proj.weight" not in on_disk
    split = split_fused_weights(shipped.state_dict(), shipped.config)
    assert split.keys() == on_disk.keys()
    assert all(torch.equal(split[name], on_disk[name]) for name in on_disk)
    fused = shipped.layers[0].attn.qkv_proj.weight
    assert fused.shape == ((CITYLM.n_heads + 2 * CITYLM.n_kv_heads) * CITYLM.head_dim,
                           CITYLM.d_model)


def test_trainer_writes_the_unfused_layout(tmp_path) -> None:
    from minisrv.train import save

    model = random_model(CITYLM.with_(n_layers=1))
    save(model, {}, tmp_path)
    on_disk = load_file(str(tmp_path / "citylm.safetensors"))
    parts = {f"layers.0.{part}.weight" for group in UNFUSED_PARTS.values() for part in group}
    assert parts <= on_disk.keys()
    assert not any("qkv_proj" in name or "gate_up" in name for name in on_disk)
    again = CityLM(model.config)
    again.load_state_dict(on_disk)
    assert all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), again.state_dict().values()))


def test_a_partial_unfused_state_is_refused_by_name() -> None:
    state = split_fused_weights(random_model().state_dict(), GQA)
    del state["layers.1.attn.wv.weight"]
    with pytest.raises(RuntimeError, match="layers.1.attn.qkv_proj.weight"):
        CityLM(GQA).load_state_dict(state)


def test_rope_table_rows_rotate_as_hf_does() -> None:
    """Table rows and roll give exactly HF's per-step cos/sin and rotate_half."""
    inv_freq = rope_inv_freq(16, 10000.0)
    table = rope_table(inv_freq, 64, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 5, 63, 17, 5])
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    want = x * angles.cos()[:, None] + rotate_half(x) * angles.sin()[:, None]
    rows = table[positions]
    assert torch.equal(apply_rope(x, rows[:, 0], rows[:, 1]), want)


def test_a_models_table_follows_its_dtype() -> None:
    model = random_model().to(torch.float64)
    cos, sin = model.rope_cos_sin(torch.arange(3))
    assert cos.dtype == sin.dtype == torch.float64 and cos.shape == (3, 1, GQA.head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_is_hf_rmsnorm(dtype: torch.dtype) -> None:
    norm = RMSNorm(24, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 24))
    x = (torch.randn(7, 24, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    xf = x.float() if dtype == torch.bfloat16 else x
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    tol = 0.0 if dtype == torch.bfloat16 else 1e-6
    assert (got.double() - want.double()).abs().max().item() <= tol


def test_keys_and_values_are_written_from_one_view() -> None:
    attn = random_model().layers[0].attn
    cos, sin = random_model().rope_cos_sin(torch.arange(4))
    with torch.no_grad():
        q, k, v = attn.project_qkv(torch.randn(4, GQA.d_model), cos, sin)
    kv = joint_kv(k, v)
    assert kv.shape == (4, 2, GQA.n_kv_heads, GQA.head_dim)
    assert kv.data_ptr() == k.data_ptr()  # a view: no copy
    assert torch.equal(kv, torch.stack((k, v), dim=1))
    apart = joint_kv(k.clone(), v.clone())  # not adjacent: stacked
    assert torch.equal(apart, kv) and apart.data_ptr() != k.data_ptr()
