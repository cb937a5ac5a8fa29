"""Seeded request mixes: who arrives when, with how long a prompt, wanting how many tokens.

A ``Workload`` is plain data (prompts, output lengths, arrival times) so that the same mix
can be replayed against every scheduling mode and both backends. Every generator takes a
``seed`` and draws from its own ``numpy.random.Generator``: the same call always returns
the same workload, on any machine.

Arrival processes (``ARRIVALS``):

* ``"poisson"``: independent arrivals at ``rate`` per unit of time (exponential gaps), the
  usual model of many users acting independently; the first request arrives at time 0.
* ``"fixed"``: exactly one request every ``1 / rate``.
* ``"all-at-once"``: everything arrives at time 0 (an offline batch job).

Output lengths (``output_lengths``) follow a gamma distribution with a chosen mean and
coefficient of variation (standard deviation / mean): ``cv = 0`` gives identical lengths,
``cv = 1`` the exponential distribution (many short answers, a few very long ones), which is
the default of the GPU-scale workload because the spread of output lengths is exactly what
request-level batching suffers from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from minisrv.tokenizer import Tokenizer

__all__ = [
    "ARRIVALS",
    "Workload",
    "arrival_times",
    "output_lengths",
    "gpu_scale_workload",
    "prefix_groups_workload",
    "group_popularity",
    "city_prompts",
    "citylm_workload",
    "notes_trace_workload",
    "summarize_lengths",
    "shared_prompt_workload",
    "chat_sessions_workload",
    "few_shot_workload",
    "parallel_sampling_workload",
    "PREFIX_WORKLOADS",
]

ARRIVALS: tuple[str, ...] = ("poisson", "fixed", "all-at-once")

# The GPU-scale workload of the lecture notes: 2000 requests, prompts 100-1000 tokens,
# outputs averaging about 200 tokens, Poisson arrivals; served with a batch cap of 64.
GPU_SCALE_REQUESTS = 2000
GPU_SCALE_PROMPT_RANGE = (100, 1000)
GPU_SCALE_MEAN_OUTPUT = 200
GPU_SCALE_MAX_OUTPUT = 2000
GPU_SCALE_BATCH_CAP = 64


@dataclass(frozen=True)
class Workload:
    """A replayable list of requests.

    ``output_lens[i]`` is request ``i``'s ``max_new_tokens``; ``arrivals[i]`` its arrival on
    the serving clock (simulated seconds for the GPU simulator, steps for the real model).
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.output_lens) != n or len(self.arrivals) != n:
            raise ValueError(
                f"workload {self.name!r}: {n} prompts, {len(self.output_lens)} output lengths "
                f"and {len(self.arrivals)} arrivals; they must match"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        """Tokens in each prompt."""
        return [len(p) for p in self.prompts]

    @property
    def total_output_tokens(self) -> int:
        """Tokens the whole workload asks to generate."""
        return int(sum(self.output_lens))

    @property
    def mean_output(self) -> float:
        """Average requested output length."""
        return self.total_output_tokens / len(self) if len(self) else 0.0


def arrival_times(
    n: int, rate: float, kind: str = "poisson", rng: np.random.Generator | None = None
) -> list[float]:
    """``n`` non-decreasing arrival times starting at 0 for the process ``kind``.

    ``rate`` is arrivals per unit of time (ignored by ``"all-at-once"``).
    """
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; supported: {', '.join(ARRIVALS)}")
    _check_count(n)
    if kind == "all-at-once":
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    if kind == "fixed":
        return [i / rate for i in range(n)]
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[:1] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


def output_lengths(
    n: int,
    mean: float,
    cv: float = 1.0,
    max_len: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[int]:
    """``n`` output lengths from a gamma distribution with ``mean`` and spread ``cv``.

    Lengths are rounded up to whole tokens (at least 1) and capped at ``max_len``. The cap
    keeps every request's KV reservation bounded; it trims the mean slightly when ``cv`` is
    large, so report the workload's ``mean_output`` rather than ``mean``.
    """
    _check_count(n)
    if not mean >= 1:
        raise ValueError(f"mean output length must be >= 1, got {mean}")
    if not cv >= 0:
        raise ValueError(f"cv must be >= 0, got {cv}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if cv == 0:
        lengths = np.full(n, float(mean))
    else:
        rng = rng if rng is not None else np.random.default_rng(0)
        shape = 1.0 / cv**2
        lengths = rng.gamma(shape, mean / shape, size=n)
    lengths = np.maximum(np.ceil(lengths), 1)
    if max_len is not None:
        lengths = np.minimum(lengths, max_len)
    return lengths.astype(int).tolist()


def gpu_scale_workload(
    n: int = GPU_SCALE_REQUESTS,
    rate: float = 64.0,
    arrival: str = "poisson",
    prompt_range: tuple[int, int] = GPU_SCALE_PROMPT_RANGE,
    mean_output: float = GPU_SCALE_MEAN_OUTPUT,
    output_cv: float = 1.0,
    max_output: int = GPU_SCALE_MAX_OUTPUT,
    vocab_size: int = 128256,
    seed: int = 0,
) -> Workload:
    """The notes' GPU-scale mix: prompts uniform in ``prompt_range`` (inclusive), outputs
    gamma-distributed with ``mean_output`` and ``output_cv`` (exponential by default,
    capped at ``max_output``), arrivals from ``arrival`` at ``rate`` requests per second.

    Prompt tokens are random ids, distinct across requests, so no two prompts share a prefix
    (prefix caching has nothing to find here; later chapters build workloads that share).
    """
    low, high = prompt_range
    if not 1 <= low <= high:
        raise ValueError(f"prompt_range must satisfy 1 <= low <= high, got {prompt_range}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(low, high + 1, size=n)
    outputs = output_lengths(n, mean_output, output_cv, max_output, rng)
    arrivals = arrival_times(n, rate, arrival, rng)
    tokens = rng.integers(2, vocab_size, size=int(prompt_lens.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(prompt_lens)]).tolist()
    prompts = [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    description = (
        f"{n} requests, prompts uniform {low}-{high} tokens, outputs gamma(mean "
        f"{mean_output:g}, cv {output_cv:g}) capped at {max_output}, {arrival} arrivals"
        + ("" if arrival == "all-at-once" else f" at {rate:g}/s")
        + f", seed {seed}"
    )
    return Workload("gpu-scale", prompts, outputs, arrivals, description)


def group_popularity(n_groups: int, hot_share: float | None = None) -> np.ndarray:
    """Probability of each prefix group: uniform, or group 0 drawing ``hot_share`` of all
    requests and the others splitting the rest evenly (one hot system prompt)."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be an int >= 1, got {n_groups!r}")
    if hot_share is None:
        return np.full(n_groups, 1.0 / n_groups)
    if not 0 <= hot_share <= 1 or (n_groups == 1 and hot_share != 1):
        raise ValueError(f"hot_share must be in [0, 1] (1 with a single group), got {hot_share}")
    if n_groups == 1:
        return np.ones(1)
    probs = np.full(n_groups, (1.0 - hot_share) / (n_groups - 1))
    probs[0] = hot_share
    return probs


def prefix_groups_workload(
    n: int = 4000,
    n_groups: int = 16,
    prefix_len: int = 2000,
    question_range: tuple[int, int] = (20, 60),
    mean_output: float = 100,
    output_cv: float = 1.0,
    max_output: int = 1000,
    rate: float = 100.0,
    arrival: str = "poisson",
    hot_share: float | None = None,
    vocab_size: int = 128256,
    seed: int = 0,
) -> Workload:
    """Requests from ``n_groups`` prefix groups: each prompt is its group's shared
    ``prefix_len``-token prefix (a system prompt, a document, few-shot examples) followed by
    its own question of ``question_range`` tokens (inclusive). A request's group is drawn
    from ``group_popularity(n_groups, hot_share)``; outputs and arrivals as in
    ``gpu_scale_workload``. The routing chapter's workload: with several workers, only a
    router that sends a group to the same worker lets that worker's cache keep the prefix.
    """
    low, high = question_range
    if not 1 <= low <= high:
        raise ValueError(f"question_range must satisfy 1 <= low <= high, got {question_range}")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
    _check_count(n)
    probs = group_popularity(n_groups, hot_share)
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(2, vocab_size, size=(n_groups, prefix_len)).tolist()
    groups = rng.choice(n_groups, size=n, p=probs)
    question_lens = rng.integers(low, high + 1, size=n)
    outputs = output_lengths(n, mean_output, output_cv, max_output, rng)
    arrivals = arrival_times(n, rate, arrival, rng)
    tokens = rng.integers(2, vocab_size, size=int(question_lens.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(question_lens)]).tolist()
    prompts = [prefixes[g] + tokens[a:b]
               for g, a, b in zip(groups.tolist(), bounds, bounds[1:], strict=False)]
    skew = "uniform" if hot_share is None else f"group 0 drawing {hot_share:.0%}"
    description = (
        f"{n} requests from {n_groups} groups ({skew}) of {prefix_len}-token prefixes + "
        f"{low}-{high}-token questions, outputs gamma(mean {mean_output:g}, cv {output_cv:g}), "
        f"{arrival} arrivals" + ("" if arrival == "all-at-once" else f" at {rate:g}/s")
        + f", seed {seed}"
    )
    return Workload("prefix-groups", prompts, outputs, arrivals, description)


def city_prompts(tok: Tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` CityLM prompts: a showcase country's line cut after 0-2 cities, e.g. ``"FR:"``
    or ``"JP: Tokyo, Yokohama,"``, so the model continues with more cities.
    """
    from minisrv.data import SHOWCASE_COUNTRIES, country_line

    _check_count(n)
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        code = SHOWCASE_COUNTRIES[i % len(SHOWCASE_COUNTRIES)]
        n_cities = int(rng.integers(0, 3))
        text = f"{code}:" if n_cities == 0 else country_line(code, n_cities) + ","
        prompts.append(tok.encode(text))
    return prompts


def citylm_workload(
    tok: Tokenizer,
    n: int = 16,
    output_range: tuple[int, int] = (2, 40),
    arrival_every: float = 0.0,
    seed: int = 0,
) -> Workload:
    """``n`` CityLM requests with ``max_new_tokens`` uniform in ``output_range``
    (inclusive); request ``i`` arrives at step ``i * arrival_every`` (0: all at once).
    """
    low, high = output_range
    if not 1 <= low <= high:
        raise ValueError(f"output_range must satisfy 1 <= low <= high, got {output_range}")
    if not arrival_every >= 0:
        raise ValueError(f"arrival_every must be >= 0, got {arrival_every}")
    rng = np.random.default_rng(seed)
    outputs = rng.integers(low, high + 1, size=n).tolist()
    prompts = city_prompts(tok, n, seed)
    arrivals = [i * arrival_every for i in range(n)]
    description = f"{n} CityLM requests, max_new_tokens uniform {low}-{high}"
    if arrival_every:
        description += f", one arriving every {arrival_every:g} steps"
    return Workload("citylm", prompts, outputs, arrivals, description)


def notes_trace_workload(tok: Tokenizer) -> Workload:
    """The three requests of the notes' trace: ``max_new_tokens`` 3, 5 and 3; the first two
    arrive at step 0, the third at step 2 (serve them with at most 2 running).
    """
    prompts = [tok.encode(text) for text in ("FR:", "JP:", "BR:")]
    return Workload(
        "notes-trace", prompts, [3, 5, 3], [0.0, 0.0, 2.0], "3 requests, max 2 running"
    )


# ------------------------------------------------------------------------------------------
# The serving patterns whose prompts share prefixes (the RadixAttention chapter).
# Request ``i`` arrives at step ``arrivals[i]``; the lists are in arrival order.


def shared_prompt_workload(
    tok: Tokenizer, n_users: int = 16, output_len: int = 16, arrival_every: float = 1.0,
    n_cities: int = 3,
) -> Workload:
    """Many users, one system prompt: the three-country few-shot header of
    ``patterns.system_prompt``, then each user's own question (a country code, followed by
    0-2 of its cities once the codes run out, so no two prompts are equal).
    """
    from minisrv.data import country_line
    from minisrv.patterns import USER_COUNTRIES, system_prompt

    _check_count(n_users)
    _check_steps(output_len, arrival_every)
    head = system_prompt(n_cities)
    prompts = []
    for i in range(n_users):
        code = USER_COUNTRIES[i % len(USER_COUNTRIES)]
        extra = (i // len(USER_COUNTRIES)) % 3
        question = f"{code}:" if extra == 0 else country_line(code, extra) + ","
        prompts.append(tok.encode(head + question))
    arrivals = [i * arrival_every for i in range(n_users)]
    return Workload("shared-prompt", prompts, [output_len] * n_users, arrivals,
                    f"{n_users} users sharing a {len(tok.encode(head))}-token system prompt")


def chat_sessions_workload(
    model, tok: Tokenizer, n_sessions: int = 8, n_turns: int = 4, max_answer_tokens: int = 10,
    turn_gap: float = 48.0, message_cities: int = 1,
) -> Workload:
    """``n_sessions`` independent chats of ``n_turns`` turns: turn ``t``'s prompt is turn
    ``t - 1``'s prompt + its answer + the user's new message.

    A message is one more example line (a country and ``message_cities`` of its cities; none
    when 0) and a question (a country code). Session ``s`` opens with its own line, so
    sessions share nothing but ``<bos>`` and all reuse comes from a session's own history.
    Answers are CityLM's greedy continuation (``model.reference_generate``), kept up to the
    last complete city and a newline, as in ``patterns.chat_turns``; a request's
    ``max_new_tokens`` is its answer's length. Every
    session's turn ``t`` arrives at step ``t * turn_gap``; request ``i`` is turn
    ``i // n_sessions`` of session ``i % n_sessions``.
    """
    from minisrv.data import SHOWCASE_COUNTRIES, country_line
    from minisrv.patterns import _complete_line

    _check_count(n_sessions)
    _check_count(n_turns)
    _check_steps(max_answer_tokens, turn_gap)
    if message_cities < 0:
        raise ValueError(f"message_cities must be >= 0, got {message_cities}")
    codes = SHOWCASE_COUNTRIES
    histories = [tok.encode(country_line(codes[s % len(codes)], 1) + "\n")
                 for s in range(n_sessions)]
    prompts: list[list[int]] = []
    outputs: list[int] = []
    arrivals: list[float] = []
    for turn in range(n_turns):
        for s in range(n_sessions):
            example = codes[(s + 1 + 3 * turn) % len(codes)]
            code = codes[(s + 2 + 3 * turn) % len(codes)]
            line = country_line(example, message_cities) + "\n" if message_cities else ""
            prompt = histories[s] + tok.encode(f"{line}{code}:", bos=False)
            generated = model.reference_generate(prompt, max_answer_tokens)
            finished = bool(generated) and generated[-1] == tok.eos_id
            answer = tok.encode(_complete_line(tok.decode(generated), finished), bos=False)
            prompts.append(prompt)
            outputs.append(len(answer))
            arrivals.append(turn * turn_gap)
            histories[s] = prompt + answer
    return Workload("chat-sessions", prompts, outputs, arrivals,
                    f"{n_sessions} chat sessions x {n_turns} turns")


def few_shot_workload(
    tok: Tokenizer, n_groups: int = 4, per_group: int = 8, output_len: int = 16,
    group_gap: float = 0.0, interleave: bool = False, n_cities: int = 3,
) -> Workload:
    """Few-shot prompting: each group's requests share the same two example lines and ask
    different countries. Requests come in waves ``group_gap`` steps apart: by default a wave
    is one whole group (its requests arrive together); with ``interleave`` a wave holds one
    request of every group, so the groups alternate.
    """
    from minisrv.data import SHOWCASE_COUNTRIES, country_line

    _check_count(n_groups)
    _check_count(per_group)
    _check_steps(output_len, max(group_gap, 1.0))
    codes = SHOWCASE_COUNTRIES
    rows: list[tuple[int, int, list[int]]] = []  # (group, member, prompt)
    for g in range(n_groups):
        shots = (codes[(2 * g) % len(codes)], codes[(2 * g + 1) % len(codes)])
        head = "".join(country_line(code, n_cities) + "\n" for code in shots)
        askable = [c for c in codes if c not in shots]
        for m in range(per_group):
            code = askable[m % len(askable)]
            extra = (m // len(askable)) % 3
            question = f"{code}:" if extra == 0 else country_line(code, extra) + ","
            rows.append((g, m, tok.encode(head + question)))
    if interleave:
        rows.sort(key=lambda row: (row[1], row[0]))
    prompts = [row[2] for row in rows]
    arrivals = [float(row[1] if interleave else row[0]) * group_gap for row in rows]
    order = "interleaved" if interleave else "group by group"
    return Workload("few-shot", prompts, [output_len] * len(rows), arrivals,
                    f"{n_groups} few-shot groups x {per_group} requests, {order}")


def parallel_sampling_workload(
    tok: Tokenizer, n_samples: int = 8, question: str = "JP:", output_len: int = 16,
) -> Workload:
    """One prompt (system prompt + ``question``) sent ``n_samples`` times at once, as when
    sampling several answers to pick the best."""
    from minisrv.patterns import parallel_samples

    _check_count(n_samples)
    _check_steps(output_len, 1.0)
    prompts = parallel_samples(tok, n_samples, question) if n_samples else []
    return Workload("parallel-sampling", prompts, [output_len] * n_samples, [0.0] * n_samples,
                    f"one prompt sampled {n_samples} times")


PREFIX_WORKLOADS: tuple[str, ...] = (
    "shared-prompt", "chat-sessions", "few-shot", "parallel-sampling")


def _check_steps(output_len: int, gap: float) -> None:
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"output length must be an int >= 1, got {output_len!r}")
    if not gap >= 0:
        raise ValueError(f"arrival gap must be >= 0, got {gap}")


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"number of requests must be an int >= 0, got {n!r}")


def summarize_lengths(values: Sequence[int]) -> str:
    """``"mean 201.3, median 139, max 1490"``: a one-line description for chapter prose."""
    arr = np.asarray(values)
    return f"mean {arr.mean():.1f}, median {np.median(arr):g}, max {arr.max()}"
