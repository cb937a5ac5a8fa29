"""The overview's step-by-step run, drawn: the KV pool after each step, who did what in it.

``experiments.overview.step_by_step`` keeps every step of a small real run; this module draws
one step of it (``plot_kv_pool``, ``step_table``, both in ``step_frame``), the whole run as a
table (``trace_summary``), and puts the steps behind a slider: ``step_widget`` in a kernel,
``step_explorer`` in the rendered page, where every step is drawn in advance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from matplotlib.patches import Patch, Rectangle

from minisrv.experiments.overview import (
    DEMO_LENGTHS,
    DEMO_QUESTIONS,
    RequestAtStep,
    StepByStep,
    StepView,
    step_by_step,
)
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.style import (
    BookFigure,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    styled,
)

__all__ = ["plot_kv_pool", "step_explorer", "step_frame", "step_table", "step_widget",
           "trace_summary"]

SLOTS_PER_ROW = 16
"""Slots drawn per row of the pool: 16 cells leave each one wide enough for its character."""
HELD_ALPHA = 0.3  # a slot a request holds
WRITTEN_ALPHA = 0.9  # a slot the step wrote: the same colour, darker
SHOWN = {"\n": "↵", " ": "␣"}
"""Characters a cell or a table could not show plainly; special tokens show their name."""


def _token(tok: Any, token: int) -> str:
    """One token as a cell shows it: its character, or the special token's short name."""
    if token == tok.bos_id:
        return "bos"
    if token in tok.eos_ids:
        return "eos"
    text = tok.decode([token])
    return SHOWN.get(text, text)


def _text(tok: Any, tokens: Sequence[int]) -> str:
    """Decoded text as the pool's cells show it (a space as ␣, a newline as ↵), so the table
    and the grid spell the same token the same way."""
    return "".join(SHOWN.get(ch, ch) for ch in tok.decode(list(tokens)))


def _name(rid: int) -> str:
    return f"r{rid}"


def _check(run: StepByStep) -> None:
    """Every state drawn belongs to a run whose tokens are those each request gets alone."""
    if run.identical != len(run.prompts):
        raise RuntimeError(f"only {run.identical} of {len(run.prompts)} requests got the tokens "
                           "they get alone: the engine changed what was computed")


def _step(run: StepByStep, step: int) -> StepView:
    if not 0 <= step < len(run.steps):
        raise ValueError(f"step must be in 0..{len(run.steps) - 1}, got {step}")
    return run.steps[step]


def _written(req: RequestAtStep) -> int:
    """How many of the request's slots this step wrote: its prompt for a prefill, one slot
    (the token sampled the step before) for a decode, none otherwise."""
    if req.role == "prefill":
        return len(req.slots)
    return 1 if req.role == "decode" and req.slots else 0


@styled
def plot_kv_pool(run: StepByStep, step: int, tok: Any) -> BookFigure:
    """The KV pool after ``step``: one cell per slot, coloured by the request holding it and
    labelled with the token whose keys and values it stores; the slots the step wrote are
    drawn dark. A finished request's slots are free again at the end of its last step."""
    view = _step(run, step)
    rows = -(-run.kv_capacity // SLOTS_PER_ROW)
    fig, ax = page_figure(height_in=1.3 + 0.45 * rows)
    owner: dict[int, tuple[int, str, bool]] = {}
    for req in view.requests:
        tokens = [*run.prompts[req.rid], *req.output]
        fresh = set(req.slots[len(req.slots) - _written(req):])
        for position, slot in enumerate(req.slots):
            owner[slot] = (req.rid, _token(tok, tokens[position]), slot in fresh)
    for slot in range(run.kv_capacity):
        x, y = slot % SLOTS_PER_ROW, slot // SLOTS_PER_ROW
        rid, text, fresh = owner.get(slot, (None, "", False))
        color = "white" if rid is None else f"C{rid % 10}"
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color,
                               alpha=WRITTEN_ALPHA if fresh else HELD_ALPHA,
                               edgecolor="0.4", lw=0.8))
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center",
                color="white" if fresh else "black")
    ax.set(xlim=(0, SLOTS_PER_ROW), ylim=(rows, 0), xticks=[],
           yticks=[r + 0.5 for r in range(rows)])
    ax.set_yticklabels([f"slots {r * SLOTS_PER_ROW}-{(r + 1) * SLOTS_PER_ROW - 1}"
                        for r in range(rows)])
    ax.tick_params(length=0)
    ax.grid(False)
    label_axes(ax, f"KV pool after step {step}: {view.slots_held} of {run.kv_capacity} slots "
               "held")
    # the swatch is drawn as the request's held cells are (alpha 0.3), so it matches the pool
    handles = [Patch(facecolor=f"C{r.rid % 10}", alpha=HELD_ALPHA, edgecolor="0.4",
                     label=f"{_name(r.rid)} {_prompt(run, r.rid, tok)}")
               for r in view.requests]
    # neutral grey: a step can write slots of several requests, each in its own colour
    handles.append(Patch(facecolor="0.25", alpha=WRITTEN_ALPHA, edgecolor="0.4",
                         label="darker: written in this step"))
    legend_below(fig, handles, ncol=len(handles))
    return fig


