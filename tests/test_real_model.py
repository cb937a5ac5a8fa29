"""The GPU appendix's runs: a tiny checkpoint written offline serves the same tokens through
the engine as alone and as ``transformers``; random models of a published shape; decode
timings and the roofline's predictions beside them (shapes of the results, never times)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from minisrv.configs import CITYLM, H200, SMOLLM2_135M, T4  # noqa: E402
from minisrv.engine import Engine  # noqa: E402
from minisrv.experiments.gpu import (
    DEMO_TEXT,
    RECORDED_STEP_OPS,
    current_gpu,
    device_label,
    engine_decode_throughput,
    predicted_decode_throughput,
    ragged_vs_padded,
    random_model,
    recorded_gpu_run,
    roofline_step_times,
    show_triton_kernel,
    step_time_sweep,
    write_tiny_llama,
)
from minisrv.model import HFTokenizer, load_model  # noqa: E402
from minisrv.sim.roofline import decode_step_time  # noqa: E402

TINY = CITYLM.with_(name="tiny", n_layers=2, max_seq_len=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_tiny_checkpoint_serves_hf_tokens_through_the_radix_engine(folder: Path) -> None:
    import transformers

    model, tok = load_model(folder, device="cpu")
    assert isinstance(tok, HFTokenizer) and model.eos_ids == (tok.eos_id,)
    system = "you are a helpful assistant that answers in short sentences ."
    questions = ["what is a kv cache ?", "why does a server batch requests ?",
                 "how fast is a gpu ?"]
    prompts = [tok.encode(f"{system} {q}") for q in questions]
    assert tok.decode(prompts[0]) == f"{system} {questions[0]}"
    engine = Engine(model, kv_capacity=300, max_running=2, cache="radix")
    out = engine.generate(prompts, max_new_tokens=12)
    assert engine.stats.cached_tokens > 0  # the shared system prompt was reused
    assert out == [model.reference_generate(p, 12) for p in prompts]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompts[0]])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                       do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[0] == want
    assert set(DEMO_TEXT.split()) <= set(tok.decode(list(range(4, tok.vocab_size))).split())


def test_random_model_has_the_shape_and_never_stops() -> None:
    model = random_model(TINY, "cpu", torch.float64, seed=1)
    assert model.config == TINY and model.dtype == torch.float64 and model.eos_ids == ()
    again = random_model(TINY, "cpu", torch.float64, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert len(model.reference_generate([1, 2, 3], 20)) == 20


def test_smollm2_shape_counts_its_parameters_on_the_meta_device() -> None:
    model = random_model(SMOLLM2_135M, "meta", torch.bfloat16)  # shapes only, no memory
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_135M.param_count


def test_step_time_sweep_and_roofline_tables() -> None:
    model = random_model(TINY, "cpu", torch.float32)
    measured = step_time_sweep(model, (1, 3), 4, ("padded", "flex"), repeats=1)
    assert list(measured["batch"]) == [1, 3, 1, 3]
    assert set(measured["device"]) == {"CPU"} and set(measured["dtype"]) == {"float32"}
    assert (measured["step_ms"] > 0).all()
    assert measured["us_per_token"].tolist() == pytest.approx(
        (measured["step_ms"] * 1e3 / measured["batch"]).tolist())
    roof = roofline_step_times(SMOLLM2_135M, [H200, T4], (1, 256), 512)
    assert list(roof["device"]) == ["H200 (roofline)"] * 2 + ["T4 (roofline)"] * 2
    assert roof["step_ms"].iloc[0] == pytest.approx(
        decode_step_time(SMOLLM2_135M, H200, 1, 512) * 1e3)
    assert set(roof["bound"]) <= {"memory", "compute"}


def test_engine_decode_throughput_counts_decode_steps_only() -> None:
    model = random_model(TINY, "cpu", torch.float32)
    run = engine_decode_throughput(model, 3, 5, 4, attention="padded")
    assert (run.device, run.attention, run.decode_tokens) == ("CPU", "padded", 3 * 3)
    assert run.decode_seconds > 0 and run.tokens_per_s > 0
    seconds = sum(decode_step_time(TINY, H200, 3, c) for c in (5, 6, 7))
    assert predicted_decode_throughput(TINY, H200, run) == pytest.approx(9 / seconds)
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        engine_decode_throughput(model, 1, 5, 1)


def test_device_labels() -> None:
    assert device_label("cpu") == "CPU"
    if not torch.cuda.is_available():
        assert current_gpu() is None


def test_ragged_and_padded_agree_on_a_mixed_step() -> None:
    model = random_model(TINY, "cpu", torch.float32)
    assert ragged_vs_padded(model, [(0, 20), (9, 1), (30, 1), (4, 6)]) < 1e-5


def test_the_recorded_h200_run_is_shipped_and_labelled() -> None:
    """The GPU appendix draws a recorded bench_gpu.py run: both attentions at every batch,
    each row naming the GPU and torch that produced it; an unknown run is named."""
    steps, engine = recorded_gpu_run("h200")
    assert set(steps["attention"]) == {"padded", "flex"}
    assert sorted(set(steps["batch"])) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert (steps["step_ms"] > 0).all() and set(steps["device"]) == {"NVIDIA H200"}
    assert steps["torch"].str.contains("cu").all()
    assert {"measured tok/s", "fraction"} <= set(engine.columns)
    with pytest.raises(ValueError, match="no recorded GPU run 'a100'.*'h200'"):
        recorded_gpu_run("a100")


COUNT_AT_COMMIT = """
import ast, collections, dataclasses, sys
from typing import Any
import torch
from torch.utils._python_dispatch import TorchDispatchMode
tree = ast.parse(open(sys.argv[1]).read())
keep = [n for n in tree.body if getattr(n, "name", None) in ("_storages", "OpCounter")]
scope = {"collections": collections, "Any": Any, "torch": torch,
         "TorchDispatchMode": TorchDispatchMode}
