"""The engine: the public face of minisrv, a model (or a simulated GPU) plus a scheduler.

``Engine.generate`` takes token prompts and returns the generated ids in prompt order; how
the requests were batched never changes them (each equals ``model.reference_generate`` of
the request alone). ``Engine.run_workload`` and ``simulate`` replay a ``Workload`` and
return the metrics of the run; with a ``SimBackend`` that is a GPU-scale experiment that
runs in about a second.

The engine is the only driver of the scheduler. Its calls are what every caller (the
server's engine loop, the cluster simulation, ``generate``) uses::

    req = engine.add_request(prompt, params)   validated and queued; returns the Req
    out = engine.step()                        one step: StepOutput(record, tokens, finished)
    engine.abort([req])                        withdrawn wherever it is, its memory freed
    engine.retract([req])                      back to the queue's head, output kept
    engine.snapshot()                          gauges: running, queued, KV use, hit rate

The options (``EngineConfig``) grow with the book: continuous batching modes, admission,
the radix cache, cache-aware policies, the overlapped loop (``overlap=True`` drives the
scheduler with ``minisrv.scheduler.overlap.OverlapLoop``), the attention kind and the
device, speculative decoding (``speculative="ngram" | "draft" | a Drafter``,
``num_draft_tokens=k``: ``minisrv.scheduler.speculative``) and jump-forward for
constrained requests (``jump_forward=True``). Every argument is validated before anything
is queued, so a bad call raises ValueError and leaves the engine exactly as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from minisrv.core import Backend, Capability, JumpForwarder, SamplingBackend
from minisrv.kv import CACHES, PrefixCache
from minisrv.metrics import RunMetrics, summarize
from minisrv.request import Req, ReqState
from minisrv.sampling import SamplingParams
from minisrv.scheduler import (
    MODES,
    POLICIES,
    ConfigView,
    EngineConfig,
    EngineSnapshot,
    Scheduler,
    SchedulerStats,
    StepOutput,
    StepRecord,
)
from minisrv.scheduler.overlap import OverlapLoop, short_switch_interval
from minisrv.scheduler.prompts import make_requests

if TYPE_CHECKING:  # a workload is the book's data; the engine only reads its fields
    from minisrv.workloads import Workload

__all__ = [
    "POLICIES", "CACHES", "MODES", "Engine", "EngineConfig", "EngineSnapshot", "RunResult",
    "StepOutput", "overlap_loop",
]


def overlap_loop(scheduler: Scheduler) -> OverlapLoop:
    """The overlapped loop over ``scheduler``, its steps on the runner's device thread.

    The engine is where the scheduler meets the runner: the loop gets its ``DeviceWorker``
    from here, so the scheduler imports nothing of the runner. Imported on first use, as the
    model's modules are: the future map holds tensors, and a blocking run of the simulated
    GPU needs none.
    """
    from minisrv.runner.device import DeviceWorker

    # Futures are resolved one step after they are handed out: two batches suffice.
    worker = DeviceWorker(scheduler.backend, 4 * scheduler.config.max_running,
                          on_launch=lambda batch: scheduler.memory.launched(batch.reqs))
    return OverlapLoop(scheduler, worker)


@dataclass(frozen=True)
class RunResult:
    """One replayed workload: its requests (with token times), its steps and its metrics."""

    mode: str
    max_running: int
    requests: list[Req]
    trace: list[StepRecord]
    metrics: RunMetrics


class Engine(ConfigView):
    """A model and a scheduler behind ``add_request`` / ``step`` / ``abort`` / ``snapshot``.

    ``model`` is a CityLM (run by a ``ModelRunner`` with the ``attention`` and ``device``
    options) or any ``Backend``, e.g. a ``SimBackend``. The options are those of
    ``EngineConfig`` (``kv_capacity``, ``max_running``, ``policy``, ``cache``, ``mode``,
    ``admission``, ...), given as keywords or as one ``config``; an unknown option is an
    error that lists the valid ones. What they need of the backend (overlap, chunks, drafts,
    jump-forward: ``minisrv.core.Capability``) is checked once, as the scheduler is
    built: a ValueError names what is missing.

    ``cache="radix"`` reuses the KV of prefixes computed for earlier requests (RadixAttention,
    ``minisrv.kv.radix``). To watch the tree change, attach the book's recorder to
    ``engine.tree`` (``minisrv.viz.radix.TreeRecorder``). ``cache="blocks"`` reuses them as
    vLLM V1 does, in full blocks of ``page_size`` tokens found by chained hashes
    (``minisrv.kv.blocks``; vLLM's blocks hold 16, ``page_size=16``); DFS-weight needs the
    tree and refuses it.
    """

    def __init__(self, model: Any, config: EngineConfig | None = None, **options: Any) -> None:
        self.config = config = EngineConfig.from_options(config, **options)
        if isinstance(model, Backend):
            if config.cuda_graph:
                raise ValueError(f"cuda_graph=True needs a model on a CUDA device, not a "
                                 f"{type(model).__name__}")
            backend = model
        else:  # the model's modules load only for a model, not for a simulated GPU
            from minisrv.runner.model_runner import ModelRunner

            # cuda_graph: off by default until `make gpu-check` has passed with it on a GPU
            backend = ModelRunner(model, config.attention, device=config.device,
                                  cuda_graph=config.cuda_graph, max_running=config.max_running)
        self.scheduler = Scheduler(backend, config)
        self.loop: Scheduler | OverlapLoop = (
            overlap_loop(self.scheduler) if config.overlap else self.scheduler)
        self._next_rid = 0
        self._live: dict[int, Req] = {}  # rid -> request added and not yet done
        self._grammars: Any = None  # minisrv.grammar.sampling.GrammarSampling, once needed
        self._grammars_lock = threading.Lock()  # request threads may build it: one at a time

    # ----------------------------------------------------------------- views
    @property
    def backend(self) -> Backend:
        """What computes the steps."""
        return self.scheduler.backend

    @property
    def stats(self) -> SchedulerStats:
        """Totals over every step this engine has run (steps, tokens, ...)."""
        return self.scheduler.recorder.stats

    @property
    def tree(self) -> PrefixCache:
        """The prefix cache (a ``RadixCache``, a ``BlockCache`` for ``cache="blocks"``, or
        ``NoCache`` for ``cache="none"``)."""
        return self.scheduler.memory.tree

    @property
    def trace(self) -> list[StepRecord]:
        """One record per step this engine has run, oldest first."""
        return self.scheduler.recorder.trace

    @property
    def clock(self) -> float:
        """The scheduler's clock (steps, or seconds on a simulated GPU)."""
        return self.scheduler.recorder.clock

    @property
    def idle(self) -> bool:
        """True when nothing is pending, waiting, running or in flight."""
        return self.loop.idle

    @property
    def has_work_now(self) -> bool:
        """True when a request waits or runs (not only ones that arrive later)."""
        queues = self.scheduler.queues
        return bool(queues.waiting or queues.held())

    # ----------------------------------------------------------------- the driver
    def add_request(self, request: Req | Sequence[int], params: SamplingParams | None = None,
                    *, checked: bool = False) -> Req:
        """Queue a request: a ``Req`` (from ``make_requests``), or a prompt and its
        ``params`` (greedy, 16 tokens by default). Checked first (ValueError, nothing
        queued) unless the caller already did (``checked=True``)."""
        req = request if isinstance(request, Req) else self.make_requests([request], None,
                                                                          params)[0]
        if req.rid in self._live:
            raise ValueError(f"request {req.rid} was added already")
        if not checked:
            self.scheduler.check(req)
        if req.params.grammar is not None:
            self.grammars().prepare(req.params)  # compiled (cached) now: a bad one is refused
        self.scheduler.enqueue(req)
        self._live[req.rid] = req
        return req

    def grammars(self, vocab: Any = None) -> Any:
        """The engine's structured-output masks (``minisrv.grammar``), made on first use.

        ``vocab`` is the ``minisrv.grammar.Vocabulary`` of the served model's tokenizer. Left
        out, it is built from the tokenizer the model carries (``model.tokenizer``, which
        ``load_model`` sets: a loaded checkpoint needs no call here); a model built by hand
        without one gets CityLM's character vocabulary if its vocabulary is CityLM-sized, and
        a ValueError otherwise, since a mask over the wrong tokens would be silently wrong.
        A ``vocab`` given replaces the masks: before any constrained request (ValueError while
        one is in flight). Safe from a request thread while the engine thread runs steps.
        Needs the ``grammar`` extra (xgrammar).
        """
        if vocab is None and (grammars := self._grammars) is not None:
            return grammars  # published only once installed: read without the lock
        with self._grammars_lock:  # a server builds it on a request thread, the first time
            if vocab is None and self._grammars is not None:  # built while this call waited
                return self._grammars
            try:
                from minisrv.grammar.sampling import GrammarSampling
            except ImportError as exc:
                raise ValueError("structured output needs the grammar extra "
                                 "(pip install 'minisrv[grammar]')") from exc

            backend = cast(SamplingBackend, self.backend)
            if Capability.SAMPLES_PROCESSORS not in backend.capabilities:
                raise ValueError(f"grammars need a model to sample from, not a simulated GPU "
                                 f"({type(backend).__name__})")
            if self._grammars is not None and any(
                    req.params.grammar is not None for req in list(self._live.values())):
                raise ValueError("constrained requests are in flight: give the vocabulary "
                                 "before adding any (their grammar states would be lost)")
            if vocab is None:  # that of the tokenizer the model carries
                from minisrv.grammar.vocab import model_vocabulary

                vocab = model_vocabulary(backend.model, backend.vocab_size, backend.eos_ids)
            grammars = GrammarSampling(vocab)
            # One assignment in the sampler: a step running meanwhile applies the old
            # processors or the new ones, never half of each (Sampler.install).
            backend.sampler.install(grammars, replacing=self._grammars)
            if self.config.jump_forward:  # JUMPS_FORWARD: checked when the engine was built
                cast(JumpForwarder, backend).set_jump(grammars)
            self._grammars = grammars
            return grammars

    def step(self, tokens: bool = True) -> StepOutput:
        """Run one step of the loop (blocking or overlapped) and say what it produced;
        ``tokens=False`` leaves its ``tokens`` and ``logprobs`` empty (a simulation, or a
        cluster's engine, that nobody streams need not pay for gathering them)."""
        produced: list[tuple[Req, int]] = []
        logprobs: dict[Req, list[Any]] = {}
        sched = self.scheduler
        if tokens:
            sched.completer.on_token = self._collector(produced, logprobs)
        try:
            record = self.loop.step()
        finally:
            sched.completer.on_token = None
        if record is None:
            return StepOutput(None)
        live = self._live
        finished = [req for rid in record.finished if (req := live.pop(rid, None)) is not None]
        return StepOutput(record, produced, finished, logprobs)

    def _collector(self, tokens: list[tuple[Req, int]],
                   logprobs: dict[Req, list[Any]]) -> Callable[[Req, int], None]:
        """The step's token callback: each token, and its logprobs where they were asked
        for (read as the token is appended: a request that finishes is released within
        the same step, its sampler state with it)."""
        backend = self.backend
        pending = (cast(SamplingBackend, backend).logprobs
                   if Capability.GIVES_LOGPROBS in backend.capabilities else None)

        def on_token(req: Req, token: int) -> None:
            tokens.append((req, token))
            if pending is not None and req.params.logprobs is not None:
                queue = pending.get(req)
                logprobs.setdefault(req, []).append(
                    queue.popleft() if queue else (float("nan"), []))

        return on_token

    def abort(self, reqs: Iterable[Req]) -> None:
        """Withdraw ``reqs`` wherever they are (pending, waiting, running, in flight) and free
        their memory; finished ones are ignored."""
        reqs = list(reqs)
        for req in reqs:
            self._live.pop(req.rid, None)
        self.loop.abort(reqs)

    def retract(self, reqs: Iterable[Req]) -> None:
        """Send running ``reqs`` back to the head of the queue: their KV is freed, their
        output and random generator kept, so they continue with the tokens they would have
        had (waiting or finished ones are ignored). The blocking loop only: the overlapped
        loop's step in flight computes for them and cannot be taken back."""
        if isinstance(self.loop, OverlapLoop):
            raise ValueError("retract needs the blocking loop: the overlapped loop has a step "
                             "in flight that computes for the running requests")
        self.scheduler.requeue(reqs)

    def snapshot(self) -> EngineSnapshot:
        """The gauges of this moment: requests running and queued, KV held, hit rate."""
        sched, stats, queues = self.scheduler, self.scheduler.recorder.stats, self.scheduler.queues
        used = sched.memory.kv.used_count - sched.memory.tree.evictable_size()
        return EngineSnapshot(
            running=len(queues.held()), queued=len(queues.waiting) + queues.pending, kv_used=used,
            token_usage=used / self.kv_capacity, hit_rate=stats.hit_rate,
            prompt_tokens=stats.prompt_tokens, steps=stats.steps,
            host_tokens=self.config.host_cache_tokens, host_used=sched.memory.host_used,
            host_hit_tokens=stats.host_hit_tokens)

    # ----------------------------------------------------------------- serving
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] | None = None,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[float] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """Generate for every prompt; return the new ids per prompt, in prompt order.

        ``max_new_tokens``: one int for all, or one per prompt; ``None`` takes it from
        ``sampling`` (16 without). ``sampling``: one ``SamplingParams`` for all or one per
        prompt (greedy by default); an explicit ``max_new_tokens`` overrides its length.
        ``arrival_steps``: when each request arrives, in steps from now (default: all now).
        ``on_token(i, token)`` is called for every token as soon as its step is done
        (streaming). A generated ``<eos>`` ends a request and is included, unless
        ``ignore_eos``.
        """
        reqs = self.make_requests(prompts, max_new_tokens, sampling, arrival_steps)
        index = {id(req): i for i, req in enumerate(reqs)}
        stream = None if on_token is None else (
            lambda req, token: on_token(index[id(req)], token))

        self.serve(reqs, stream)
        return [list(req.output) for req in reqs]

    def make_requests(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[float] | None = None,
    ) -> list[Req]:
        """Validated ``Req`` objects for ``generate``'s arguments; nothing is queued yet."""
        reqs = make_requests(prompts, max_new_tokens, sampling, arrival_steps,
                             first_rid=self._next_rid, now=self.scheduler.recorder.clock)
        self._next_rid += len(reqs)
        return reqs

    def serve(
        self,
        reqs: Sequence[Req],
        on_token: Callable[[Req, int], None] | None = None,
        progress: bool = False,
    ) -> list[Req]:
        """Add ``reqs`` and step until the engine is idle (``run``).

        Every request is checked before any is queued. If anything fails mid-run (a
        streaming callback raising, an interrupt) the call's requests are withdrawn and
        their memory freed before the error propagates, so the engine stays usable.
        ``progress`` shows a tqdm bar counting finished requests.
        """
        for req in reqs:
            self.scheduler.check(req)
        try:
            for req in reqs:
                self.add_request(req, checked=True)
            self.run(on_token, total=len(reqs) if progress else None)
            if stuck := [r.rid for r in reqs if r.state == ReqState.WAITING]:  # not silently
                raise RuntimeError(f"requests {stuck} were never admitted on an idle engine")
        except BaseException:
            self.abort(reqs)
            raise
        return list(reqs)

    def run(self, on_token: Callable[[Req, int], None] | None = None,
            total: int | None = None) -> None:
        """Step until the engine is idle, handing each token to ``on_token`` once its step
        is done; ``total`` (requests) shows a tqdm bar counting the finished ones."""
        bar = None
        if total is not None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="req", desc=f"serving ({self.mode})")
        try:
            overlapped = isinstance(self.loop, OverlapLoop)  # its device thread needs the GIL
            with short_switch_interval() if overlapped else nullcontext():
                while (out := self.step(tokens=on_token is not None)).record is not None:
                    if on_token is not None:
                        for req, token in out.tokens:
                            on_token(req, token)
                    if bar is not None:
                        bar.update(len(out.record.finished))
        finally:
            if bar is not None:
                bar.close()

    def run_workload(self, workload: Workload, progress: bool = False) -> RunResult:
        """Replay ``workload`` (arrivals relative to now); return requests, steps, metrics.

        Every request runs to its ``output_lens`` entry (``ignore_eos``), so all modes
        produce the same tokens and differ only in when they compute them.
        """
        params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in workload.output_lens]
        reqs = self.make_requests(workload.prompts, None, params, workload.arrivals)
        first_step = len(self.trace)
        self.serve(reqs, progress=progress)
        trace = self.trace[first_step:]
        metrics = summarize(reqs, trace, self.max_running)
        return RunResult(self.mode, self.max_running, reqs, trace, metrics)
