"""Diagrams for the overview: the server's architecture and the map of chapters.

Both are drawn from the small tables below, so when a chapter lands, adding one row here
updates the README picture, the intro and the overview chapter together.
"""

from __future__ import annotations

from typing import NamedTuple

import graphviz

from minisrv.viz.style import (
    BookFigure,
    graph_attrs,
    label_axes,
    legend_below,
    one_header_row,
    page_figure,
    plain_log_ticks,
    styled,
)


class Chapter(NamedTuple):
    file: str  # notebook stem under chapters/
    title: str  # short title used in diagrams
    question: str  # the question the chapter answers
    modules: tuple[str, ...]  # files or packages under minisrv/ it builds


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00_overview", "The server at a glance",
            "What does an inference server do, and what model do we serve?",
            ("model/", "tokenizer.py", "train/")),
    Chapter("01_kv_cache", "KV cache and batching",
            "How big is the KV cache, and why must a server batch?",
            ("configs.py", "kvsize.py", "sim/sizing.py", "sim/roofline.py")),
    Chapter("02_scheduler", "The scheduler loop",
            "How does continuous batching keep the GPU busy?",
            ("scheduler/", "runner/", "sim/", "engine.py", "workloads/")),
    Chapter("03_selective_batching", "Selective batching and the KV pool",
            "How does one forward pass serve many requests, and how many fit in memory?",
            ("model/flat.py", "kv/pool.py", "runner/model_runner.py",
             "scheduler/admission.py")),
    Chapter("03a_chunked_prefill", "Chunked prefill",
            "How do decodes keep streaming while a long prompt is prefilled?",
            ("scheduler/chunked.py", "experiments/chunked.py")),
    Chapter("04_radix_attention", "RadixAttention",
            "How does a server reuse the KV of prefixes it has already computed?",
            ("kv/radix.py", "kv/manager.py", "experiments/radix.py")),
    Chapter("04a_host_tier", "A host tier for the KV cache",
            "What if evicted KV were kept in host memory and loaded back?",
            ("kv/host.py", "kv/hiradix.py", "experiments/host_tier.py")),
    Chapter("04b_pages", "KV memory in pages",
            "What does a page of KV cost, buy and lose, and how does vLLM cache blocks?",
            ("kv/allocator.py", "kv/blocks.py", "experiments/pages.py")),
    Chapter("05_cache_aware", "Cache-aware scheduling",
            "Which waiting request should run first when some prefixes are cached?",
            ("scheduler/policy.py", "experiments/cache_aware.py")),
    Chapter("06_routing", "Routing across workers",
            "Which replica should serve a request when each has its own cache?",
            ("router/", "experiments/routing.py")),
    Chapter("07_overlap", "Zero-overhead scheduling",
            "How does the CPU plan the next step while the device computes this one?",
            ("scheduler/overlap.py", "runner/device.py", "runner/futures.py")),
    Chapter("07a_speculative_decoding", "Speculative decoding",
            "How can one decode step yield several tokens per request?",
            ("spec/", "experiments/speculative.py")),
    Chapter("08_server", "Serving it for real",
            "What does the whole request path look like behind an OpenAI-compatible API?",
            ("server/",)),
    Chapter("08a_structured_output", "Structured output",
            "How does a server make every answer match a grammar or a JSON schema?",
            ("grammar/", "experiments/structured.py")),
    Chapter("09_gpu_appendix", "A Hugging Face checkpoint on a GPU",
            "How does the engine serve a Hugging Face checkpoint, near the roofline?",
            ("model/ragged.py", "model/hf.py", "experiments/gpu.py")),
)


class Component(NamedTuple):
    name: str  # box label
    modules: tuple[str, ...]  # files or packages under minisrv/ that implement it
    chapter: str | None  # chapter file that builds it; None while no chapter does yet


COMPONENTS: dict[str, Component] = {
    "api": Component("HTTP server\n(OpenAI API, SSE)", ("server/",), "08_server"),
    "tokenizer": Component("Tokenizer", ("tokenizer.py",), "00_overview"),
    "router": Component("Router\n(cache-aware,\nload balance)", ("router/",), "06_routing"),
    "scheduler": Component("Scheduler\n(main loop,\nbatching)", ("scheduler/", "engine.py"),
                           "02_scheduler"),
    "policy": Component("Scheduling\npolicy\n(FCFS, LPM, DFS)", ("scheduler/policy.py",),
                        "05_cache_aware"),
    "overlap": Component("Overlap loop\n(future tokens)", ("scheduler/overlap.py",), "07_overlap"),
    "chunked": Component("Chunked prefill\n(token budget)", ("scheduler/chunked.py",),
                         "03a_chunked_prefill"),
    "worker": Component("Model runner\n(one forward\nper step)", ("runner/model_runner.py",
                                                                   "model/"),
                        "03_selective_batching"),
    "spec": Component("Speculative\ndecoding\n(drafts, checks)",
                      ("spec/", "runner/speculative.py", "scheduler/speculative.py"),
                      "07a_speculative_decoding"),
    "kvpool": Component("KV pool\n(K and V tensors)", ("kv/pool.py",), "03_selective_batching"),
    "slots": Component("Slot allocator,\nrequest-to-token\nrows",
                       ("kv/allocator.py", "kv/table.py"), "03_selective_batching"),
    "radix": Component("Radix cache\n(RadixAttention)", ("kv/radix.py",), "04_radix_attention"),
    "blocks": Component("Pages, block-hash\ncache (vLLM)", ("kv/blocks.py", "kv/pages.py"),
                        "04b_pages"),
    "host": Component("Host tier\n(evicted KV\nin CPU memory)", ("kv/host.py", "kv/hiradix.py"),
                      "04a_host_tier"),
    "attention": Component("Attention backend", ("runner/attention/",), "03_selective_batching"),
    "grammar": Component("Grammar masks\n(structured\noutput)", ("grammar/",),
                         "08a_structured_output"),
    "detokenizer": Component("Detokenizer", ("server/textstream.py",), "08_server"),
}


