"""The host tier's memory: token slots in CPU memory, and the copies between the two pools.

A GPU's KV pool is a fraction of what a multi-turn workload would like to keep; the
machine's CPU memory is often ten times larger. SGLang's HiCache and LMCache therefore copy
evicted prefixes to host memory instead of dropping them, and copy them back over PCIe when
a later request matches them: a copy of ``n`` tokens costs ``n`` x bytes per token over a
link of some 55 GB/s, usually far less than the prefill that would recompute them.

``HostPool`` is that second pool: ``capacity`` token slots with their own ``SlotAllocator``
(in pages of the device's ``page_size``: the tree backs up and loads back whole pages)
and, next to a real model's ``KVPool``, a tensor of the same layout (pinned memory on CUDA,
so copies can run on a copy stream; pageable memory, with one warning, where pinning fails).
A simulated GPU has no tensors: the pool then counts slots only, as the device pool does.

The tree (``minisrv.kv.hiradix``) decides what to copy; the copies themselves are queued in
a ``CopyPlan`` and run as ONE batched copy per direction, right before the step that reads
them (``HostPool.run``): first device -> host (backups, reading KV already computed), then
host -> device (load-backs, into slots allocated for the request). That order makes a slot
freed and reused within the same step safe: it is read before it is overwritten.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from minisrv.checks import check_int
from minisrv.core import Backend, Capability, HostTimedBackend, PoolBackend
from minisrv.kv.allocator import SlotAllocator, slot_count

__all__ = ["HOST_POLICIES", "CopyPlan", "CopyListener", "HostPool", "make_host_pool"]

CopyListener = Callable[[int, int], None]
"""Told, before each step, how many tokens that step loads back and backs up."""

HOST_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
"""When a node's KV gets its host copy (SGLang's ``--hicache-write-policy``): as soon as it
is cached, once it has been hit twice, or only when the device evicts it."""


@dataclass
class CopyPlan:
    """The copies queued since the last step, as (source slots, destination slots) runs."""

    backups: list[tuple[list[int], list[int]]] = field(default_factory=list)  # device -> host
    loads: list[tuple[list[int], list[int]]] = field(default_factory=list)  # host -> device

    @property
    def backed_up(self) -> int:
        """Tokens copied to the host by this plan."""
        return sum(len(dst) for _, dst in self.backups)

    @property
    def loaded(self) -> int:
        """Tokens copied back to the device by this plan."""
        return sum(len(dst) for _, dst in self.loads)

    def __bool__(self) -> bool:
        return bool(self.backups or self.loads)


class HostPool:
    """``capacity`` host token slots, and their tensor when the device pool has one.

    ``like`` is the device's ``KVPool`` (``None``: a simulated GPU or a standalone tree,
    slots counted only). The host tensor has the device pool's layout [layers, slots, 2,
    kv_heads, head_dim] and dtype, in pinned memory when the device is a GPU.
    """

    def __init__(self, capacity: int, like: Any = None,
                 on_copy: CopyListener | None = None, page_size: int = 1) -> None:
        check_int("host_cache_tokens", capacity, minimum=1)
        self.on_copy = on_copy
        self.allocator = SlotAllocator(capacity, page_size)  # the tree backs up whole pages
        self.device_pool = like
        self.kv = None if like is None else _host_tensor(like.kv, capacity)
        self.pinned = self.kv is not None and self.kv.is_pinned()
        self.plan = CopyPlan()
        self._stream: Any = None  # the CUDA copy stream, made on first use

    capacity = slot_count("capacity", "Host token slots.")
    free_count = slot_count("free_count", "Host slots free right now.")
    used_count = slot_count("used_count", "Host slots holding a node's copy.")

    def backup(self, device_slots: list[int], host_slots: list[int]) -> None:
        """Queue the copy of ``device_slots``' KV into ``host_slots``."""
        self.plan.backups.append((list(device_slots), list(host_slots)))

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Queue the copy of ``host_slots``' KV back into ``device_slots``."""
        self.plan.loads.append((list(host_slots), list(device_slots)))

    def take(self) -> CopyPlan:
        """The copies queued for the next step (the queue starts again empty); a simulated
        GPU is told their sizes here (``on_copy``), before it times that step."""
        plan, self.plan = self.plan, CopyPlan()
        if self.on_copy is not None and plan:
            self.on_copy(plan.loaded, plan.backed_up)
        return plan

    def copy(self, plan: CopyPlan) -> None:
        """Run ``plan``: backups first, then loads, one batched copy each (nothing to do
        without tensors)."""
        if self.kv is None or not plan:
            return
        import torch

        device_kv, host_kv = self.device_pool.kv, self.kv
        stream = self._copy_stream(device_kv.device)
        for pairs, to_host in ((plan.backups, True), (plan.loads, False)):
            src, dst = _runs(pairs)
            if not len(src):
                continue
            if to_host:
                index = torch.from_numpy(src).to(device_kv.device)
                host_kv[:, torch.from_numpy(dst)] = _on(stream, device_kv,
                                                         lambda i=index: device_kv[:, i].cpu())
            else:
                rows = host_kv[:, torch.from_numpy(src)]
                if stream is None:
                    device_kv[:, torch.from_numpy(dst).to(device_kv.device)] = rows
                else:  # on the copy stream, after the steps queued so far: a slot freed
                    # at once (the overlapped loop) may still be written by the step in flight;
                    # the next step's stream waits for the copy below
                    stream.wait_stream(torch.cuda.current_stream(device_kv.device))
                    with torch.cuda.stream(stream):
                        index = torch.from_numpy(dst).to(device_kv.device, non_blocking=True)
                        device_kv[:, index] = rows.pin_memory().to(device_kv.device,
                                                                   non_blocking=True)
        if stream is not None:  # the next step (default stream, or one waiting on it) reads it
            torch.cuda.current_stream(device_kv.device).wait_stream(stream)

    def _copy_stream(self, device: Any) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def __repr__(self) -> str:
        where = "no tensor" if self.kv is None else ("pinned" if self.pinned else "pageable")
        return f"HostPool(capacity={self.capacity}, used={self.used_count}, {where})"


