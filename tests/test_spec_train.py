"""The draft's trainer: CityDraft's shape, a few steps lower the loss, the files it writes."""

from __future__ import annotations

import json

from minisrv.spec import CITYDRAFT, DRAFT_META_FILE, DRAFT_WEIGHTS_FILE
from minisrv.train import TrainConfig
from minisrv.train.draft import save_draft, train_draft


def test_a_few_steps_lower_the_loss_and_save_writes_the_draft_files(tmp_path) -> None:
    cfg = TrainConfig(steps=6, batch_size=4, eval_every=3, eval_batches=1, warmup_steps=2)
    model, record = train_draft(cfg)
    assert model.config == CITYDRAFT and not model.training
    assert record["history"]["step"] == [3, 6]
    assert record["final_train_loss"] < 4.2  # log(61) = 4.11 is the uniform guess
    save_draft(model, record, tmp_path)
    meta = json.loads((tmp_path / DRAFT_META_FILE).read_text())
    assert meta["config"]["name"] == "CityDraft" and meta["steps"] == 6
    assert (tmp_path / DRAFT_WEIGHTS_FILE).stat().st_size > 0
