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


def test_roofline_table_charges_the_loop_one_launch_per_extra_request_and_layer():
    """The simulated figure: padded is the roofline step, the loop adds only its launches."""
    from minisrv.configs import H100, LLAMA3_8B
    from minisrv.sim.roofline import decode_step_time
    from minisrv.sim.steptime import roofline_decode_step_table

    table = roofline_decode_step_table(LLAMA3_8B, H100, (1, 16), context=1024, launch_s=1e-5)
    assert table["padded"][16] == pytest.approx(decode_step_time(LLAMA3_8B, H100, 16, 1024))
    assert table["loop"][1] == pytest.approx(table["padded"][1])  # one request: one call
    extra = table["loop"][16] - table["padded"][16]
    assert extra == pytest.approx(LLAMA3_8B.n_layers * 15 * 1e-5)
    assert table["padded"][16] / 16 < 0.1 * table["padded"][1]  # the weight read is shared
    for bad in ({"sizes": ()}, {"sizes": (0,)}, {"launch_s": -1.0}, {"attentions": ("flex",)}):
        with pytest.raises(ValueError):
            roofline_decode_step_table(LLAMA3_8B, H100, **{"sizes": (1,), **bad})