def _chapter_number(file: str) -> str:
    """The number the book's sidebar gives the chapter: its place in reading order, from 1
    (``_toc.yml`` numbers the chapters' part, so ``00_overview`` is 1, ``03a_...`` is 5)."""
    return str([chapter.file for chapter in CHAPTERS].index(file) + 1)


def _component_label(comp: Component) -> str:
    """Name and chapter only: the modules go in ``component_table``, so the boxes stay small
    enough for the diagram to fit the page column at a readable size."""
    where = f"ch. {_chapter_number(comp.chapter)}" if comp.chapter else "not built yet"
    return f"{comp.name}\n{where}"


def component_table() -> list[dict[str, str]]:
    """One row per box of ``architecture_diagram``: what it is, its module, its chapter."""
    return [{"component": comp.name.replace("\n", " "),
             "module": ", ".join(f"minisrv/{m}" for m in comp.modules),
             "chapter": _chapter_number(comp.chapter) if comp.chapter else "not built yet"}
            for comp in COMPONENTS.values()]


def architecture_diagram() -> graphviz.Digraph:
    """The serving stack of the lecture's architecture slide, as minisrv builds it.

    Requests flow down from the client to the model worker and answers flow back up. The
    HTTP process tokenizes a prompt before the router sees it (``server/door.py``;
    ``Router.route`` takes token ids), and the detokenizer is its ``TextStream``. As in
    SGLang, the scheduler owns the KV bookkeeping (the prefix cache, a radix tree or vLLM's
    hashed blocks; which slots each request's tokens occupy; the free slots) and the model
    worker holds the KV tensors and the attention backend: the two are drawn as two frames,
    the scheduler's above the worker's, joined by the batch going down and the new tokens
    coming back, and by the host tier's copies of KV between the pool and host memory
    (SGLang's cache controller, in the scheduler's process). Speculative decoding sits in
    the worker, as SGLang 0.5.23's ``EAGLEWorkerV2`` (``speculative/eagle_worker_v2.py``)
    wraps the target model's worker and drafts and verifies inside its forward, while the
    drafts' slots are allocated as the scheduler prepares the batch
    (``eagle_prepare_for_decode``, ``speculative/eagle_utils.py``); minisrv's runner
    verifies there too, while its scheduler asks the drafter for guesses as it forms the
    step. No row is more than three boxes wide, so the drawing fits the page column with
    every label at 10 pt or more (``tests/test_viz_style.py`` checks the width); the host
    tier sits at the right of its row, so its copies to the pool clear the frame's caption.
    Solid boxes exist in the package today; dashed grey boxes are what later chapters add.
    """
    g = graphviz.Digraph("architecture", **graph_attrs(rankdir="TB", nodesep="0.2",
                                                       ranksep="0.3", compound="true"))
    g.attr("node", shape="box", style="rounded,filled", margin="0.08,0.04")
    g.attr("edge", color="#374151")
    for key, comp in COMPONENTS.items():
        built = comp.chapter is not None
        g.node(key, _component_label(comp),
               fillcolor="#dbeafe" if built else "#f3f4f6",
               color="#1d4ed8" if built else "#9ca3af",
               fontcolor="black" if built else "#6b7280",
               style="rounded,filled" if built else "rounded,filled,dashed")
    with g.subgraph() as row:
        row.attr(rank="same")
        row.node("router")
        row.node("detokenizer")
    frames = {
        "cluster_scheduler": ("scheduler: picks each step, owns the KV bookkeeping",
                              (("policy", "scheduler", "overlap"),
                               ("chunked", "radix", "blocks"), ("slots", "host"))),
        "cluster_worker": ("model worker (GPU or CPU): runs the forward, holds the KV",
                           (("worker", "spec"), ("attention", "grammar", "kvpool"))),
    }
    for name, (label, rows) in frames.items():
        with g.subgraph(name=name) as frame:
            frame.attr(label=label, labeljust="l", labelloc="b", style="dashed",
                       color="#6b7280")
            for keys in rows:
                with frame.subgraph() as row:
                    row.attr(rank="same")
                    for key in keys:
                        row.node(key)
                    for left, right in zip(keys, keys[1:]):  # in this order, left to right
                        row.edge(left, right, style="invis")
            for upper, lower in zip(rows, rows[1:]):  # and the rows top to bottom (a
                # row of two hangs its left box under the middle one: host to the right)
                frame.edge(upper[len(upper) // 2], lower[(len(lower) - 1) // 2], style="invis")
    g.edge("api", "tokenizer", label=" prompt", weight="8")
    g.edge("tokenizer", "router", label=" token ids", weight="8")
    g.edge("router", "scheduler", label=" one replica", weight="8")
    g.edge("scheduler", "detokenizer", label=" streamed tokens")
    g.edge("detokenizer", "api", label=" text", constraint="false")
    g.edge("policy", "scheduler", arrowhead="none", style="dotted")
    g.edge("scheduler", "overlap", arrowhead="none", style="dotted")
    # frame to frame (ltail, lhead); drawn from slots to spec, the boxes above one another,
    # so the two frames line up
    g.edge("slots", "spec", label=" next batch", ltail="cluster_scheduler",
           lhead="cluster_worker")
    g.edge("spec", "slots", label=" new tokens", ltail="cluster_worker",
           lhead="cluster_scheduler")
    g.edge("worker", "attention", arrowhead="none", style="dotted")
    g.edge("worker", "spec", arrowhead="none", style="dotted")
    g.edge("host", "kvpool", label=" KV copies", dir="both", style="dashed",
           constraint="false")
    return g


def chapter_map() -> graphviz.Digraph:
    """The chapters in reading order, each with the question it answers and its modules."""
    g = graphviz.Digraph("chapters", **graph_attrs(rankdir="TB", ranksep="0.25"))
    g.attr("node", shape="box", style="rounded,filled", fillcolor="#eef2ff")
    for ch in CHAPTERS:
        modules = ", ".join(ch.modules)
        g.node(ch.file, f"{_chapter_number(ch.file)} · {ch.title}\n{ch.question}\n{modules}")
    for before, after in zip(CHAPTERS, CHAPTERS[1:]):
        g.edge(before.file, after.file)
    return g


def training_record() -> dict:
    """The record ``python -m minisrv.train`` saved beside the shipped weights."""
    import json
    from importlib import resources

    from minisrv.model import META_FILE

    text = (resources.files("minisrv") / "weights" / META_FILE).read_text(encoding="utf-8")
    return json.loads(text)


@styled
def plot_training(record: dict) -> BookFigure:
    """Training and validation loss of the shipped CityLM against the optimisation step."""
    import math

    history = record["history"]
    fig, ax = page_figure(height_in=4.2)
    ax.plot(history["step"], history["train_loss"], label="training countries")
    ax.plot(history["step"], history["val_loss"], label="held-out countries")
    vocab = record["tokenizer"]["vocab_size"]
    ax.axhline(math.log(vocab), color="grey", linestyle="--", label=f"uniform guess (ln {vocab})")
    ax.set_yscale("log")
    plain_log_ticks(ax)  # 0.1, 0.2, 0.5, 1, ... in plain numbers instead of 10^-1, 10^0
    losses = [*history["train_loss"], *history["val_loss"]]
    ax.set_yticks([t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20)
                   if min(losses) / 2 <= t <= max(losses) * 2])
    ax.grid(True, alpha=0.3)
    label_axes(ax, "CityLM training", "optimisation step", "cross-entropy (nats per character)")
    legend_below(fig, ncol=3)
    return fig


def generation_table(model, tok, codes, max_new_tokens: int = 160):
    """What CityLM writes after ``"XX:"`` for each country, next to the true list.

    ``named in order`` counts how many cities, from the first, the model names in the right
    order, beside how many the country's list holds: for a training country it measures
    memorisation, which is all a lookup model can do.
    """
    import pandas as pd

    from minisrv.train.data import load_cities

    cities = load_cities()
    rows = []
    for code in codes:
        out = model.reference_generate(tok.encode(f"{code}:"), max_new_tokens)
        text = tok.decode(out).split("\n")[0].strip()
        generated = [c.strip() for c in text.split(",") if c.strip()]
        truth = cities[code]
        correct = 0
        for got, want in zip(generated, truth):
            if got != want:
                break
            correct += 1
        rows.append({"country": code, "CityLM continues": text,
                     "named in order": correct, "cities in the list": len(truth)})
    return one_header_row(pd.DataFrame(rows).set_index("country"))


def write_readme_picture(path: str = "images/chapters.svg",
                         architecture: str = "images/architecture.svg") -> None:
    """Regenerate the README's chapter map and the intro's architecture drawing
    (``python -m minisrv.viz.overview``): intro.md is plain Markdown, so it shows a file."""
    from pathlib import Path

    for target, graph in ((path, chapter_map()), (architecture, architecture_diagram())):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_bytes(graph.pipe(format="svg"))


if __name__ == "__main__":
    write_readme_picture()
