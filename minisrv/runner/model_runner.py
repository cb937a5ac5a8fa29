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
from typing import TYPE_CHECKING, Any

import torch

from minisrv.core import Batch, BatchResult, Capability, Entry
from minisrv.kv import KVPool, SlotAllocator
from minisrv.kv.table import ReqToTokenTable
from minisrv.model.flat import FlatBatch
from minisrv.request import Req
from minisrv.runner.attention import AttentionBackend, make_attention, write_kv
from minisrv.runner.graph import DecodeGraphs, PaddedDecode
from minisrv.runner.sampler import LogitsProcessor, Sampler
from minisrv.runner.speculative import compute_checks, jump_forward, prepare_checks
from minisrv.runner.step_inputs import StepInputs, entry_tokens
from minisrv.runner.table_batch import TableBatch
from minisrv.sampling import TokenLogprobs

if TYPE_CHECKING:
    from minisrv.model import CityLM

__all__ = ["ModelBackend", "ModelRunner", "StepInputs"]


class ModelRunner:
    """Runs each step on a real CityLM: one flat forward over every entry of the batch.

    The KV of all requests lives in one ``KVPool`` built by ``attach_kv`` (the scheduler
    calls it with its ``kv_capacity``); each step finds a request's slots through its row of
    the scheduler's request-to-token table (``attach_table``), so ``prepare`` copies the new
    tokens, a row and a length per request, nothing that grows with the context. A runner
    driven by hand, without a table, reads each request's ``kv_slots`` (``FlatBatch``).
    ``attention`` is ``"padded"`` (one masked attention call per layer), ``"flex"`` (one
    ragged flex_attention call per layer, no padding), ``"loop"`` (one call per request) or
    ``"auto"``, resolved once here to flex on a GPU and padded on the CPU. ``device`` moves
    the model there first (``None``: where it is). ``logits_processors`` are applied to
    every step's logits before sampling (``Sampler``).

    ``static_decode`` runs decode-only steps of up to ``max_running`` requests over
    static buffers padded to a batch bucket (``DecodeGraphs``, contexts up to
    ``graph_context`` tokens, default the model's ``max_seq_len`` or the pool's capacity if
    smaller); ``cuda_graph`` (a CUDA
    model only, else ValueError) does the same and replays each bucket's CUDA graph,
    captured in ``attach_kv`` (UNTESTED until run on a GPU).
    """

    time_unit = "step"
    cost_unit = "tokens"
    # all but ENDS_OWN_STEPS (the device thread ends its steps) and TIMES_HOST_COPIES (the
    # host tier's copies take their own time on the device); checks: runner.speculative
    capabilities = frozenset(Capability) - {Capability.ENDS_OWN_STEPS,
                                            Capability.TIMES_HOST_COPIES}

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
            self.graphs = DecodeGraphs(self.model, self.pool, max_running, context=context,
                                       cuda_graph=cuda_graph, attention=self.attn)
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
        if batch.drafts is not None:
            return prepare_checks(self, batch)
        new_ids, rows = [], []
        row = -1
        for entry in batch.entries:
            new_ids.append(entry_tokens(entry.req, entry.start, entry.end))
            row += entry.n_tokens
            if entry.sample:
                rows.append(row)
        sampling = [e.req for e in batch.entries if e.sample]
        samples = tuple(e.sample for e in batch.entries)
        params, generators = [req.params for req in sampling], self.sampler.generators(sampling)
        histories = self.sampler.histories(sampling)
        graphs, entries = self.graphs, batch.entries
        if (graphs is not None and all(samples)
                and graphs.fits([e.n_tokens for e in entries], [e.end for e in entries])):
            padded = self.padded_decode(new_ids, entries)
            every_row = torch.arange(padded.n, device=self.model.device)
            return StepInputs(None, padded, padded.has_futures, every_row,
                              samples, sampling, params, generators, histories)
        flat = self.flat_batch(new_ids, entries)
        return StepInputs(
            flat, self.attn.prepare(flat), any(t < 0 for ids in new_ids for t in ids),
            torch.tensor(rows, dtype=torch.long, device=self.model.device),
            samples, sampling, params, generators, histories)

    def flat_batch(self, new_ids: list[list[int]],
                   entries: Sequence[Entry]) -> FlatBatch | TableBatch:
        """The step's flat batch: each entry's KV found through its request's row of the
        table (a ``TableBatch``: new tokens, rows and lengths copied, nothing per context);
        without a table (a runner driven by hand) through its slot list (``FlatBatch``)."""
        if self.table is None:
            return FlatBatch(new_ids, [e.req.kv_slots[:e.end] for e in entries],
                             self.model.device)
        table = self.table
        return TableBatch(new_ids, [table.row(e.req) for e in entries],
                          [e.end for e in entries], table.tensor)

    def padded_decode(self, new_ids: list[list[int]], entries: Sequence[Entry]) -> PaddedDecode:
        """A decode step over the static buffers, its key slots read from the table (or,
        without one, from the requests' slot lists)."""
        assert self.graphs is not None
        tokens = [ids[0] for ids in new_ids]
        if self.table is None:
            return self.graphs.prepare_slots(tokens, [e.req.kv_slots[:e.end] for e in entries])
        table = self.table
        return self.graphs.prepare(tokens, [table.row(e.req) for e in entries],
                                   [e.end for e in entries], table.tensor)

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
            return compute_checks(self, step)
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
            return jump_forward(self.jump, step, per_entry, float(cost))
        return BatchResult(per_entry, cost=float(cost), elapsed=1.0)

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
        return self.model.lm_head(self.model.norm(x[step.sample_rows]))

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