def _runs(pairs: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """All runs as one (source, destination) index pair; where a destination slot is named
    twice (freed and reused between two steps) the later copy wins, as it would in order."""
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    src = np.concatenate([np.asarray(s, np.int64) for s, _ in pairs])
    dst = np.concatenate([np.asarray(d, np.int64) for _, d in pairs])
    _, last = np.unique(dst[::-1], return_index=True)
    keep = np.sort(len(dst) - 1 - last)
    return src[keep], dst[keep]


def _on(stream: Any, device_kv: Any, copy: Any) -> Any:
    """``copy()`` on ``stream`` after the work queued so far (the KV it reads), or here."""
    if stream is None:
        return copy()
    import torch

    stream.wait_stream(torch.cuda.current_stream(device_kv.device))
    with torch.cuda.stream(stream):
        return copy()


def _host_tensor(device_kv: Any, capacity: int) -> Any:
    """Host slots shaped like ``device_kv``'s: pinned next to a GPU, pageable (one warning)
    where pinning fails."""
    import torch

    shape = (device_kv.shape[0], capacity, *device_kv.shape[2:])
    if device_kv.device.type == "cuda":
        try:
            return torch.zeros(shape, dtype=device_kv.dtype, pin_memory=True)
        except RuntimeError as exc:
            warnings.warn(f"host tier: pinned memory for {capacity} tokens failed ({exc}); "
                          "using pageable memory, whose copies cannot overlap a step",
                          RuntimeWarning, stacklevel=3)
    return torch.zeros(shape, dtype=device_kv.dtype)


def make_host_pool(config: Any, backend: Backend) -> HostPool | None:
    """The host tier ``config.host_cache_tokens`` asks for (``None`` for 0), shaped like the
    backend's KV pool. Two capabilities the backend declares shape it: ``LENDS_KV_POOL``,
    its ``pool`` is the device ``KVPool`` whose tensors the copies move (a
    ``ModelRunner``'s), and ``TIMES_HOST_COPIES``, its ``charge_host_copies(loaded,
    backed_up)`` puts each step's copies on its clock (``SimBackend``)."""
    if not config.host_cache_tokens:
        return None
    declared = backend.capabilities
    like = (cast(PoolBackend, backend).pool
            if Capability.LENDS_KV_POOL in declared else None)
    on_copy = (cast(HostTimedBackend, backend).charge_host_copies
               if Capability.TIMES_HOST_COPIES in declared else None)
    return HostPool(config.host_cache_tokens, like=like, on_copy=on_copy,
                    page_size=config.page_size)
