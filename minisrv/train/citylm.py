"""Train CityLM from scratch on the city language: ``python -m minisrv.train``.

This reproduces the weights that ship in ``minisrv/weights/`` (same seed, same steps; bit
for bit only on the same torch build and thread count). It runs on a laptop CPU in about
ten minutes, so readers can retrain or change the model. The serving chapters never need
it: they load the shipped weights with ``minisrv.load_citylm``.

Training documents (``minisrv.train.data.sample_document``) are 1-6 random country lines, all
but the last cut short like few-shot examples, wrapped in <bos> ... <eos>. Each batch
holds documents with the same number of lines, which keeps right-padding small. Padding
positions carry no loss, and causal attention keeps them from influencing the real tokens
before them.

The model memorises the lines of the training countries; the validation countries are
never seen, so their loss rises as memorisation sharpens (it is recorded to show that).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minisrv.configs import CITYLM, ModelConfig
from minisrv.model import META_FILE, WEIGHTS_FILE, CityLM, split_fused_weights
from minisrv.tokenizer import Tokenizer
from minisrv.train.data import (
    GEONAMES_ATTRIBUTION,
    MAX_DOC_LINES,
    load_cities,
    sample_document,
    split_countries,
)

IGNORE = -100  # target id that cross_entropy skips (padding)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of the shipped run (the defaults) or of a reader's own run."""

    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 60
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4  # fixed batches per split at each evaluation
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("steps", "batch_size", "eval_every", "eval_batches"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def batch_logits(model: CityLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] for B documents that all start at position 0.

    The same layers as ``CityLM.forward``, batched for training, with PyTorch's fused
    attention kernel in place of the explicit one; a test checks both give equal logits.
    """
    batch, length = ids.shape
    cos, sin = model.rope_cos_sin(torch.arange(length, device=ids.device))
    x = model.embed(ids)
    for layer in model.layers:
        q, k, v = layer.attn.project_qkv(layer.attn_norm(x), cos, sin)
        group = layer.attn.n_heads // layer.attn.n_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + layer.attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    return model.lm_head(model.norm(x))


def make_batch(
    rng: random.Random,
    codes: Sequence[str],
    table: dict[str, list[str]],
    tokenizer: Tokenizer,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [B, T]: documents of one random line count, right-padded."""
    n_lines = rng.randint(1, MAX_DOC_LINES)
    docs = [
        [*tokenizer.encode(sample_document(rng, codes, table, n_lines)), tokenizer.eos_id]
        for _ in range(batch_size)
    ]
    length = max(len(d) for d in docs) - 1
    inputs = torch.full((batch_size, length), tokenizer.eos_id, dtype=torch.long)
    targets = torch.full((batch_size, length), IGNORE, dtype=torch.long)
    for row, doc in enumerate(docs):
        inputs[row, : len(doc) - 1] = torch.tensor(doc[:-1])
        targets[row, : len(doc) - 1] = torch.tensor(doc[1:])
    return inputs, targets


def batch_loss(model: CityLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per character) over the non-padding targets."""
    logits = batch_logits(model, inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model: CityLM, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss per character over fixed batches (weighted by their real-token counts)."""
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        n = int((targets != IGNORE).sum())
        total += float(batch_loss(model, inputs, targets)) * n
        count += n
    model.train()
    return total / count


def train(cfg: TrainConfig, progress: bool = True, model_config: ModelConfig | None = None,
          name: str = "CityLM") -> tuple[CityLM, dict]:
    """Train a fresh CityLM; returns it (eval mode) and a record of the run.

    ``model_config`` gives another shape on the same documents, schedule and optimiser (the
    speculative-decoding draft, ``minisrv.train.draft``); its vocabulary must be the
    tokenizer's. ``name`` labels the progress bar.
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer, table = Tokenizer(), load_cities()
    train_codes, val_codes = split_countries(list(table))
    eval_rng = random.Random(cfg.seed + 1)  # fixed evaluation batches, independent of steps
    evals = {
        split: [
            make_batch(eval_rng, codes, table, tokenizer, cfg.batch_size)
            for _ in range(cfg.eval_batches)
        ]
        for split, codes in (("train", train_codes), ("val", val_codes))
    }
    model = CityLM(model_config or CITYLM.with_(vocab_size=tokenizer.vocab_size))
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    history: dict[str, list] = {"step": [], "train_loss": [], "val_loss": []}
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.steps), desc=f"training {name}", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = batch_loss(model, *make_batch(rng, train_codes, table, tokenizer, cfg.batch_size))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            history["step"].append(step + 1)
            history["train_loss"].append(round(evaluate(model, evals["train"]), 4))
            history["val_loss"].append(round(evaluate(model, evals["val"]), 4))
            bar.set_postfix(train=history["train_loss"][-1], val=history["val_loss"][-1])
    record = {
        "seed": cfg.seed,
        "steps": cfg.steps,
        "train_config": dataclasses.asdict(cfg),
        "train_countries": train_codes,
        "val_countries": val_codes,
        "history": history,
        "final_train_loss": history["train_loss"][-1],
        "final_val_loss": history["val_loss"][-1],
        "train_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    return model.eval(), record


def save(model: CityLM, record: dict, out_dir: str | Path) -> None:
    """Write ``citylm.safetensors`` (float32) and ``citylm.json`` (config + run record).

    The file keeps q, k, v and gate, up as separate tensors (``split_fused_weights``), the
    layout it has always had; loading fuses them again.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in split_fused_weights(model.state_dict(), model.config).items()
    }
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = dataclasses.asdict(model.config)
    meta = {
        "config": config,
        "tokenizer": {"alphabet": Tokenizer().alphabet, "vocab_size": Tokenizer().vocab_size},
        "attribution": GEONAMES_ATTRIBUTION,
        **record,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: train with the shipped settings and write the weights (``python -m
    minisrv.train``; with ``--draft`` that trains the draft, ``minisrv.train.draft``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description="Train CityLM on the city language.")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "weights", help="output folder"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(
        defaults,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
    )
    model, record = train(cfg)
    save(model, record, args.out)
    print(
        f"train loss {record['final_train_loss']:.4f}, val loss {record['final_val_loss']:.4f}, "
        f"{record['train_seconds']:.0f} s; wrote {args.out / WEIGHTS_FILE}"
    )


if __name__ == "__main__":
    main()
