"""The trainer: its batched forward is CityLM's forward; documents and schedule are sound."""

from __future__ import annotations

import random

import pytest
import torch

from minisrv.configs import CITYLM
from minisrv.model import CityLM
from minisrv.tokenizer import Tokenizer
from minisrv.train import IGNORE, TrainConfig, batch_logits, lr_at, make_batch, train
from minisrv.train.data import load_cities


def test_batched_training_forward_equals_model_forward() -> None:
    torch.manual_seed(0)
    model = CityLM(CITYLM.with_(n_layers=2)).double().eval()
    model.reset_parameters(std=0.2)
    tok, table = Tokenizer(), load_cities()
    inputs, targets = make_batch(random.Random(0), list(table), table, tok, batch_size=3)
    with torch.no_grad():
        batched = batch_logits(model, inputs)
        for row in range(3):
            n = int((targets[row] != IGNORE).sum())
            alone = model(inputs[row, :n])
            assert torch.max(torch.abs(batched[row, :n] - alone)) < 1e-12


def test_batches_are_bos_documents_ending_in_eos() -> None:
    tok, table = Tokenizer(), load_cities()
    inputs, targets = make_batch(random.Random(1), list(table), table, tok, batch_size=4)
    assert inputs.shape == targets.shape
    for row in range(4):
        n = int((targets[row] != IGNORE).sum())
        assert inputs[row, 0] == tok.bos_id and targets[row, n - 1] == tok.eos_id
        assert torch.equal(inputs[row, 1:n], targets[row, : n - 1])
        assert tok.decode(inputs[row, :n].tolist()).split(":")[0] in table


def test_learning_rate_warms_up_then_decays() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    rates = [lr_at(s, cfg) for s in range(100)]
    assert rates[9] == pytest.approx(1e-3)
    assert rates[0] < rates[5] < rates[9] and rates[10] > rates[50] > rates[99]
    assert rates[99] >= 1e-4


def test_bad_train_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_a_few_steps_lower_the_loss_and_record_the_run() -> None:
    cfg = TrainConfig(steps=6, batch_size=4, eval_every=3, eval_batches=1, warmup_steps=2)
    model, record = train(cfg, progress=False)
    assert not model.training
    assert record["history"]["step"] == [3, 6]
    assert record["final_train_loss"] < 4.2  # log(61) = 4.11 is the uniform guess
    assert set(record["val_countries"]).isdisjoint(record["train_countries"])
