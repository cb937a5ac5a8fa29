"""Request mixes for the book's experiments: who arrives when, with which prompt.

* ``mixes``: ``Workload`` (plain, replayable data), arrival processes, output lengths, the
  GPU-scale mix and the CityLM mixes of the scheduler chapters;
* ``groups``: the prefix-group generator (``group_workload``) and the workloads built on it:
  random-id prefix groups for routing, a shared system prompt, few-shot groups;
* ``patterns``: the serving patterns of the overview (shared prompt, chat turns, parallel
  samples), the chat-session and parallel-sampling workloads, and ``repeated_prefill``;
* ``forest``: prefix forests with an exactly known number of distinct tokens.

Every generator is seeded: the same call returns the same workload on any machine. The
serving runtime never imports this package; the book and the benchmarks do.
"""

from minisrv.workloads.forest import FOREST_LENGTHS, FOREST_SHAPE, prefix_forest_workload
from minisrv.workloads.groups import (
    few_shot_groups_workload,
    few_shot_workload,
    group_popularity,
    group_workload,
    prefix_groups_workload,
    shared_prompt_workload,
    wave_order,
)
from minisrv.workloads.mixes import (
    ARRIVALS,
    GPU_SCALE_BATCH_CAP,
    GPU_SCALE_MAX_OUTPUT,
    GPU_SCALE_MEAN_OUTPUT,
    GPU_SCALE_PROMPT_RANGE,
    GPU_SCALE_REQUESTS,
    Workload,
    arrival_times,
    check_workload_args,
    city_prompts,
    citylm_workload,
    gpu_scale_workload,
    lecture_trace_workload,
    output_lengths,
    summarize_lengths,
)
from minisrv.workloads.patterns import (
    PREFIX_WORKLOADS,
    SYSTEM_COUNTRIES,
    USER_COUNTRIES,
    PrefillCount,
    chat_sessions_workload,
    chat_turns,
    parallel_samples,
    parallel_sampling_workload,
    repeated_prefill,
    shared_system_prompt,
    system_prompt,
)

__all__ = [
    "ARRIVALS",
    "FOREST_LENGTHS",
    "FOREST_SHAPE",
    "GPU_SCALE_BATCH_CAP",
    "GPU_SCALE_MAX_OUTPUT",
    "GPU_SCALE_MEAN_OUTPUT",
    "GPU_SCALE_PROMPT_RANGE",
    "GPU_SCALE_REQUESTS",
    "PREFIX_WORKLOADS",
    "SYSTEM_COUNTRIES",
    "USER_COUNTRIES",
    "PrefillCount",
    "Workload",
    "arrival_times",
    "chat_sessions_workload",
    "chat_turns",
    "check_workload_args",
    "city_prompts",
    "citylm_workload",
    "few_shot_groups_workload",
    "few_shot_workload",
    "gpu_scale_workload",
    "group_popularity",
    "group_workload",
    "lecture_trace_workload",
    "output_lengths",
    "parallel_samples",
    "parallel_sampling_workload",
    "prefix_forest_workload",
    "prefix_groups_workload",
    "repeated_prefill",
    "shared_prompt_workload",
    "shared_system_prompt",
    "summarize_lengths",
    "system_prompt",
    "wave_order",
]
