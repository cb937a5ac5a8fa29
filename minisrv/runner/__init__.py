"""The model runner: what turns a scheduled batch into tokens on the device.

* ``model_runner.py``: ``ModelRunner`` (alias ``ModelBackend``): the KV pool on the device,
  a batch's entries as device tensors once per step, one flat forward, sampling;
* ``attention.py``: the attention backends (loop, padded, flex) behind one interface;
* ``sampler.py``: ``Sampler``: per-request generators and the logits-processor hook;
* ``futures.py``: ``FutureMap``, the overlapped loop's device-side placeholders;
* ``device.py``: ``DeviceWorker``, the overlapped loop's device thread and CUDA stream;
* ``per_request.py``: ``PerRequestBackend``, one forward per request (the plain baseline).
"""

from minisrv.runner.attention import (
    AttentionBackend,
    FlexAttention,
    LoopAttention,
    PaddedAttention,
    make_attention,
)
from minisrv.runner.futures import FutureMap
from minisrv.runner.model_runner import ModelBackend, ModelRunner, StepInputs
from minisrv.runner.per_request import PerRequestBackend
from minisrv.runner.sampler import LogitsProcessor, Sampler

__all__ = [
    "AttentionBackend",
    "FlexAttention",
    "FutureMap",
    "LogitsProcessor",
    "LoopAttention",
    "ModelBackend",
    "ModelRunner",
    "PaddedAttention",
    "PerRequestBackend",
    "Sampler",
    "StepInputs",
    "make_attention",
]
