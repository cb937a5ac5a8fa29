"""The Triton kernels compile for the GPUs the book meets, without one: each kernel of
``minisrv.runner.attention.triton_ops`` through Triton's front end and the ``ptxas`` its
wheel ships, to a cubin for compute capability 7.5 (the T4, float16), 8.0 and 9.0 (bfloat16).

The interpreter tests (``tests/test_triton_ops.py``) check the numbers; this checks what
the interpreter never sees: that the kernels type-check and lower for real targets under the
installed Triton (3.9 here, 3.6 on the GPU machine: both compiled every kernel when this was
written). Runs in the main pytest invocation, where triton is imported compiled.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from minisrv.runner.attention import triton_ops as ops  # noqa: E402

if ops.INTERPRETED:
    pytest.skip("the kernels were imported under the interpreter", allow_module_level=True)

INTS = ("Table", "Rows", "Contexts", "Splits", "News", "Starts")


def kernels(dtype: str, capability: int) -> dict:
    """Each kernel with its pointer types and the constants the launchers give it for
    SmolLM2's heads (64 wide, 3 query heads per KV head)."""
    precision = "ieee" if dtype == "fp32" else "tf32"
    block_m, block_n = (128, 64) if capability >= 90 else (128, 128) if capability >= 80 \
        else (64, 64)
    return {
        ops._decode_piece_kernel: dict(GROUP=3, BLOCK_H=16, HEAD_DIM=64, BLOCK_D=64,
                                       BLOCK_N=ops.DECODE_BLOCK_N, PRECISION=precision),
        ops._decode_merge_kernel: dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_N=ops.DECODE_BLOCK_N),
        ops._extend_kernel: dict(GROUP=3, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=block_m,
                                 BLOCK_N=block_n, PRECISION=precision),
        ops._write_kernel: dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_T=ops.WRITE_BLOCK_T),
    }


def signature(fn, constants: dict, dtype: str) -> dict[str, str]:
    """Triton's type string per argument: int32 tables and vectors, float32 scratch, the
    model's dtype for queries, keys, values and outputs, int32 strides."""
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in INTS:
            types[name] = "*i32"
        elif name in ("Mid", "Lse"):
            types[name] = "*fp32"
        elif name == "sm_scale":
            types[name] = "fp32"
        elif name[0].isupper():
            types[name] = f"*{dtype}"
        else:
            types[name] = "i32"
    return types


@pytest.mark.parametrize("capability,dtype", [(75, "fp16"), (80, "bf16"), (90, "bf16")])
def test_every_kernel_compiles_to_a_cubin(capability, dtype) -> None:
    target = GPUTarget("cuda", capability, 32)
    for fn, constants in kernels(dtype, capability).items():
        source = ASTSource(fn, signature(fn, constants, dtype), constants)
        compiled = triton.compile(source, target=target, options={"num_warps": 4})
        assert len(compiled.asm["cubin"]) > 1000, fn.__name__


def test_the_backend_refuses_the_cpu_without_the_interpreter() -> None:
    """Compiled kernels cannot take CPU tensors: asking for them there says what to do."""
    import torch

    from minisrv.runner.attention import make_attention

    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention("triton", torch.device("cpu"), torch.float32, 32)
