"""The GPU appendix's runs, and what ``benchmarks/bench_gpu.py`` times.

* ``write_tiny_llama`` saves a random tiny Llama checkpoint with a word-level tokenizer built
  by the ``tokenizers`` library: a real Hugging Face folder that ``load_model`` reads, made
  offline in a second (the book's CI has no network).
* ``random_model`` builds a random CityLM of any shape (e.g. ``SMOLLM2_135M``) directly on a
  device. Step time depends on shapes, not on weight values, so no download is needed to time.
* ``step_time_sweep``, ``roofline_step_times`` and ``engine_decode_throughput`` measure decode
  on whatever device the model is on and put the roofline's prediction for a GPU beside it.
* ``hybrid_step_calls`` serves prompts through the hybrid attention: the call each step took.
* ``show_triton_kernel`` shows a kernel of ``minisrv.runner.attention.triton_ops`` without
  importing Triton, which a CPU-only torch does not bring.

Measured times depend on the machine; every returned row says which device it came from.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from minisrv.configs import GPUSpec, ModelConfig, gpu_by_name
from minisrv.engine import Engine
from minisrv.kv import KVPool
from minisrv.model import CityLM, FlatBatch
from minisrv.model.hf import save_hf_folder
from minisrv.runner import ModelBackend
from minisrv.runner.attention import HybridAttention
from minisrv.sampling import SamplingParams
from minisrv.sim.roofline import decode_step_cost, decode_step_time
from minisrv.sim.steptime import decode_step_seconds

__all__ = [
    "DEMO_TEXT",
    "RECORDED_STEP_OPS",
    "DecodeRun",
    "StepOps",
    "current_gpu",
    "device_label",
    "engine_decode_throughput",
    "hybrid_step_calls",
    "predicted_decode_throughput",
    "ragged_vs_padded",
    "random_model",
    "recorded_gpu_run",
    "roofline_step_times",
    "show_triton_kernel",
    "step_time_sweep",
    "write_tiny_llama",
]

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
DEMO_TEXT = (
    "you are a helpful assistant that answers in short sentences . "
    "what is a kv cache ? why does a server batch requests ? how fast is a gpu ? "
    "a server keeps the keys and values of every token so that decoding reads them "
    "instead of computing them again . batching shares each weight read among many "
    "requests . the roofline says a step takes the longer of its arithmetic and its "
    "memory traffic . tokens prompts prefixes radix tree cache hit miss evict"
)
"""The words of the tiny checkpoint's vocabulary (and of the appendix's prompts)."""


def write_tiny_llama(
    folder: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 256,
) -> Path:
    """Save a random Llama checkpoint and its tokenizer to ``folder``; return the folder.

    The tokenizer splits on whitespace into the words of ``DEMO_TEXT`` (one id each, after
    ``<pad> <s> </s> <unk>``) and puts ``<s>`` before every text, like Llama's. The weights
    are random (``initializer_range`` 0.1, so greedy outputs vary), the eos id is ``</s>``.
    Needs the ``hf`` extra (``transformers``, ``tokenizers``).
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = list(dict.fromkeys(DEMO_TEXT.split()))
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", clean_up_tokenization_spaces=False,  # "cache ?" stays "cache ?"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, initializer_range=0.1,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = Path(folder)
    save_hf_folder(model, tokenizer, folder)
    return folder


def random_model(
    cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0
) -> CityLM:
    """A CityLM of ``cfg``'s shape with random weights, built on ``device`` in ``dtype``.

    No token ends a generation (``eos_id=None``), so every timed request runs to its length.
    The weights are drawn on the device itself: a 135M-parameter model on a GPU is ready in
    milliseconds instead of seconds of CPU initialisation and copying.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = CityLM(cfg, eos_id=None)
    return model.to(dtype=dtype).eval()


def current_gpu() -> GPUSpec | None:
    """The spec of the visible CUDA GPU from ``configs.GPUS``; None without one (or unlisted)."""
    if not torch.cuda.is_available():
        return None
    return gpu_by_name(torch.cuda.get_device_name())


def device_label(device: str | torch.device) -> str:
    """What a measurement ran on, for tables and legends: the GPU's name, or "CPU"."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU" if device.type == "cpu" else device.type


def step_time_sweep(
    model: CityLM,
    batch_sizes: Sequence[int],
    context: int,
    attentions: Sequence[str] = ("padded",),
    repeats: int = 5,
    progress: bool = False,
) -> pd.DataFrame:
    """Measured median decode-step time per batch size and attention kind on the model's device.

    One row per (attention, batch): ``step_ms`` and ``us_per_token`` (the step divided by
    the tokens it produced), with the device, dtype and context that produced them.
    """
    rows = []
    jobs = [(a, b) for a in attentions for b in batch_sizes]
    for attention, batch in tqdm(jobs, disable=not progress, desc="decode steps"):
        seconds = decode_step_seconds(model, batch, context, attention=attention,
                                      repeats=repeats, warmup=2)
        rows.append({"device": device_label(model.device), "dtype": str(model.dtype)[6:],
                     "attention": attention, "batch": batch, "context": context,
                     "step_ms": seconds * 1e3, "us_per_token": seconds * 1e6 / batch})
    return pd.DataFrame(rows)


