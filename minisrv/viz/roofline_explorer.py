"""The roofline chapter's widget and explorer: a model, a GPU, a context and a batch, and
what one decode step then costs (``summary_line``) beside the roofline and the memory budget
of ``minisrv.viz.roofline``, drawn for the contexts around the chosen one."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from minisrv.configs import GPUS, MODELS, GPUSpec, ModelConfig
from minisrv.sim.roofline import decode_step_cost
from minisrv.sim.sizing import running_batch
from minisrv.viz.explorer import Explorer, Frame, explorer
from minisrv.viz.roofline import (
    BATCH_CHOICES,
    CONTEXT_CHOICES,
    DTYPES,
    memory_wall,
    plot_memory_budget,
    plot_roofline,
)

__all__ = ["contexts_around", "roofline_explorer", "roofline_widget", "summary_line"]


def _requests(n: int) -> str:
    return f"{n:,} request{'' if n == 1 else 's'}"


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures, trailing zeros kept (4.80, not ``.3g``'s
    4.8), so that a step reads like the chapter's 4.83 beside it; whole from 100 ms."""
    ms = seconds * 1e3
    return f"{ms:.{max(0, 2 - math.floor(math.log10(ms)))}f}"


def summary_line(
    cfg: ModelConfig, gpu: GPUSpec, context_len: int, batch: int, dtype_bytes: float = 2
) -> str:
    """Two short lines about the chosen point, printed above the widget's figures (short, so
    they fit the book's column): the step and its bound, then throughput and capacity; a batch
    past the memory wall as the wall's batch (``running_batch``), the most a server runs."""
    wall = memory_wall(cfg, gpu, context_len, dtype_bytes)
    runs = running_batch(cfg, gpu, context_len, batch, dtype_bytes)
    if not runs:
        return (f"batch {batch:,} at context {context_len:,}: not one request fits\n"
                f"{cfg.name} on {gpu.name}: no throughput")
    cost = decode_step_cost(cfg, gpu, runs, context_len, dtype_bytes)
    gain = runs * decode_step_cost(cfg, gpu, 1, context_len, dtype_bytes).time_s / cost.time_s
    head = (f"batch {batch:,} at context {context_len:,}" if runs == batch else
            f"batch {batch:,} > wall {runs:,} at context {context_len:,}")
    return (
        f"{head}: step {_ms(cost.time_s)} ms ({cost.bound}-bound)\n"
        f"{runs / cost.time_s:,.0f} tokens/s = {gain:.3g}x batch 1; {_requests(wall)} fit"
    )


