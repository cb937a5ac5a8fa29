"""The future-token map: step i+1's inputs name step i's outputs before they exist, and
one ``torch.where`` on the device puts the real tokens in, whoever joins or leaves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisrv.runner.futures import FutureMap


def _token(rid: int, position: int) -> int:
    """The token request ``rid`` samples at ``position``: any deterministic function."""
    return (rid * 31 + position * 7) % 97


def test_reserve_store_resolve_by_hand() -> None:
    fm = FutureMap(4)
    first = fm.reserve(3)
    assert first.tolist() == [-1, -2, -3]
    fm.store(first, torch.tensor([10, 11, 12]))
    inputs = torch.tensor([-2, 5, -1, 0, -3])
    assert fm.resolve(inputs).tolist() == [11, 5, 10, 0, 12]
    assert fm.reserve(3).tolist() == [-4, -1, -2]  # round the ring
    assert inputs.tolist() == [-2, 5, -1, 0, -3]  # resolve does not write into its input


def test_reserve_ids_gives_the_same_ids_as_ints_and_store_takes_a_list() -> None:
    fm = FutureMap(4)
    fm.reserve(3)
    ids, as_ints = fm.reserve_ids(3)  # wraps round the ring
    assert ids.tolist() == as_ints == [-4, -1, -2]
    fm.store(ids, [7, 8, 9])
    assert fm.resolve(torch.tensor([-1, -2, -4, 3])).tolist() == [8, 9, 7, 3]
    assert fm.buffer.tolist() == [0, 8, 9, 0, 7]  # the device buffer itself holds them


@settings(max_examples=150, deadline=None)
@given(
    plan=st.lists(  # per step: which live requests step in, and how many new ones join
        st.tuples(st.lists(st.booleans(), min_size=8, max_size=8), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    )
)
def test_futures_resolve_while_requests_join_and_leave(plan) -> None:
    """A one-step-ahead loop: step i+1 is formed before step i's tokens reach the CPU.

    A request that computed in the previous step feeds its future id; one that sat the
    previous step out (or just joined) feeds a token the CPU already knows. The device
    resolves the inputs, checks them against the truth, and stores this step's samples.
    """
    max_batch = 8 + 3
    fm = FutureMap(2 * max_batch)
    outputs: dict[int, list[int]] = {}  # what the requests have really produced
    known: dict[int, int] = {}  # number of each request's tokens the CPU has seen
    previous: dict[int, int] = {}  # rid -> future id of its token from the previous step
    next_rid = 0
    for stay, joining in plan:
        live = sorted(outputs)
        batch = [rid for rid, keep in zip(live, stay) if keep]
        batch += list(range(next_rid, next_rid + joining))
        for rid in range(next_rid, next_rid + joining):
            outputs[rid], known[rid] = [_token(rid, 0)], 1  # its prompt's last token
        next_rid += joining
        inputs = []
        for rid in batch:
            if rid in previous:  # last step's token: not on the CPU yet
                inputs.append(previous[rid])
            else:
                assert known[rid] == len(outputs[rid])
                inputs.append(outputs[rid][-1])
        futures = fm.reserve(len(batch))
        # the device: resolve, check, sample, store
        resolved = fm.resolve(torch.tensor(inputs, dtype=torch.long)).tolist()
        assert resolved == [outputs[rid][-1] for rid in batch]
        sampled = [_token(rid, len(outputs[rid])) for rid in batch]
        fm.store(futures, torch.tensor(sampled, dtype=torch.long))
        # the CPU processes the previous step only now, then remembers this step's futures
        for rid in previous:
            known[rid] = len(outputs[rid])
        for rid, token in zip(batch, sampled):
            outputs[rid].append(token)
        previous = dict(zip(batch, futures.tolist()))
        for rid in [r for r in outputs if r not in previous and len(outputs[r]) > 6]:
            del outputs[rid], known[rid]  # finished: it leaves the loop


@pytest.mark.parametrize("capacity", [0, -1, 2.5, True])
def test_rejects_bad_capacity(capacity) -> None:
    with pytest.raises(ValueError, match="capacity"):
        FutureMap(capacity)


def test_rejects_bad_reservations_and_shapes() -> None:
    fm = FutureMap(4)
    with pytest.raises(ValueError, match="cannot reserve 5"):
        fm.reserve(5)
    with pytest.raises(ValueError, match="n must be"):
        fm.reserve(-1)
    assert fm.reserve(0).tolist() == []
    with pytest.raises(ValueError, match="future ids for"):
        fm.store(fm.reserve(2), torch.tensor([1, 2, 3]))
    assert fm.reserve(1).tolist() == [-3]  # a refused reservation took no slots
