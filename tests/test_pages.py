"""KV memory in pages (``EngineConfig(page_size=N)``): the same tokens at every page size, and
a page goes back to the pool when its last token does.

The allocator hands out pages, the request-to-token table still maps every token to its
slot, and the prefix cache keeps whole pages; none of that may change a single output
token. ``CACHES_IN_PAGES`` lists the prefix caches the identity test runs each loop with.
"""

from __future__ import annotations

import pytest
from test_host_tier import chats, serve_chats
from test_kv_manager import _admit

from minisrv.engine import Engine
from minisrv.kv import KVManager, SlotAllocator
from minisrv.sampling import SamplingParams
from minisrv.sim import SimBackend

MODEL_SEED = 1  # the random CityLM of conftest's `model` fixture

PAGE_SIZES = (1, 4, 16)
CACHES_IN_PAGES = ("radix", "blocks")  # the prefix caches that run in pages

LOOPS = {  # engine options of each way of serving, on top of BASE
    "blocking": {},
    "overlap": {"overlap": True},
    "chunked": {"chunked_prefill_size": 8},
    "retraction": {"kv_capacity": 64},
    "ngram": {"speculative": "ngram", "num_draft_tokens": 3},
    "host": {"kv_capacity": 64, "host_cache_tokens": 256},
    "lpm": {"policy": "lpm"},  # the queue ordered by match lengths in whole pages
}
BASE = {"kv_capacity": 400, "max_running": 4, "debug": True}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("cache", CACHES_IN_PAGES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_every_output_equals_the_request_alone_at_every_page_size(model, page_size, cache,
                                                                  loop) -> None:
    """Multi-turn chats (each turn's prompt is the history: a shared prefix the cache
    serves) through each loop, the books checked after every step (``debug``)."""
    if loop == "host" and cache != "radix":
        pytest.skip("the host tier keeps what the radix tree evicts")
    engine = Engine(model, **(BASE | {"cache": cache, "page_size": page_size} | LOOPS[loop]))
    for prompt, output in serve_chats(engine, chats(4, 3, seed=page_size)):
        assert output == model.reference_generate(prompt, 6, ignore_eos=True)
    stats = engine.stats
    assert stats.cached_prompt_tokens > 0  # later turns found their history in pages
    assert stats.cached_prompt_tokens % page_size == 0  # hits are whole pages
    if loop == "retraction":
        assert stats.retractions > 0
    if loop == "host":
        assert stats.loaded_tokens > 0 and stats.loaded_tokens % page_size == 0
    engine.scheduler.memory.tree.evict(10**6)
    assert engine.scheduler.memory.kv.used_count == 0  # no page leaked


def pages_used(memory: KVManager) -> int:
    return memory.kv.used_count // memory.page_size


def test_a_page_goes_back_when_its_last_token_does() -> None:
    """Speculative truncation frees a page only once it is empty; a finished request's last
    partial page goes back (the tree keeps whole pages), an aborted or retracted one's
    own pages all go back."""
    memory = KVManager(SlotAllocator(64, page_size=4), "radix")
    first = _admit(memory, 0, [0, 1, 2, 3, 4, 5])  # 6 tokens: 2 pages, the second half full
    assert first is not None and pages_used(memory) == 2
    slots = memory.slots(first)
    assert slots[4:] == [slots[4], slots[4] + 1] and slots[4] % 4 == 0
    first.output.extend([6, 7, 8])
    memory.alloc_tokens(first, 3)  # a check: fills page 2, opens page 3
    assert pages_used(memory) == 3 and memory.slots(first)[6] == slots[5] + 1
    memory.truncate(first, 1)  # rejected: page 3 held only that token
    del first.output[-1:]
    assert pages_used(memory) == 2
    memory.truncate(first, 1)  # page 2 still holds tokens 4..6
    del first.output[-1:]
    assert pages_used(memory) == 2 and first.kv_len == 7
    memory.cache_finished(first)  # the tree takes page 1; page 2 (3 tokens) goes back
    assert pages_used(memory) == 1 and memory.tree.total_size() == 4
    memory.check_integrity([])

    second = _admit(memory, 1, [0, 1, 2, 3, 9, 9, 9, 9, 9])  # page 1 cached, 2 pages its own
    assert second is not None and second.cached_len == 4 and pages_used(memory) == 3
    assert memory.release(second) == 5  # abort or retraction: its own pages go back
    assert pages_used(memory) == 1
    memory.check_integrity([])


def test_a_retracted_request_gives_its_pages_back_and_resumes(model) -> None:
    """Retraction through the engine frees every page the request owns, partial one
    included, and the request then continues as if alone."""
    engine = Engine(model, kv_capacity=64, page_size=16, cache="radix", debug=True)
    req = engine.add_request([0, *range(3, 21)], SamplingParams(12, ignore_eos=True))
    engine.step()  # the prefill: 19 tokens, the tree takes the first page
    engine.step()  # a decode: token 20 in the second page
    kv = engine.scheduler.memory.kv
    assert (req.kv_len, req.cached_len, kv.used_count) == (20, 16, 32)  # page 2 part full
    engine.retract([req])
    assert kv.used_count == 16 == engine.scheduler.memory.tree.total_size()  # the tree's page
    engine.run()
    assert req.output == model.reference_generate([0, *range(3, 21)], 12, ignore_eos=True)


def test_the_page_size_flag_reaches_the_engine() -> None:
    from minisrv.server.cli import build_parser, server_config

    def config(*flags: str):
        return server_config(build_parser().parse_args(["serve", *flags]))

    assert config().engine.page_size == 1
    engine_config = config("--page-size", "16").engine
    assert engine_config.page_size == 16
    for bad in ("0", "-4"):
        with pytest.raises(ValueError, match="page_size"):
            config("--page-size", bad)
    memory = Engine(SimBackend(), engine_config, kv_capacity=100).scheduler.memory
    assert (memory.page_size, memory.kv.capacity, memory.tree.page_size) == (16, 96, 16)


@pytest.mark.parametrize("options, message", [
    ({"page_size": 0}, "page_size"),
    ({"page_size": 2.0}, "page_size"),
    ({"page_size": 64, "kv_capacity": 32}, "holds no page"),
    ({"page_size": 16, "cache": "radix", "host_cache_tokens": 8}, "holds no page"),
])
def test_bad_page_sizes_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(SimBackend(), **options)


def test_a_request_needs_whole_pages_to_be_servable() -> None:
    """17 tokens in pages of 16 take two pages: a pool of one page cannot serve them."""
    engine = Engine(SimBackend(), kv_capacity=31, page_size=16)
    with pytest.raises(ValueError, match="could never be admitted"):
        engine.add_request(list(range(1, 15)), SamplingParams(3))
    engine.add_request(list(range(1, 14)), SamplingParams(3))  # 16 tokens: one page


def test_a_request_that_fits_in_one_page_is_admitted_under_the_budget_rule():
    """SGLang's budget rule counts a request's prompt and its new tokens together in whole
    pages: the new tokens fill the prompt's last page first. Rounding the two apart asked
    for two pages of a one-page pool, and the request waited forever on an idle engine."""
    for prompt, new in (([0], 1), ([0, 1, 2], 1), ([5, 6], 2)):
        engine = Engine(SimBackend(), kv_capacity=4, page_size=4)
        assert len(engine.generate([prompt], new)[0]) == new


def test_an_idle_engine_with_waiting_requests_raises_rather_than_returning_nothing(
        monkeypatch):
    """``generate`` never hands back an empty output for a request it never served: an
    admission rule that refuses a request on an empty pool is a bug, and it is reported."""
    from minisrv.scheduler.admission import BudgetAdmission

    monkeypatch.setattr(BudgetAdmission, "need", lambda self, req, fill: float("inf"))
    engine = Engine(SimBackend(), kv_capacity=8)
    with pytest.raises(RuntimeError, match="never admitted"):
        engine.generate([[0, 1]], 2)
    assert not engine.scheduler.queues.waiting  # withdrawn: the engine stays usable


def test_the_page_size_changes_only_while_every_page_is_free():
    allocator = SlotAllocator(16, page_size=1)
    allocator.set_page_size(4)
    slots = allocator.alloc(4)
    with pytest.raises(ValueError, match="no page is handed out"):
        allocator.set_page_size(8)
    allocator.free(slots)
    allocator.set_page_size(8)
    assert allocator.n_pages == 2 and allocator.free_count == 16