def contexts_around(context_len: int, max_seq_len: int = 0) -> list[int]:
    """The three contexts the widget and the explorer draw for a chosen one: an eighth of
    it, it, and eight times it (1024 gives the chapter's 128, 1024 and 8192), the longest
    cut to the model's ``max_seq_len`` when given (LLaMA-3-8B stops at 8,192 tokens)."""
    longest = min(context_len * 8, max_seq_len) if max_seq_len else context_len * 8
    return sorted({max(16, context_len // 8), context_len, max(context_len, longest)})


def roofline_widget(model: str = "LLaMA-3-8B", gpu: str = "H100 SXM", context_len: int = 1024,
                    batch: int = 16, dtype: str = "bf16 / fp16"):
    """Drop-downs and sliders for model, GPU, context length, batch size and dtype; every
    change redraws the roofline and the memory budget. Needs a live kernel."""
    import ipywidgets as widgets
    from IPython.display import display

    from minisrv.viz.widgets import panel

    controls = {
        "model": widgets.Dropdown(options=list(MODELS), value=model, description="model"),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        "context_len": widgets.SelectionSlider(
            options=CONTEXT_CHOICES, value=context_len, description="context"
        ),
        "batch": widgets.SelectionSlider(options=BATCH_CHOICES, value=batch, description="batch"),
        "dtype": widgets.Dropdown(options=list(DTYPES), value=dtype, description="dtype"),
    }

    def redraw(model: str, gpu: str, context_len: int, batch: int, dtype: str) -> None:
        cfg, card, width = MODELS[model], GPUS[gpu], DTYPES[dtype]
        print(summary_line(cfg, card, context_len, batch, width))
        display(plot_roofline(cfg, card, contexts_around(context_len, cfg.max_seq_len), width,
                              batch=batch))
        display(plot_memory_budget(cfg, card, context_len, batch, width))

    return panel(redraw, controls, per_row=3)


EXPLORER_CONTEXTS: tuple[int, ...] = (128, 1024, 4096, 8192)
"""Contexts the page holds: short enough to turn compute-bound, and long enough that the memory
wall falls below the batches tried; none past LLaMA-3-8B's 8,192-token context."""
EXPLORER_BATCHES: tuple[int, ...] = (1, 16, 64, 256, 1024)
"""Batches the page holds: from one request to past LLaMA-3-8B's memory wall on an H100 at
every context but the shortest."""


def _choice(kind: str, name: str, options: dict) -> object:
    if name not in options:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {list(options)}")
    return options[name]


def roofline_explorer(model: str = "LLaMA-3-8B", gpu: str = "H100 SXM", context_len: int = 1024,
                      batch: int = 16, dtype: str = "bf16 / fp16",
                      contexts: Sequence[int] = EXPLORER_CONTEXTS,
                      batches: Sequence[int] = EXPLORER_BATCHES) -> Explorer:
    """``roofline_widget``'s figures for every batch and context of the grid, for the page.

    Each state shows ``summary_line``, the roofline of the three ``contexts_around`` the
    context with the batch marked on it, and the memory bar of the batch; it carries the
    step's time, bound and throughput and how many requests fit. A batch past the memory wall
    reports the wall's batch (``running_batch``): the most a server can run. ``context_len``
    and ``batch`` open the page and join the grid if missing from it.
    """
    cfg = _choice("model", model, MODELS)
    card = _choice("GPU", gpu, GPUS)
    width = _choice("dtype", dtype, DTYPES)
    if cfg.max_seq_len and (longest := max(*contexts, context_len)) > cfg.max_seq_len:
        raise ValueError(f"{cfg.name} reads at most {cfg.max_seq_len:,} tokens, not {longest:,}")

    def draw(context_len: int, batch: int) -> Frame:
        wall = memory_wall(cfg, card, context_len, width)
        runs = running_batch(cfg, card, context_len, batch, width)
        cost = decode_step_cost(cfg, card, max(runs, 1), context_len, width)
        summary = summary_line(cfg, card, context_len, batch, width)
        asked = f"{_requests(batch)} of {context_len:,} tokens"  # past the wall: 2 or more
        caption = (f"{asked} {'fits' if batch == 1 else 'fit'}; {batch / cost.time_s:,.0f} "
                   "tokens/s." if runs == batch else f"{asked} do not fit: the wall is at "
                   f"{wall:,}, whose batch makes {runs / cost.time_s:,.0f} tokens/s." if runs
                   else f"not one request of {context_len:,} tokens fits.")
        return Frame(
            [f"<pre>{html.escape(summary)}</pre>",
             plot_roofline(cfg, card, contexts_around(context_len, cfg.max_seq_len), width,
                           batch=batch),
             plot_memory_budget(cfg, card, context_len, batch, width)],
            {"step_ms": cost.time_s * 1e3, "bound": cost.bound, "batch_run": runs,
             "tokens_per_s": runs / cost.time_s, "requests_fit": wall},
            caption=caption)

    return explorer(draw, [("context_len", "context (tokens)", sorted({*contexts, context_len}),
                            context_len),
                           ("batch", "batch (requests)", sorted({*batches, batch}), batch)],
                    live=lambda: roofline_widget(model, gpu, context_len, batch, dtype))
