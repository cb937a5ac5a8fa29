"""The model runner: a batch in, its tokens out, on the device that holds the model.

``ModelRunner`` (as nano-vllm's ``model_runner.py`` or mini-sglang's engine) owns
everything device-side of a step: the KV pool, the step's input tensors, the attention
backend and the sampler. A step is two halves, so the overlapped loop can run them on two
threads:

* ``prepare(batch)`` (the scheduler's thread): the batch's entries become device tensors
  once (input ids, positions, each request's row of the request-to-token table and its
  length; the slots the new K/V go to and the attention's metadata gathered from the
  table on the device), and
  the requests' sampling parameters and generators are copied out, so the requests may
  change while the step runs;
* ``compute(inputs, resolve, store)`` (the device's thread): future ids resolved, one flat
  forward over every new token (selective batching), logits processors, sampling.

Outputs equal running each request alone (``model.reference_generate``).

With ``static_decode`` (or ``cuda_graph``, on CUDA) a step of decodes only runs over the
runner's static buffers padded to a batch bucket (``minisrv.runner.graph``): eagerly, or by
replaying the bucket's CUDA graph. Prefill and mixed steps run the flat path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from minisrv.core import Batch, BatchResult, Capability, Entry
from minisrv.kv import KVPool, SlotAllocator
from minisrv.kv.table import ReqToTokenTable
from minisrv.request import Req
from minisrv.runner.attention import AttentionBackend, PaddedAttention, make_attention, write_kv
from minisrv.runner.graph import DecodeGraphs, PaddedDecode
from minisrv.runner.sampler import LogitsProcessor, Sampler
from minisrv.runner.speculative import Checks, jump_forward, plan_checks, verify_checks
from minisrv.runner.table_batch import TableBatch, slot_table
from minisrv.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from minisrv.model import CityLM

__all__ = ["ModelBackend", "ModelRunner", "StepInputs"]


class StepInputs(NamedTuple):
    """One step as the device reads it (``ModelRunner.prepare``)."""

    flat: TableBatch | None  # ids (futures < 0), positions, write slots; None: padded decode
    metadata: Any  # the attention backend's, built before layer 0 (padded: a PaddedDecode)
    has_futures: bool  # some input id is a future id, to resolve on the device
    sample_rows: torch.Tensor | None  # flat rows whose logits are sampled; None: all
    samples: tuple[bool, ...]  # per entry: whether it samples a token
    reqs: list[Req]  # the sampling entries' requests (for the logits processors)
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[tuple[list[int], list[int]]] | None  # for penalties (Sampler.histories)
    checks: Checks | None = None  # speculative checks (runner.speculative); None: none


class ModelRunner:
    """Runs each step on a real CityLM: one flat forward over every entry of the batch.

    The KV of all requests lives in one ``KVPool`` built by ``attach_kv`` (the scheduler
    calls it with its ``kv_capacity``); each step finds a request's slots through its row of
    the scheduler's request-to-token table (``attach_table``), so ``prepare`` copies the new
    tokens, a row and a length per request, nothing that grows with the context. A runner
    driven by hand, without a table, builds one per step from the requests' ``kv_slots``
    (``slot_table``): the batch is a ``TableBatch`` either way. ``attention`` names a backend
    of the registry (``minisrv.runner.attention.BACKENDS``: ``"padded"``, one masked call
    per layer; ``"flex"``, one ragged flex_attention call; ``"loop"``, one call per request;
    ``"triton"``, kernels over the pool in place) or is ``"auto"``, resolved once here
    from the device's capability (``choice.py``: flex on a recent GPU, padded elsewhere).
    ``device`` moves the model there first (``None``: where it is). ``logits_processors``
    are applied to every step's logits before sampling (``Sampler``).

    ``static_decode`` runs decode-only steps of up to ``max_running`` requests over
    static buffers padded to a batch bucket (``DecodeGraphs``, contexts up to
    ``graph_context`` tokens, default the model's ``max_seq_len`` or the pool's capacity if
    smaller), attending with the backend's own static decode hooks, or the padded
    backend's where it has none; ``cuda_graph`` (a CUDA
    model only, else ValueError) does the same and replays each bucket's CUDA graph,
    captured in ``attach_kv`` (UNTESTED until run on a GPU).
    """

    time_unit = "step"
    cost_unit = "tokens"
    # Listed, not "all but": a new capability is claimed only where it is written down.
    # Not ENDS_OWN_STEPS (the device thread ends its steps) nor TIMES_HOST_COPIES (the host
    # tier's copies take their own time on the device); checks: runner.speculative
    capabilities = frozenset({
        Capability.SAMPLES_PROCESSORS, Capability.VERIFIES_DRAFTS, Capability.JUMPS_FORWARD,
        Capability.GIVES_LOGPROBS, Capability.SPLITS_STEP, Capability.COMPUTES_CHUNKS,
        Capability.LENDS_KV_POOL,
    })

    def __init__(self, model: CityLM, attention: str = "auto", *,
                 device: str | torch.device | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (),
                 static_decode: bool = False, cuda_graph: bool = False, max_running: int = 256,
                 graph_context: int | None = None) -> None:
        if device is not None and torch.device(device) != model.device:
            model = model.to(device)
        if cuda_graph and model.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on a CUDA device, this one is on "
                             f"{model.device}")
        self.model = model
        self.attn: AttentionBackend = make_attention(attention, model.device, model.dtype,
                                                     model.config.head_dim,
                                                     model.config.n_kv_heads)
        self.attention: str = self.attn.kind
        self.eos_ids: tuple[int, ...] = tuple(model.eos_ids)
        self.sampler = Sampler(logits_processors, self.eos_ids)
        self.max_context: int | None = model.config.max_seq_len
        self.vocab_size: int | None = model.config.vocab_size
        self.pool: KVPool | None = None
        self.graph_options = (static_decode or cuda_graph, cuda_graph, max_running,
                              graph_context)
        self.graphs: DecodeGraphs | None = None
        self.table: ReqToTokenTable | None = None  # the scheduler's (attach_table)
        # Jump-forward: the engine's GrammarSampling, whose ``jump`` appends forced tokens.
        self.jump: Any = None

    def set_jump(self, jump: Any) -> None:
        """Jump-forward: after sampling, ``jump.jump`` (the engine's GrammarSampling)
        appends the tokens each request's grammar forces."""
        self.jump = jump

    @property
    def logprobs(self) -> dict[Req, deque[TokenLogprobs]]:
        """The logprobs of the tokens sampled for requests that asked, until read."""
        return self.sampler.logprobs

    @property
    def device(self) -> torch.device:
        """Where the model, the pool and every step's tensors are."""
        return self.model.device

    def attach_kv(self, capacity: int) -> SlotAllocator:
        """Allocate the KV pool (``capacity`` token slots) on the model's device, and the
        static decode buffers (capturing the CUDA graphs) when asked for."""
        self.pool = KVPool.for_model(self.model, capacity)
        static, cuda_graph, max_running, context = self.graph_options
        if static:  # no request's context outgrows the pool: buffers no wider than it
            if context is None:
                context = min(self.model.config.max_seq_len, capacity)
            attention, cfg = self.attn, self.model.config
            if attention.graphs is None:  # loop, flex: the padded backend's decode hooks
                attention = PaddedAttention(self.device, self.model.dtype, cfg.head_dim,
                                            cfg.n_kv_heads)
            self.graphs = DecodeGraphs(self.model, self.pool, max_running, attention=attention,
                                       context=context, cuda_graph=cuda_graph)
        return self.pool.allocator

    def attach_table(self, table: ReqToTokenTable | None) -> None:
        """The scheduler's request-to-token table (``minisrv.kv.table``), put on the model's
        device: every step then finds its requests' KV slots through their rows."""
        if table is not None:
            table.place(self.model.device)
        self.table = table

    def run(self, batch: Batch) -> BatchResult:
        """Compute every entry of ``batch`` in ONE forward pass; cost = tokens computed."""
        return self.compute(self.prepare(batch))

    def prepare(self, batch: Batch) -> StepInputs:
        """The host half of a step: the batch's entries as device tensors, built once.

        An entry computes the request's tokens ``start .. end - 1`` (a prefill its uncached
        prompt, plus output kept from before a retraction; a decode its newest token, which
        in the overlapped loop may be a future id, < 0) into its KV slots up to ``end``.
        """
        if self.pool is None:
            raise ValueError("ModelRunner has no KV pool: the scheduler calls attach_kv first")
        entries, checks, plain = batch.entries, None, batch.drafts is None
        # one pass over the entries: what the table batch and the sampler read of each
        new_ids, new_slots, ends, rows, sampling, n_rows = [], [], [], [], [], 0
        for req, start, n_tokens, sample in entries:
            end = start + n_tokens
            new_slots.append(self.new_slots(req, start, end))
            ends.append(end)
            if plain:
                new_ids.append(req.tokens(start, end))
                n_rows += n_tokens
                if sample:
                    rows.append(n_rows - 1)
                    sampling.append(req)
        if plain:
            samples = tuple(e.sample for e in entries)
        else:
            new_ids, rows, sampling, checks = plan_checks(batch, self.sampler)
            samples = tuple(kind > 0 for kind in checks.kinds)
        params, generators = [req.params for req in sampling], self.sampler.generators(sampling)
        histories = self.sampler.histories(sampling)
        table_rows, table = self.step_table(entries, ends)
        graphs = self.graphs
        if (graphs is not None and checks is None and len(rows) == n_rows
                and graphs.fits([e.n_tokens for e in entries], ends)):
            padded = graphs.prepare([ids[0] for ids in new_ids], table_rows, ends, table)
            return StepInputs(None, padded, padded.has_futures, None,
                              samples, sampling, params, generators, histories)
        flat = TableBatch(new_ids, table_rows, ends, table, new_slots)
        # every row sampled in order (a step of decodes): no rows to pick, nothing to copy
        every_row = checks is None and len(rows) == n_rows
        return StepInputs(
            flat, self.attn.prepare(flat), flat.id_range[0] < 0,
            None if every_row else torch.tensor(rows, dtype=torch.long,
                                                device=self.model.device),
            samples, sampling, params, generators, histories, checks)

    def new_slots(self, req: Req, start: int, end: int) -> list[int]:
        """The slots ``req`` writes for tokens ``start:end``: its record in the table, or for
        a runner driven by hand, its ``kv_slots``."""
        if self.table is not None:
            return self.table.slots(req, start, end)
        return req.kv_slots[start:end]

    def step_table(self, entries: Sequence[Entry], ends: Sequence[int]
                   ) -> tuple[list[int], torch.Tensor]:
        """Each entry's row of the request-to-token table, and the table: the scheduler's
        (nothing per context copied), or, for a runner driven by hand, one built from the
        requests' slot lists (``slot_table``, its last row a scratch row)."""
        if self.table is not None:
            row = self.table.row
            return [row(req) for req, *_ in entries], self.table.tensor
        assert self.pool is not None  # prepare checked
        slots = [req.kv_slots[:end] for (req, *_), end in zip(entries, ends)]
        return list(range(len(entries))), slot_table(slots, self.pool.scratch_slot,
                                                     self.model.device)

    def compute(
        self,
        step: StepInputs,
        resolve: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: Callable[[list[int]], None] | None = None,
    ) -> BatchResult:
        """The device half of a step: one flat forward, then sampling.

        ``resolve`` replaces future ids (< 0) by their tokens (``FutureMap.resolve``): one
        ``torch.where`` over the step's input ids. ``store`` receives the sampled tokens
        before this returns (``FutureMap.store``): on a GPU part of the same step's work.
        """
        if step.checks is not None:
            return self.compute_checks(step)
        if step.flat is None:  # a padded decode over the static buffers
            assert self.graphs is not None and isinstance(step.metadata, PaddedDecode)
            logits, cost = self.graphs.run(step.metadata, resolve), step.metadata.n
        else:
            ids = step.flat.ids
            if resolve is not None and step.has_futures:
                ids = resolve(ids)
            logits, cost = self.forward(step, ids), step.flat.num_tokens
        tokens = self.sampler.sample(logits, step.reqs, step.params, step.generators,
                                     step.histories)
        if store is not None:
            store(tokens)
        it = iter(tokens)
        per_entry = [[next(it)] if sample else [] for sample in step.samples]
        if self.jump is not None:
            return jump_forward(self.jump, step.reqs, step.generators, per_entry, float(cost))
        return BatchResult(per_entry, cost=float(cost), elapsed=1.0)

    def compute_checks(self, step: StepInputs) -> BatchResult:
        """``compute`` for a step with checks: one forward, the plain rows sampled, the
        checks verified and cut at their stops (``runner.speculative``)."""
        checks, flat = step.checks, step.flat
        assert flat is not None and checks is not None
        logits = self.forward(step, flat.ids)
        n_plain = len(step.reqs)
        plain = self.sampler.sample(logits[:n_plain], step.reqs, step.params, step.generators,
                                    step.histories) if n_plain else []
        per_entry = verify_checks(logits[n_plain:], plain, checks, self.eos_ids)
        cost = float(flat.num_tokens)
        if self.jump is not None and n_plain:
            sampled = [tokens for tokens, kind in zip(per_entry, checks.kinds) if kind == 1]
            return jump_forward(self.jump, step.reqs, step.generators, per_entry, cost, sampled)
        return BatchResult(per_entry, cost=cost, elapsed=1.0)

    @torch.inference_mode()
    def forward(self, step: StepInputs, ids: torch.Tensor) -> torch.Tensor:
        """Logits [sampling entries, vocab]: every layer writes the new K/V into their slots
        of the pool (one operator), then attends through the attention backend."""
        if step.flat is None:
            raise ValueError("a padded decode step runs through compute (DecodeGraphs.run)")
        pool, attn, metadata, write = self.pool, self.attn, step.metadata, step.flat.write_slots
        assert pool is not None  # prepare checked

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = pool.kv[layer]
            write_kv(kv, write, k, v)
            return attn.forward(q, kv, metadata)

        x = self.model.run_layers(ids, step.flat.positions, attend)
        if step.sample_rows is not None:  # None: every row, in order (a step of decodes)
            x = x[step.sample_rows]
        return self.model.lm_head(self.model.norm(x))

    def release(self, req: Req) -> None:
        """Forget the request's generator (its KV slots are the scheduler's to free)."""
        self.sampler.release(req)

    @property
    def live_requests(self) -> int:
        """Requests admitted and not yet finished (running or retracted)."""
        return self.sampler.live_requests


ModelBackend = ModelRunner
"""The name the chapters and tests have used for the runner since the selective-batching
chapter."""
