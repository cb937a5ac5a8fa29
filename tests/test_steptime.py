"""The decode-step timings chapter 03 draws: every point timed, in turns, the fastest kept."""

from __future__ import annotations

import pytest

from minisrv.sim import steptime
from minisrv.sim.steptime import decode_step_table


def test_decode_step_table_times_every_point_in_turns_and_keeps_the_fastest(citylm,
                                                                           monkeypatch):
    model, _ = citylm
    order: list[int] = []
    clock = iter([0.5, 0.2, 0.3, 0.1, 0.4, 0.6])  # two rounds of three points

    def fake_timed(model, step):
        order.append(id(step))
        return next(clock)

    monkeypatch.setattr(steptime, "_timed", fake_timed)
    table = decode_step_table(model, (1, 2, 4), attentions=("padded",), context=8, repeats=2,
                              warmup=1)
    assert order[:3] == order[3:] and len(set(order)) == 3  # round after round, same order
    assert table == {"padded": {1: 0.1, 2: 0.2, 4: 0.3}}  # the least of each point's two
    monkeypatch.undo()
    real = decode_step_table(model, (1, 2), context=8, repeats=1, warmup=0)
    assert set(real) == {"padded", "loop"}
    assert all(t > 0 for times in real.values() for t in times.values())
    for bad in ({"sizes": ()}, {"sizes": (0,)}, {"repeats": 0}, {"context": 0}):
        with pytest.raises(ValueError):
            decode_step_table(model, **{"sizes": (1,), "context": 8, **bad})