def _prompt(run: StepByStep, rid: int, tok: Any) -> str:
    """A request's prompt as text (without ``<bos>``)."""
    return tok.decode(run.prompts[rid])


def _did(req: RequestAtStep, tok: Any) -> str:
    """What a request did in the step, in a few words."""
    new = _text(tok, req.new)
    did = {"waiting": "waits for a place",
           "prefill": f"prefill: {len(req.slots)} tokens, samples {new}",
           "decode": f"decode: samples {new}",
           "paused": "paused: sits out the prefill step",
           "done": "finished earlier"}[req.role]
    return did + (", finishes" if req.finished and req.role != "done" else "")


def step_table(run: StepByStep, step: int, tok: Any) -> pd.DataFrame:
    """One row per request after ``step``: what it did in the step, its text so far and the
    KV slots it holds, in token order (as runs of consecutive slots), so a slot list that
    jumps back says a later token landed in a lower slot."""
    from minisrv.experiments.server_walk import slot_ranges

    rows = [{"request": _name(req.rid), "prompt": _prompt(run, req.rid, tok),
             "in this step": _did(req, tok), "output so far": _text(tok, req.output),
             "KV slots (in token order)": slot_ranges(req.slots) or "-"}
            for req in _step(run, step).requests]
    return one_header_row(pd.DataFrame(rows).set_index("request"))


def trace_summary(run: StepByStep) -> pd.DataFrame:
    """The whole run, one row per step: who was prefilled, decoded, sat out or waited, who
    finished, and the KV slots held once the step was over."""
    def names(rids: Sequence[int]) -> str:
        return ", ".join(map(_name, rids)) or "-"

    rows = []
    for view in run.steps:
        record = view.record
        rows.append({"step": record.index, "prefill": names(record.prefill),
                     "decode": names(record.decode), "paused": names(record.paused),
                     "waiting": names([r.rid for r in view.requests if r.role == "waiting"]),
                     "finished": names(record.finished), "slots held": view.slots_held})
    return one_header_row(pd.DataFrame(rows).set_index("step"))


def _caption(run: StepByStep, step: int) -> str:
    record = run.steps[step].record
    parts = []
    def who(rids: Sequence[int], one: str, many: str) -> str:
        return f"{', '.join(map(_name, rids))} {one if len(rids) == 1 else many}"

    if record.prefill:
        parts.append(who(record.prefill, "is", "are") + f" prefilled ({record.prefill_tokens} "
                     "tokens)")
    if record.decode:
        parts.append(who(record.decode, "decodes one token", "decode one token each"))
    if record.paused:
        parts.append(who(record.paused, "is paused", "are paused"))
    if record.finished:
        parts.append(who(record.finished, "finishes", "finish"))
    return (f"Step {step}: {'; '.join(parts)}; {run.steps[step].slots_held} of "
            f"{run.kv_capacity} KV slots held after it.")


def step_frame(run: StepByStep, step: int, tok: Any) -> Frame:
    """Step ``step`` of ``run``: the pool, the table and the step's numbers. Refuses a run
    whose outputs differ from each request generated alone."""
    _check(run)
    view = _step(run, step)
    record = view.record
    metrics = {"step": step, "batch": record.batch_size, "prefill_tokens": record.prefill_tokens,
               "slots_held": view.slots_held, "kv_used": record.kv_used,
               "tokens_out": sum(len(r.output) for r in view.requests),
               "finished": sum(r.finished for r in view.requests),
               "requests_checked": run.identical}
    return Frame([plot_kv_pool(run, step, tok), step_table(run, step, tok)], metrics,
                 caption=_caption(run, step))


def step_widget(run: StepByStep, tok: Any, step: int = 0) -> Any:
    """A slider over the steps of ``run``, redrawing ``step_frame``. Needs a live kernel."""
    from IPython.display import display

    from minisrv.viz.widgets import panel, slider

    def redraw(step: int) -> None:
        frame = step_frame(run, step, tok)
        for part in frame.parts:
            display(part)
        print(frame.caption)

    return panel(redraw, {"step": slider(step, 0, len(run.steps) - 1, "step")})


def step_explorer(model: Any, tok: Any, questions: Sequence[str] = DEMO_QUESTIONS,
                  lengths: Sequence[int] = DEMO_LENGTHS, step: int = 0, kv_capacity: int = 32,
                  max_running: int = 2) -> Explorer:
    """Every step of ``step_by_step``'s run of ``questions`` (``lengths`` tokens each) drawn
    in advance, behind a step slider; opens at ``step``. The kernel face is ``step_widget``.
    """
    run = step_by_step(model, [tok.encode(q) for q in questions], list(lengths),
                       kv_capacity=kv_capacity, max_running=max_running)
    _check(run)
    steps = list(range(len(run.steps)))
    return explorer(lambda step: step_frame(run, step, tok), [("step", "step", steps, step)],
                    live=lambda: step_widget(run, tok, step))
