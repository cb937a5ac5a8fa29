"""The three serving patterns of the overview, as CityLM prompts, and what they repeat.

A server rarely sees unrelated prompts. Many users share one system prompt; a chat's next
turn resends the whole conversation; one prompt is sampled several times. These builders
produce each pattern in the city language, and ``repeated_prefill`` counts how many prompt
tokens a server would prefill again although it has already computed them: the work that
prefix caching (RadixAttention, a later chapter) exists to remove. That chapter serves the
chat and sampling patterns as workloads (``chat_sessions_workload``,
``parallel_sampling_workload``); the shared prompt and few-shot groups are prefix groups
(``groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from minisrv.tokenizer import Tokenizer
from minisrv.train.data import SHOWCASE_COUNTRIES, country_line
from minisrv.workloads.mixes import Workload, check_workload_args

SYSTEM_COUNTRIES: tuple[str, ...] = ("FR", "DE", "IT")  # the shared "system prompt"
USER_COUNTRIES: tuple[str, ...] = ("JP", "US", "GB", "ES", "CN", "IN", "BR", "CA", "MX")
# The four serving patterns of the RadixAttention chapter, as workload names.
PREFIX_WORKLOADS: tuple[str, ...] = (
    "shared-prompt", "chat-sessions", "few-shot", "parallel-sampling")


class PrefillCount(NamedTuple):
    total: int  # prompt tokens over all requests
    repeated: int  # of those, tokens already computed for an earlier request (same prefix)

    @property
    def fraction(self) -> float:
        """Share of prefill work that is a repeat."""
        return self.repeated / self.total if self.total else 0.0


def system_prompt(n_cities: int = 3) -> str:
    """A few-shot "system prompt" in the city language: one line per system country."""
    return "\n".join(country_line(code, n_cities) for code in SYSTEM_COUNTRIES) + "\n"


def shared_system_prompt(tok: Tokenizer, n_users: int, n_cities: int = 3) -> list[list[int]]:
    """Pattern 1: ``n_users`` users, one shared system prompt, each asking another country."""
    _check_positive("n_users", n_users)
    head = system_prompt(n_cities)
    return [tok.encode(f"{head}{USER_COUNTRIES[i % len(USER_COUNTRIES)]}:")
            for i in range(n_users)]


def parallel_samples(tok: Tokenizer, n_samples: int, question: str = "JP:") -> list[list[int]]:
    """Pattern 3: one prompt sent ``n_samples`` times (e.g. to sample several answers)."""
    _check_positive("n_samples", n_samples)
    return [tok.encode(system_prompt() + question) for _ in range(n_samples)]


def chat_turns(model, tok: Tokenizer, n_turns: int,
               max_answer_tokens: int = 40) -> tuple[list[list[int]], list[list[int]]]:
    """Pattern 2: a multi-turn chat; turn k's prompt = turn k-1's prompt + answer + question.

    Each "question" is a new country code and each answer is CityLM's greedy continuation.
    Like a chat client that shows only complete sentences, the answer is kept up to its last
    complete city (at most ``max_answer_tokens`` generated) and ends with a newline, so every
    turn starts on a fresh line. Returns (prompts, answers) as token ids, one per turn.
    """
    _check_positive("n_turns", n_turns)
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    history = tok.encode(system_prompt())
    for turn in range(n_turns):
        prompt = history + tok.encode(f"{USER_COUNTRIES[turn % len(USER_COUNTRIES)]}:", bos=False)
        generated = model.reference_generate(prompt, max_answer_tokens)
        answer = tok.encode(_complete_line(tok.decode(generated), generated[-1] == tok.eos_id),
                            bos=False)
        prompts.append(prompt)
        answers.append(answer)
        history = prompt + answer
    return prompts, answers


def _complete_line(text: str, finished: bool) -> str:
    """The first line of ``text``, cut back to its last complete city unless it ended."""
    line, newline, _ = text.partition("\n")
    if not (newline or finished) and "," in line:
        line = line.rsplit(",", 1)[0]
    return line + "\n"


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
    last complete city and a newline, as in ``chat_turns``; a request's
    ``max_new_tokens`` is its answer's length. Every
    session's turn ``t`` arrives at step ``t * turn_gap``; request ``i`` is turn
    ``i // n_sessions`` of session ``i % n_sessions``.
    """
    check_workload_args(n_sessions)
    check_workload_args(n_turns, max_answer_tokens, turn_gap)
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


def parallel_sampling_workload(
    tok: Tokenizer, n_samples: int = 8, question: str = "JP:", output_len: int = 16,
) -> Workload:
    """One prompt (system prompt + ``question``) sent ``n_samples`` times at once, as when
    sampling several answers to pick the best."""
    check_workload_args(n_samples, output_len, 1.0)
    prompts = parallel_samples(tok, n_samples, question) if n_samples else []
    return Workload("parallel-sampling", prompts, [output_len] * n_samples, [0.0] * n_samples,
                    f"one prompt sampled {n_samples} times")


def repeated_prefill(prompts: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]] | None = None) -> PrefillCount:
    """Count prompt tokens whose prefix was already computed for an earlier request.

    Requests are taken in order. A token is a repeat when the prompt up to and including it
    is a prefix of what an earlier request computed: its prompt, and with ``outputs`` its
    prompt + output but the last output token. The last sampled token never went through a
    forward pass, so it has no KV; SGLang caches a finished request's
    ``(input + output)[:-1]`` for the same reason. (A ``chat_turns`` answer ends in a newline
    the model never sampled, where the cached sequence parts from it: no KV either.) A prompt
    matched to its end still computes its last token, whose forward pass yields the logits of
    the first new token, so at most ``len(prompt) - 1`` of its tokens count (SGLang's prefix
    match and minisrv's ``KVManager.match`` stop one token short likewise). This is what an
    unlimited prefix cache would skip; a trie of token ids finds it in O(total tokens).
    """
    if outputs is not None and len(outputs) != len(prompts):
        raise ValueError(f"got {len(outputs)} outputs for {len(prompts)} prompts")
    root: dict[int, dict] = {}
    total = repeated = 0
    for i, prompt in enumerate(prompts):
        node = root
        matched = 0
        for token in prompt:
            if token not in node:
                break
            node = node[token]
            matched += 1
        total += len(prompt)
        repeated += min(matched, max(len(prompt) - 1, 0))  # the last token yields the logits
        seen = list(prompt) + (list(outputs[i])[:-1] if outputs is not None else [])
        node = root
        for token in seen:
            node = node.setdefault(token, {})
    return PrefillCount(total, repeated)


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
