"""The GPU appendix's step-mix explorer (``minisrv.viz.step_mix``): each state's numbers are
the call counts of ``minisrv.experiments.call_work`` for its step, and its caption prices
the walks it shows."""

from __future__ import annotations

import math

import pytest

from minisrv.experiments import hybrid_work, padded_work, ragged_work
from minisrv.viz.step_mix import (
    STEP_MIX_CONTROLS,
    plot_step_mix,
    step_mix_caption,
    step_mix_metrics,
)


@pytest.mark.parametrize("prefill, decodes, context, longest", [
    (1000, 127, 512, None), (0, 16, 128, None), (4000, 1, 2048, None), (1000, 127, 512, 8000)])
def test_a_state_counts_its_step(prefill, decodes, context, longest) -> None:
    """The step is the prefill then the decodes, the last at ``longest`` when it is given."""
    contexts = [context] * (decodes - 1) + [longest or context]
    step = ([(0, prefill)] if prefill else []) + [(c, 1) for c in contexts]
    metrics = step_mix_metrics(prefill, decodes, context, longest)
    for call, work in (("padded", padded_work(step)), ("ragged", ragged_work(step)),
                       ("hybrid", hybrid_work(step))):
        assert (metrics[f"scores_{call}"], metrics[f"keys_{call}"],
                metrics[f"walk_{call}"]) == tuple(work)
    assert metrics["keys_needed"] == prefill + sum(c + 1 for c in contexts)
    assert (metrics["keys_padded"] > metrics["keys_ragged"]) == (longest is not None)
    caption = step_mix_caption(prefill, decodes, context, metrics, 0.5)
    assert f"walks {metrics['walk_ragged']:,} key tiles, about " \
           f"{metrics['walk_ragged'] * 0.5:,.1f} ms" in caption
    assert ("the hybrid is the padded call" in caption) == (prefill == 0)
    fig = plot_step_mix(metrics, "a step", 0.5)
    assert len(fig.axes) == 3


def test_the_page_opens_on_the_work_tables_mixed_step_within_the_state_limit() -> None:
    from minisrv.viz.explorer import MAX_STATES

    defaults = {control[0]: control[3] for control in STEP_MIX_CONTROLS}
    assert defaults == {"prefill": 1000, "decodes": 127, "context": 512,
                        "longest": "as the others"}
    values = {control[0]: control[2] for control in STEP_MIX_CONTROLS}
    assert min(values["decodes"]) >= 1  # no empty step among the states
    assert math.prod(len(v) for v in values.values()) <= MAX_STATES
