# Two commands set everything up on a fresh machine:
#   make book   build the HTML book into _build/html, executing every chapter fresh
#   make test   ruff, unit and property tests, and nbval over every chapter (on every core)
#   make colab-check every chapter executed as on Colab: a fresh venv with only torch, each
#                    chapter's own setup cell pointed at this checkout (minutes; CI runs it)
#   make gpu-check   on a CUDA machine: the engine/model tests on cpu and cuda, and every
#                    chapter executed under nbval with MINISRV_DEVICE=cuda, outputs not
#                    compared (tests/nbval_execute_only.py; fails without a GPU)
#   make gpu-bench   on a CUDA machine: benchmarks/bench_gpu.py --quick, then the full run,
#                    CSVs to minisrv/measured/ (exits 1 without a GPU); gpu-bench-quick: --quick only
# Each creates .venv (or uses VENV=$$CONDA_PREFIX for the conda route) and installs what it needs.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.minisrv-installed
export PATH := $(abspath $(BIN)):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Setup installs without byte-compiling (below): Python compiles what a run imports, once, and
# keeps it, unless the environment forbids writing bytecode. Where it does (this machine's
# shell sets PYTHONDONTWRITEBYTECODE=1), every process of a run (notebook kernels, servers,
# their workers) compiled torch, pandas and matplotlib again: 4.0 s to import them instead of
# 2.4 s, and a fresh make test took 673 s. The venv is make's own: its bytecode is kept.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: book test colab-check gpu-check gpu-bench gpu-bench-quick setup dot chromium clean

# The tests that run the model and the engine on every device of available_devices() (the
# conftest `model` fixture and DEVICES lists): cpu, and cuda where a GPU is visible.
GPU_TESTS := tests/test_flex_attention.py tests/test_device.py tests/test_backends.py \
	tests/test_engine.py tests/test_engine_radix.py tests/test_admission.py \
	tests/test_overlap.py tests/test_overlap_loop.py tests/test_overlap_viz.py \
	tests/test_triton_ops.py tests/test_triton_compile.py tests/test_table.py

# The chapters without wall-clock verdicts are executed first, one kernel per core with one
# torch thread each, into the execution cache (_ext/execute_chapters.py); the build then finds
# them there and executes the timed chapters itself, alone. At the end, each chapter's
# execution time from jupyter-cache (also when the build failed).
book: setup
	rm -rf _build/.jupyter_cache _build/html _build/jupyter_execute
	OMP_NUM_THREADS=1 $(BIN)/python _ext/execute_chapters.py _build/.jupyter_cache \
	  $(OTHER_CHAPTERS) && $(BIN)/jupyter-book build -W -n --keep-going . ; status=$$?; \
	$(BIN)/python _ext/execution_times.py _build/.jupyter_cache; exit $$status

# Chapters whose printed verdicts come from wall-clock runs (the overlapped loop's measured
# gain, the paced server's spreads): they run alone, after everything else, with every core free.
TIMED_CHAPTERS := chapters/07_overlap.ipynb chapters/08_server.ipynb
OTHER_CHAPTERS := $(filter-out $(TIMED_CHAPTERS),$(wildcard chapters/*.ipynb))

test: setup
	$(BIN)/ruff check .
	@# One torch thread per worker: two workers of two threads each on two cores run slower
	@# than one worker alone (threads spin while they wait for each other). The longest
	@# files go first (tests/conftest.py, LONGEST_FIRST), and the short test files then fill
	@# the workers' ends, where a long file drawn last would leave the other worker idle.
	@# The Triton kernels on the CPU run under the interpreter, which must be on before triton
	@# is first imported: their own invocation (compiled, on CUDA tensors, where a GPU is seen),
	@# one process beside the workers, where it takes the time they leave the cores idle (servers
	@# starting, timeouts awaited: niced, so it takes no other); its report follows theirs, and
	@# either failing fails.
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 nice -n 15 $(BIN)/python -m pytest -p no:xdist -q \
	  tests/test_triton_ops.py > .triton-tests.log 2>&1 & triton=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder \
	  $(OTHER_CHAPTERS) tests \
	  --ignore=tests/test_triton_ops.py; status=$$?; \
	wait $$triton; triton_status=$$?; echo "tests/test_triton_ops.py, interpreted:"; \
	cat .triton-tests.log; rm -f .triton-tests.log; \
	[ $$status = 0 ] && [ $$triton_status = 0 ]
	@# The timed chapters compare wall-clock runs (a bench's median gap against one streamed
	@# request's), so one stall of a shared machine can fail a comparison that holds on every
	@# other run (08 failed so once on a quiet fresh clone): they get one more run, whole, and
	@# fail only if that fails too. A real regression fails both.
	$(BIN)/python -m pytest $(TIMED_CHAPTERS) || { echo "timed chapters: run again"; \
	  $(BIN)/python -m pytest $(TIMED_CHAPTERS); }

colab-check: setup
	MINISRV_COLAB_CHECK=1 MINISRV_TIMED_CHAPTERS="$(TIMED_CHAPTERS)" $(BIN)/python -m pytest \
	  tests/test_colab.py

# Refuses to run (exit 1) where torch sees no CUDA GPU: a CPU-only pass would prove nothing.
gpu-check: setup
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
	  echo "error: make gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False" \
	       "(torch $$($(BIN)/python -c 'import torch; print(torch.__version__)'))." >&2; exit 1; }
	MINISRV_DEVICE=cuda $(BIN)/python -m pytest -p tests.nbval_execute_only $(GPU_TESTS) chapters/

# bench_gpu.py itself refuses (exit 1, with the reason) where torch sees no CUDA GPU.
gpu-bench-quick: setup
	$(BIN)/python benchmarks/bench_gpu.py --quick

gpu-bench: gpu-bench-quick
	$(BIN)/python benchmarks/bench_gpu.py

setup: $(STAMP) dot chromium

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# --no-compile: byte-compiling every installed module (torch alone is thousands) took about
	@# 40 s of a fresh setup; Python compiles the modules a run imports, once, when it imports them.
	$(BIN)/python -m pip install -q --no-compile --upgrade pip
	@# Colab and conda bring their own torch; only a bare environment gets the CPU wheel, in the
	@# same install as the package (one resolve).
	torch=$$($(BIN)/python -c "import torch" 2>/dev/null || echo torch==2.13.0); \
	$(BIN)/python -m pip install -q --no-compile $$torch -e ".[book,test,train]"
	touch $@

# The graphviz `dot` binary draws the architecture and radix-tree figures.
dot:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq graphviz; \
	  else \
	    echo "error: the graphviz 'dot' binary is missing. Install it with" \
	         "'sudo apt-get install graphviz', 'brew install graphviz', or" \
	         "'conda install -c conda-forge graphviz'." >&2; exit 1; \
	  fi; }

# Chromium opens the built explorers in tests/test_explorers.py (driven by the playwright client,
# never by a browser playwright downloads).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq chromium; \
	  else \
	    echo "error: the chromium browser is missing (the explorer tests open the pages in it)." \
	         "Install it with 'sudo apt-get install chromium', or set MINISRV_CHROMIUM to a" \
	         "Chromium binary." >&2; exit 1; \
	  fi; }

clean:
	rm -rf _build .pytest_cache .hypothesis
