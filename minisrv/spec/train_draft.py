"""Train the draft model for speculative decoding: ``python -m minisrv.spec.train_draft``.

The draft learns the city language from the same documents, schedule and optimiser as
CityLM (``minisrv.train``'s batches, loss, learning-rate schedule and evaluation are reused
as they are); only the model is smaller (``CITYDRAFT``: one layer, d_model 64), so a check
of its guesses by CityLM is cheap to prepare. Same seed, same steps: the same weights on
the same torch build and thread count. It writes ``citydraft.safetensors`` and
``citydraft.json`` beside CityLM's weights, which ``load_draft`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from minisrv.data import GEONAMES_ATTRIBUTION, load_cities, split_countries
from minisrv.model import CityLM
from minisrv.spec.config import DRAFT_META_FILE, DRAFT_WEIGHTS_FILE, draft_config
from minisrv.tokenizer import Tokenizer
from minisrv.train import TrainConfig, batch_loss, evaluate, lr_at, make_batch

# The draft is ~20x smaller than CityLM, so more steps fit in the same minutes.
DRAFT_TRAIN = TrainConfig(steps=1000, batch_size=32, lr=5e-3, warmup_steps=60, eval_every=200)


def train_draft(cfg: TrainConfig = DRAFT_TRAIN, progress: bool = False) -> tuple[CityLM, dict]:
    """Train a fresh draft on the training countries; returns it (eval mode) and a record."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer, table = Tokenizer(), load_cities()
    train_codes, val_codes = split_countries(list(table))
    eval_rng = random.Random(cfg.seed + 1)
    evals = {
        split: [make_batch(eval_rng, codes, table, tokenizer, cfg.batch_size)
                for _ in range(cfg.eval_batches)]
        for split, codes in (("train", train_codes), ("val", val_codes))
    }
    model = CityLM(draft_config(tokenizer.vocab_size))
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    history: dict[str, list] = {"step": [], "train_loss": [], "val_loss": []}
    start = time.perf_counter()
    model.train()
    for step in range(cfg.steps):
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
            if progress:
                print(f"step {step + 1}: train {history['train_loss'][-1]:.4f}, "
                      f"val {history['val_loss'][-1]:.4f}", flush=True)
    record = {
        "seed": cfg.seed,
        "steps": cfg.steps,
        "train_config": dataclasses.asdict(cfg),
        "history": history,
        "final_train_loss": history["train_loss"][-1],
        "final_val_loss": history["val_loss"][-1],
        "train_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    return model.eval(), record


def save_draft(model: CityLM, record: dict, out_dir: str | Path) -> None:
    """Write ``citydraft.safetensors`` (float32) and ``citydraft.json`` (config + run record)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", torch.float32).contiguous()
             for name, t in model.state_dict().items()}
    save_file(state, str(out / DRAFT_WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer = Tokenizer()
    meta = {
        "config": dataclasses.asdict(model.config),
        "tokenizer": {"alphabet": tokenizer.alphabet, "vocab_size": tokenizer.vocab_size},
        "attribution": GEONAMES_ATTRIBUTION,
        **record,
    }
    (out / DRAFT_META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: train the draft with the shipped settings and write its weights."""
    parser = argparse.ArgumentParser(description="Train the speculative-decoding draft model.")
    parser.add_argument("--steps", type=int, default=DRAFT_TRAIN.steps)
    parser.add_argument("--seed", type=int, default=DRAFT_TRAIN.seed)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "weights")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(DRAFT_TRAIN, steps=args.steps, seed=args.seed)
    model, record = train_draft(cfg, progress=True)
    save_draft(model, record, args.out)
    print(f"train loss {record['final_train_loss']:.4f}, val loss {record['final_val_loss']:.4f},"
          f" {record['train_seconds']:.0f} s; wrote {args.out / DRAFT_WEIGHTS_FILE}")


if __name__ == "__main__":
    main()