exec(compile(ast.Module(keep, []), "counter", "exec"), scope)
from minisrv.configs import SMOLLM2_135M
from minisrv.kvpool import KVPool
from minisrv.model import CityLM, FlatBatch
models = {}  # one per depth: building one (random weights) costs more than its steps
for layers, batch in ((1, 2), (2, 2), (1, 5)):
    if layers not in models:
        torch.manual_seed(0)
        models[layers] = CityLM(dataclasses.replace(SMOLLM2_135M, n_layers=layers),
                                eos_id=None).eval()
    model = models[layers]
    pool = KVPool.for_model(model, batch * 9)
    slots = [pool.alloc(9) for _ in range(batch)]
    ids = [[7] * 9 for _ in range(batch)]
    model.forward_flat(FlatBatch([i[:8] for i in ids], [s[:8] for s in slots]), pool,
                       attention="padded", last_only=True)
    def step():  # steptime.decode_step_seconds' timed step as it stood
        flat = FlatBatch([i[8:] for i in ids], [s[8:] for s in slots], model.device)
        model.forward_flat(flat, pool, attention="padded", last_only=True)
    with scope["OpCounter"]() as counter:
        step()
    print(counter.total)
"""


def test_the_recorded_runs_operator_count_is_its_commits(tmp_path: Path) -> None:
    """The appendix bounds the recorded run's launch cost by the operators its step
    dispatched; that count is recounted here from the code as it stood at the recorded
    commit (extracted with ``git archive``), with today's ``OpCounter``."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    ops = RECORDED_STEP_OPS
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the recorded commit cannot be read")
    archive = subprocess.run(["git", "-C", str(root), "archive", ops.commit, "minisrv"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {ops.commit} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    run = subprocess.run([sys.executable, "-c", COUNT_AT_COMMIT,
                          str(root / "tests" / "test_op_count.py")],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    one, two, wide = map(int, run.stdout.split())
    assert two - one == ops.per_layer
    assert wide - one == 3 * ops.per_request
    assert one == ops.total(1, 2)


def test_a_triton_kernel_is_shown_from_its_file_without_importing_triton() -> None:
    """The appendix shows the decode kernel where Triton may be missing: the text is the
    kernel's own, decorator to last line, and reading it imports nothing."""
    import sys

    loaded = "minisrv.runner.attention.triton_ops" in sys.modules
    code = show_triton_kernel("_decode_piece_kernel")
    lines = code.data.splitlines()
    assert lines[0] == "@triton.jit" and lines[1] == "def _decode_piece_kernel("
    assert "tl.store(Lse" in code.data and "_decode_merge_kernel" not in code.data
    assert ("minisrv.runner.attention.triton_ops" in sys.modules) == loaded
    with pytest.raises(ValueError, match="no function 'nothing'"):
        show_triton_kernel("nothing")