def roofline_step_times(
    cfg: ModelConfig,
    gpus: Sequence[GPUSpec],
    batch_sizes: Sequence[int],
    context: int,
    dtype_bytes: float = 2,
) -> pd.DataFrame:
    """The roofline's decode-step time for each GPU and batch size: a lower bound, no device
    involved. Columns like ``step_time_sweep``'s, plus which resource bounds the step."""
    rows = []
    for gpu in gpus:
        for batch in batch_sizes:
            cost = decode_step_cost(cfg, gpu, batch, context, dtype_bytes)
            rows.append({"device": f"{gpu.name} (roofline)", "batch": batch, "context": context,
                         "step_ms": cost.time_s * 1e3,
                         "us_per_token": cost.time_s * 1e6 / batch, "bound": cost.bound})
    return pd.DataFrame(rows)


def ragged_vs_padded(
    model: CityLM, mix: Sequence[tuple[int, int]], seed: int = 0
) -> float:
    """Largest |logit| difference between the ragged (flex) and the padded attention on one
    flat step over ``mix`` ((cached prefix, new tokens) per request) on the model's device.

    The prefixes are written to a fresh pool first (as earlier steps would have), so both
    attentions read every request's cached K/V from the pool.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (p + n,), generator=gen).tolist() for p, n in mix]
    pool = KVPool.for_model(model, sum(p + n for p, n in mix))
    slots = [pool.alloc(p + n) for p, n in mix]
    for (p, _), seq, s in zip(mix, seqs, slots):
        if p:
            model.forward_flat(FlatBatch([seq[:p]], [s[:p]], model.device), pool,
                               attention="padded", last_only=True)
    step = FlatBatch([seq[p:] for (p, _), seq in zip(mix, seqs)], slots, model.device)
    logits = {kind: model.forward_flat(step, pool, attention=kind) for kind in ("padded", "flex")}
    return (logits["flex"] - logits["padded"]).abs().max().item()


def hybrid_step_calls(engine: Engine, prompts: Sequence[Sequence[int]],
                      max_new_tokens: int | Sequence[int], names: Mapping[str, str] | None = None,
                      ) -> tuple[list[list[int]], pd.DataFrame]:
    """Serve ``prompts`` on ``engine``, whose attention is ``"hybrid"``: each request's
    tokens, and one row per step (``step`` from 1, how many requests it ``prefills`` and
    ``decodes``, the ``tokens`` it computes, the ``call`` its attention took: ``padded``,
    ``flex`` or ``flex + padded``, as ``names`` calls each kind; one new token is a decode).

    The call is read from what the backend's ``prepare`` returned, not worked out again from
    the step's kind, so the table shows what ran. Static decode steps (``cuda_graph=True``)
    call no ``prepare``: ValueError then, not a short table.
    """
    attn = getattr(engine.backend, "attn", None)
    if not isinstance(attn, HybridAttention):
        raise ValueError(f"the engine's attention is not the hybrid: {attn!r}")
    calls, prepare, before = [], attn.prepare, len(engine.trace)

    def recorded(batch: Any) -> Any:
        step = prepare(batch)
        calls.append(" + ".join((names or {}).get(kind, kind) for kind in step.calls))
        return step

    attn.prepare = recorded  # type: ignore[method-assign]  # this engine's backend only
    try:
        outputs = engine.generate(prompts, max_new_tokens=max_new_tokens)
    finally:
        del attn.prepare
    steps = engine.trace[before:]  # zip's strict: ValueError where a step skipped prepare
    rows = [{"step": i, "prefills": len(s.prefill), "decodes": len(s.decode),
             "tokens": s.prefill_tokens + len(s.decode), "call": call}
            for i, (s, call) in enumerate(zip(steps, calls, strict=True), 1)]
    return outputs, pd.DataFrame(rows)


class DecodeRun(NamedTuple):
    """One engine run's decode phase: how many tokens, how long, and where."""

    device: str
    attention: str
    batch: int
    prompt_len: int
    new_tokens: int
    decode_tokens: int  # tokens produced by decode steps (the first comes from prefill)
    decode_seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens per second of decode steps."""
        return self.decode_tokens / self.decode_seconds


def _decode_steps(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Serve ``prompts`` to ``new_tokens`` tokens each, timing every step; return the tokens
    produced by pure decode steps and the seconds those steps took.

    Each step returns sampled ids on the host, so its device work is done when it returns.
    """
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for req in engine.make_requests(prompts, None, params):
        engine.add_request(req)
    tokens, seconds = 0, 0.0
    while True:
        start = time.perf_counter()
        record = engine.step().record
        elapsed = time.perf_counter() - start
        if record is None:
            return tokens, seconds
        if not record.prefill:
            tokens += len(record.decode)
            seconds += elapsed


