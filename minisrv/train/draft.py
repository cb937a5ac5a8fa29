"""Train the draft model for speculative decoding: ``python -m minisrv.train --draft``.

The draft learns the city language from the same documents, schedule and optimiser as
CityLM (``minisrv.train.citylm``'s batches, loss, learning-rate schedule and evaluation are reused
as they are); only the model is smaller (``CITYDRAFT``: one layer, d_model 64), so a check
of its guesses by CityLM is cheap to prepare. Same seed, same steps: the same weights on
the same torch build and thread count. It writes ``citydraft.safetensors`` and
``citydraft.json`` beside CityLM's weights, which ``load_draft`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from minisrv.model import CityLM
from minisrv.spec.config import DRAFT_META_FILE, DRAFT_WEIGHTS_FILE, draft_config
from minisrv.tokenizer import Tokenizer
from minisrv.train.citylm import TrainConfig, train
from minisrv.train.data import GEONAMES_ATTRIBUTION

# The draft is ~20x smaller than CityLM, so more steps fit in the same minutes.
DRAFT_TRAIN = TrainConfig(steps=1000, batch_size=32, lr=5e-3, warmup_steps=60, eval_every=200)


def train_draft(cfg: TrainConfig = DRAFT_TRAIN, progress: bool = False) -> tuple[CityLM, dict]:
    """Train a fresh draft on the training countries; returns it (eval mode) and a record.

    ``minisrv.train.train`` with the draft's shape: the same batches, loss, schedule and
    evaluation as CityLM's run.
    """
    vocab_size = Tokenizer().vocab_size
    return train(cfg, progress, model_config=draft_config(vocab_size), name="the draft")


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
