"""The cost of structured output per step: filling the batch's token bitmask and applying it.

For each vocabulary (CityLM's 61 characters, the tiny byte-level BPE of
``minisrv.grammar.tiny_json``, and a synthetic 32k-token vocabulary of the size of a real
tokenizer's) and each batch size, every row gets its own grammar state a few random allowed
tokens in; one step is ``GrammarLogitsProcessor.fill`` (xgrammar's batched fill on the CPU)
and the apply (copy to the logits' device, ``apply_token_bitmask_inplace``). The script
prints the median microseconds of each over ``--repeats`` steps, on the CPU and, when one is
visible, with the logits on the GPU.

    python benchmarks/bench_grammar.py [--batches 1 8 64] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import xgrammar as xgr

from minisrv.experiments.mask_cost import states_in_flight, synthetic_vocabulary
from minisrv.grammar import (
    GrammarLogitsProcessor,
    GrammarState,
    Vocabulary,
    citylm_vocabulary,
    compile_grammar,
    hf_vocabulary,
)

CITIES = r"[A-Z][a-z]{1,11}(, [A-Z][a-z]{1,11}){2}\."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank", "tag"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 8}}}


def bpe_vocabulary() -> Vocabulary:
    """The tiny JSON Llama folder's byte-level BPE."""
    from transformers import AutoTokenizer

    from minisrv.grammar.tiny_json import write_json_llama

    folder = write_json_llama(tempfile.mkdtemp())
    return hf_vocabulary(AutoTokenizer.from_pretrained(str(folder)))


def time_step(vocab: Vocabulary, states: list[GrammarState], device: str,
              repeats: int) -> tuple[float, float]:
    """Median microseconds of (fill, apply) for one step over ``states``."""
    processor = GrammarLogitsProcessor(vocab.size)
    logits = torch.randn(len(states), vocab.size, device=device)
    fills, applies = [], []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        bitmask, rows = processor.fill(states)
        mid = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True),
                                        vocab_size=vocab.size, indices=rows)
        if device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        fills.append(mid - start)
        applies.append(end - mid)
    return (statistics.median(fills[5:]) * 1e6, statistics.median(applies[5:]) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    cases = [(citylm_vocabulary(), {"regex": CITIES}), (bpe_vocabulary(), {"json_schema": SCHEMA}),
             (synthetic_vocabulary(), {"json_schema": SCHEMA})]
    print(f"{'vocabulary':>14} {'tokens':>7} {'grammar':>11} {'device':>6} {'batch':>5} "
          f"{'fill us':>9} {'apply us':>9} {'total us':>9} {'us/row':>7}")
    for vocab, kwargs in cases:
        start = time.perf_counter()
        grammar = compile_grammar(vocab, **kwargs)
        compile_ms = (time.perf_counter() - start) * 1e3
        kind = next(iter(kwargs))
        for batch in args.batches:
            states = states_in_flight(grammar, vocab, batch, seed=batch, most=10)
            for device in devices:
                fill, apply = time_step(vocab, states, device, args.repeats)
                print(f"{vocab.name:>14} {vocab.size:>7} {kind:>11} {device:>6} {batch:>5} "
                      f"{fill:>9.1f} {apply:>9.1f} {fill + apply:>9.1f} "
                      f"{(fill + apply) / batch:>7.1f}")
        print(f"{'':>14} compiling the {kind} for {vocab.name}: {compile_ms:.1f} ms")


if __name__ == "__main__":
    main()
