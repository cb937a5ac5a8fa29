#!/usr/bin/env bash
# One lent GPU machine's run (issue 39): the GPU and kernel tests, then bench_gpu.py --quick,
# within 6 minutes; the full bench only if at least 8 minutes of GPU time remain after that.
#
#   GPU_SECONDS=<device seconds left> OUT=<folder to bring back> bash benchmarks/gpu_run.sh
#
# The machine has no network: nothing is installed from an index. It uses its own python3
# (3.12, torch 2.11, triton 3.6, transformers, pytest, hypothesis) with PYTHONPATH=.; cp312
# wheels of what the tests import and it lacks may be carried in $WHEELS (installed with
# --no-index into .gpu_site). No chapter runs here. CSVs go to $OUT/measured (or
# minisrv/measured/), each step's log to $OUT.
set -u
start=$(date +%s)
budget=${GPU_SECONDS:-900}
out=${OUT:-gpu_out}
mkdir -p "$out/measured"
export PYTHONPATH=.
export PYTHONDONTWRITEBYTECODE=1
left() { echo $(( budget - ($(date +%s) - start) )); }
quick_end() { echo $(( 360 - ($(date +%s) - start) )); }  # seconds left of the 6 minutes

if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .gpu_site "$WHEELS"/*.whl
  export PYTHONPATH=.:.gpu_site
fi
python3 - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda",
      torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available()
      else "none")
for name in ("triton", "transformers", "pandas", "pytest", "hypothesis", "numpy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "MISSING")
PY
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "error: no CUDA GPU visible; nothing to measure" >&2; exit 1; }

# 1. Tests on the GPU, compiled: the Triton kernels and backend (CUDA tensors, bf16 too),
#    their compilation, the graph buffers, and the engine/model tests on cuda. The project's
#    pytest addopts name nbval, which this machine need not have: replaced here.
tests="tests/test_triton_ops.py tests/test_triton_compile.py tests/test_choice.py \
tests/test_graph.py tests/test_table.py tests/test_device.py tests/test_backends.py tests/test_engine.py"
timeout $(( $(quick_end) - 200 )) python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  $tests 2>&1 | tee "$out/tests.log" | tail -20
echo "tests exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"

# 2. The quick bench in what is left of the 6 minutes (at least 150 s).
quick=$(quick_end); [ "$quick" -lt 150 ] && quick=150
timeout "$quick" python3 benchmarks/bench_gpu.py --quick --out "$out/measured" 2>&1 \
  | tee "$out/bench_quick.log"
echo "quick bench exit ${PIPESTATUS[0]}" | tee -a "$out/bench_quick.log"

# 3. The full bench only with >= 8 minutes of GPU time left (stopped a minute before the end).
if [ "$(left)" -ge 480 ]; then
  timeout $(( $(left) - 60 )) python3 benchmarks/bench_gpu.py --out "$out/measured" 2>&1 \
    | tee "$out/bench_full.log"
  echo "full bench exit ${PIPESTATUS[0]}" | tee -a "$out/bench_full.log"
else
  echo "full bench skipped: $(left) s of GPU time left (< 480)" | tee "$out/bench_full.log"
fi