def engine_decode_throughput(
    model: CityLM,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    attention: str = "auto",
    seed: int = 0,
) -> DecodeRun:
    """The engine's decode throughput for ``batch`` requests decoding together.

    ``batch`` random prompts of ``prompt_len`` tokens each generate ``new_tokens`` (no early
    stop) with ``max_running=batch``: one prefill step, then ``new_tokens - 1`` steps that
    decode all of them. Only those decode steps are timed (the engine's scheduling and
    sampling included), after a short warm-up run that compiles the flex kernel on a GPU.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to have a decode step, got {new_tokens}")
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen)
    prompts_list = prompts.tolist()
    backend = ModelBackend(model, attention=attention)

    def engine() -> Engine:
        return Engine(backend, kv_capacity=batch * (prompt_len + new_tokens) + batch,
                      max_running=batch, cache="none")

    _decode_steps(engine(), prompts_list, 3)  # warm-up: allocator, kernels, compilation
    tokens, seconds = _decode_steps(engine(), prompts_list, new_tokens)
    return DecodeRun(device_label(model.device), backend.attention, batch, prompt_len,
                     new_tokens, tokens, seconds)


def predicted_decode_throughput(
    cfg: ModelConfig, gpu: GPUSpec, run: DecodeRun, dtype_bytes: float = 2
) -> float:
    """Tokens/s the roofline predicts on ``gpu`` for ``run``'s decode steps.

    Decode step j (j = 1 .. new_tokens - 1) of every request reads ``prompt_len + j - 1``
    cached tokens; the prediction is the decode tokens over the sum of those step times.
    """
    seconds = sum(decode_step_time(cfg, gpu, run.batch, run.prompt_len + j - 1, dtype_bytes)
                  for j in range(1, run.new_tokens))
    return run.decode_tokens / seconds


RECORDED = Path(__file__).parents[1] / "measured"
"""Runs of ``benchmarks/bench_gpu.py --out`` on lent GPUs, shipped so a page built on a CPU
can still show what a GPU measured (each row names its GPU and torch)."""


def recorded_gpu_run(gpu: str = "h200") -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(decode_steps, engine_throughput)`` of the recorded ``bench_gpu.py`` run on ``gpu``.

    ``decode_steps``: one row per (batch, attention) with ``step_ms``, in the long format of
    ``step_time_sweep`` (so ``viz.gpu.plot_step_times_vs_roofline`` draws it);
    ``engine_throughput``: one row per (batch, attention), measured and roofline tokens/s.
    """
    steps_file = RECORDED / f"{gpu}_decode_steps.csv"
    if not steps_file.exists():
        known = sorted(f.name.split("_")[0] for f in RECORDED.glob("*_decode_steps.csv"))
        raise ValueError(f"no recorded GPU run {gpu!r}; recorded: {known}")
    wide = pd.read_csv(steps_file)
    steps = wide.melt(id_vars=["batch", "context", "device", "torch"],
                      value_vars=["padded ms", "flex ms"], var_name="attention",
                      value_name="step_ms")
    steps["attention"] = steps["attention"].str.removesuffix(" ms")
    steps["dtype"] = "bfloat16"
    steps["us_per_token"] = steps["step_ms"] * 1e3 / steps["batch"]
    throughput = pd.read_csv(RECORDED / f"{gpu}_engine_throughput.csv")
    return steps, throughput


class StepOps(NamedTuple):
    """Operators one decode step dispatches: ``per_layer`` in each layer, ``per_step`` once,
    and ``per_request`` for each request of the batch (views left out, counted as
    ``tests/test_op_count.py``'s ``OpCounter`` counts them)."""

    per_layer: int
    per_step: int
    per_request: int
    commit: str

    def total(self, n_layers: int, batch: int) -> int:
        """Operators of one step of ``batch`` requests through ``n_layers`` layers."""
        return n_layers * self.per_layer + self.per_step + batch * self.per_request


RECORDED_STEP_OPS = StepOps(per_layer=43, per_step=31, per_request=2, commit="d141db1")
"""What the decode step of the recorded H200 run dispatched: the padded step that
``benchmarks/bench_gpu.py`` timed, ``FlatBatch`` built then ``forward_flat``, as the code
stood at commit ``d141db1`` (2026-11-30, before the fused layers of the next day), counted on
the CPU with ``tests/test_op_count.py``'s ``OpCounter``. Its unfused q, k, v and gate, up
products, its hand-written norms and rotary embedding and the grouped heads' K/V repeated
per layer made 43 per layer; the ``FlatBatch`` built one slot tensor per request (an
``arange`` and a copy each). ``tests/test_real_model.py`` recounts it from that commit."""

TRITON_OPS = "minisrv.runner.attention.triton_ops"


def show_triton_kernel(name: str) -> Any:
    """The source of function ``name`` in ``triton_ops``, highlighted as ``book.show_source``
    shows a component. Read from the file, not imported: the module imports Triton, which a
    CPU-only torch lacks, and a page that only shows a kernel should run there too."""
    from IPython.display import Code

    origin = importlib.util.find_spec(TRITON_OPS).origin
    text = Path(origin).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = text.splitlines()[first - 1 : node.end_lineno]
            return Code(textwrap.dedent("\n".join(lines)) + "\n", language="python")
    raise ValueError(f"{TRITON_OPS} defines no function {name!r}")
