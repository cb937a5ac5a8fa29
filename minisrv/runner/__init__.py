"""The model runner: what turns a scheduled batch into tokens on the device.

* ``model_runner.py``: ``ModelRunner`` (alias ``ModelBackend``): the KV pool on the device,
  a batch's entries as device tensors once per step, one flat forward, sampling;
  and ``StepInputs``, what a step hands the device;
* ``attention/``: the attention backends (padded, loop, flex, triton), one registry
  (``BACKENDS``) and the table ``"auto"`` reads, each backend with its metadata, its
  per-layer call and (padded, triton) its CUDA-graph hooks;
* ``table_batch.py``: ``TableBatch``, a step's batch read through the request-to-token table
  (the one batch type of the runner and its backends);
* ``speculative.py``: a step holding speculative checks, planned and verified;
* ``graph.py``: ``DecodeGraphs``: decode steps over static buffers padded to a batch
  bucket, replayed as CUDA graphs on a GPU;
* ``sampler.py``: ``Sampler``: per-request generators and the logits-processor hook;
* ``futures.py``: ``FutureMap``, the overlapped loop's device-side placeholders;
* ``device.py``: ``DeviceWorker``, the overlapped loop's device thread and CUDA stream;
* ``per_request.py``: ``PerRequestBackend``, one forward per request (the plain baseline).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that the overlapped loop (``device``, ``futures``) and an engine
# over the simulated GPU never load the model's modules (flex_attention pulls in dynamo).
_HOMES = {
    "AttentionBackend": "attention",
    "BACKENDS": "attention",
    "GraphHooks": "attention",
    "TritonAttention": "attention",
    "TableBatch": "table_batch",
    "FlexAttention": "attention",
    "HybridAttention": "attention",
    "LoopAttention": "attention",
    "PaddedAttention": "attention",
    "PaddedStep": "attention",
    "length_cuts": "attention",
    "make_attention": "attention",
    "padded_pool_attention": "attention",
    "write_kv": "attention",
    "DecodeGraphs": "graph",
    "PaddedDecode": "graph",
    "batch_buckets": "graph",
    "DeviceWorker": "device",
    "FutureMap": "futures",
    "ModelBackend": "model_runner",
    "ModelRunner": "model_runner",
    "StepInputs": "model_runner",
    "PerRequestBackend": "per_request",
    "LogitsProcessor": "sampler",
    "Sampler": "sampler",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"minisrv.runner.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'minisrv.runner' has no attribute {name!r}")
