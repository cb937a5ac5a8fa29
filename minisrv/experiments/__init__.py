"""The book's experiments: one module per chapter's runs and sweeps.

Each function builds fresh engines, serves a workload, checks the outputs where a reference
is given (every token against the request generated alone) and returns plain results, named
tuples or DataFrames; ``minisrv.viz`` only draws them. A reader can re-run any of them
larger than the chapter does by passing other arguments.

* ``overview`` (the server at a glance): a few requests through the engine, step by step;
* ``scheduler`` (the scheduler loop): ``rate_runs`` and ``rate_sweep`` on the simulated GPU,
  ``throughput_at_latency`` read off a sweep;
* ``chunked`` (chunked prefill): ``spike_run`` and ``chunk_sweep`` on the simulated GPU;
* ``batching`` (selective batching): flat against separate forwards, the engine against
  each request alone, each request's outputs alone (``alone_outputs``), KV pool sweeps;
* ``host_tier`` (the host tier): chats with and without it, the simulated H100's long chats,
  the load-back break-even;
* ``radix`` (RadixAttention): serving with and without the cache, hit rates per chat turn;
* ``pages`` (KV memory in pages): empty slots per page size read from the allocator, key
  runs per tile, hits of the radix tree against vLLM's block cache, retraction runs;
* ``cache_aware`` (cache-aware scheduling): policies, capacities, rounds, scheduling cost;
* ``routing`` (routing across workers): ``simulate_cluster`` and ``serve_cluster``;
* ``overlap``, ``lanes``, ``breakdown`` (zero-overhead scheduling): measured waste and gain,
  the two-lane model (``timeline``, ``throughput_ratio``), the per-step time breakdown;
* ``speculative`` (speculative decoding): acceptance against k, checks traced, the
  rejection rule's distribution, the roofline speed-up against k and batch;
* ``server`` (serving it for real): a server opened in-process, layouts benchmarked, the
  simulated H100's engine against the request rate (``policy_rate_sweep``, ``goodput``);
* ``structured`` (structured output): mask traces, a grammar's automaton, masked
  probabilities, JSON runs validated against their schema, the mask's cost per step;
* ``gpu`` (the GPU appendix): step times and decode throughput on a device, recorded runs.

Names are imported lazily (``from minisrv.experiments import rate_sweep`` loads only the
scheduler chapter's module). The serving runtime never imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "DEMO_LENGTHS": "overview",
    "DEMO_QUESTIONS": "overview",
    "RequestAtStep": "overview",
    "StepByStep": "overview",
    "StepView": "overview",
    "step_by_step": "overview",
    "SimSetting": "scheduler",
    "rate_runs": "scheduler",
    "rate_sweep": "scheduler",
    "sweep_table": "scheduler",
    "throughput_at_latency": "scheduler",
    "CHUNK_SIZES": "chunked",
    "LLAMA3_8B_LONG": "chunked",
    "SGLANG_DEFAULT": "chunked",
    "VLLM_SMALL_GPU": "chunked",
    "VLLM_V1_DEFAULT": "chunked",
    "SpikeRun": "chunked",
    "chunk_runs": "chunked",
    "chunk_sweep": "chunked",
    "chunk_table": "chunked",
    "long_prompt_workload": "chunked",
    "spike_run": "chunked",
    "spike_workload": "chunked",
    "EngineVsAlone": "batching",
    "alone_outputs": "batching",
    "FlatCheck": "batching",
    "PoolRun": "batching",
    "engine_vs_alone": "batching",
    "flat_equivalence": "batching",
    "pool_sweep": "batching",
    "run_pool": "batching",
    "ServedRequest": "radix",
    "LONG_CONTEXT_8B": "host_tier",
    "TierRun": "host_tier",
    "TierWalk": "host_tier",
    "break_even": "host_tier",
    "break_even_length": "host_tier",
    "chat_tier_run": "host_tier",
    "chat_tier_table": "host_tier",
    "load_seconds": "host_tier",
    "long_chats": "host_tier",
    "prefill_seconds": "host_tier",
    "prefill_step_seconds": "host_tier",
    "sim_tier_run": "host_tier",
    "sim_tier_runs": "host_tier",
    "sim_tier_table": "host_tier",
    "tier_walk": "host_tier",
    "cache_comparison": "radix",
    "capacity_sweep": "radix",
    "chat_capacity_report": "radix",
    "per_turn_hit_rates": "radix",
    "request_hit_rate": "radix",
    "serve_step": "radix",
    "serve_with_cache": "radix",
    "shared_header_workload": "radix",
    "simulated_cache_table": "radix",
    "PolicyRun": "cache_aware",
    "admission_rounds": "cache_aware",
    "capacity_table": "cache_aware",
    "few_shot_experiment": "cache_aware",
    "forest_sweep": "cache_aware",
    "gpu_policy_table": "cache_aware",
    "group_table": "cache_aware",
    "policy_row": "cache_aware",
    "policy_table": "cache_aware",
    "prefix_stream_workload": "cache_aware",
    "reference_outputs": "cache_aware",
    "request_table": "cache_aware",
    "run_policy": "cache_aware",
    "interleaved_groups": "cache_aware",
    "ChatCapacityRun": "radix",
    "chat_capacity_run": "radix",
    "chat_workload": "radix",
    "scheduling_cost": "cache_aware",
    "ClusterResult": "routing",
    "run_cluster": "routing",
    "serve_cluster": "routing",
    "simulate_cluster": "routing",
    "LOOPS": "overlap",
    "TimedWindow": "overlap",
    "model_gain": "overlap",
    "timed_engine": "overlap",
    "timed_gain": "overlap",
    "timed_window": "overlap",
    "waste_by_length": "overlap",
    "Interval": "lanes",
    "Timeline": "lanes",
    "late_stop_waste": "lanes",
    "throughput_ratio": "lanes",
    "timeline": "lanes",
    "CPU_PARTS": "breakdown",
    "DEVICE_PARTS": "breakdown",
    "PARTS": "breakdown",
    "StepTiming": "breakdown",
    "StepTimings": "breakdown",
    "time_steps": "breakdown",
    "CONTEXTS": "speculative",
    "KS": "speculative",
    "CheckRow": "speculative",
    "EngineRun": "speculative",
    "SamplingCheck": "speculative",
    "acceptance_sweep": "speculative",
    "breakeven_table": "speculative",
    "check_trace": "speculative",
    "chi2_critical": "speculative",
    "drafters": "speculative",
    "engine_table": "speculative",
    "sampling_check": "speculative",
    "serve_speculative": "speculative",
    "spec_workloads": "speculative",
    "speedup_frame": "speculative",
    "Layout": "server",
    "LayoutRun": "server",
    "bench_frame": "server",
    "bench_layouts": "server",
    "open_server": "server",
    "read_metrics": "server",
    "run_sync": "server",
    "slot_ranges": "server",
    "stream_completion": "server",
    "SIM_CONFIGS": "server",
    "beyond_spread": "server",
    "prefix_heavy_requests": "server",
    "goodput": "server",
    "policy_rate_sweep": "server",
    "policy_sweep_table": "server",
    "request_timelines": "server",
    "sim_server_runs": "server",
    "spread": "server",
    "spread_summary": "server",
    "CITY_SCHEMA": "structured",
    "FULL_STOP": "structured",
    "PICK": "structured",
    "RECORDS": "structured",
    "THREE_CITIES": "structured",
    "Automaton": "structured",
    "MaskStep": "structured",
    "StepProbability": "structured",
    "automaton": "structured",
    "decode_step_ms": "structured",
    "in_process_server": "structured",
    "json_runs": "structured",
    "fill_cost_us": "structured",
    "mask_cost_us": "structured",
    "mask_trace": "structured",
    "step_probabilities": "structured",
    "synthetic_vocabulary": "structured",
    "MaskRun": "structured",
    "served_masks": "structured",
    "RECORDED_STEP_OPS": "gpu",
    "StepOps": "gpu",
    "DEMO_TEXT": "gpu",
    "DecodeRun": "gpu",
    "current_gpu": "gpu",
    "device_label": "gpu",
    "engine_decode_throughput": "gpu",
    "predicted_decode_throughput": "gpu",
    "ragged_vs_padded": "gpu",
    "random_model": "gpu",
    "recorded_gpu_run": "gpu",
    "roofline_step_times": "gpu",
    "show_triton_kernel": "gpu",
    "step_time_sweep": "gpu",
    "write_tiny_llama": "gpu",
    "BLOCK_SIZE": "pages",
    "CACHE_SETTINGS": "pages",
    "KEY_TILE": "pages",
    "KEY_TILES": "pages",
    "PAGE_SIZES": "pages",
    "PREEMPT_SETTINGS": "pages",
    "PageRun": "pages",
    "TRACE_SETTINGS": "pages",
    "TraceHits": "pages",
    "first_requests": "pages",
    "hit_table": "pages",
    "key_runs": "pages",
    "occupancy_table": "pages",
    "page_run": "pages",
    "preemption_runs": "pages",
    "preemption_table": "pages",
    "served_runs": "pages",
    "table_sizes": "pages",
    "tile_runs": "pages",
    "trace_hits": "pages",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"minisrv.experiments.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'minisrv.experiments' has no attribute {name!r}")
