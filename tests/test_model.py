"""CityLM: shapes and dtypes, KV-cache consistency, the reference decoder, shipped weights."""

from __future__ import annotations

import pytest
import torch

from minisrv.configs import CITYLM
from minisrv.model import CityLM, DenseKVCache
from minisrv.tokenizer import Tokenizer

TOK = Tokenizer()
SMALL = CITYLM.with_(name="small", n_layers=2, d_model=32, head_dim=8, d_ff=64, max_seq_len=64)


def random_model(dtype: torch.dtype = torch.float64, config=SMALL) -> CityLM:
    """A seeded random model; weights larger than the default init keep it far from uniform."""
    torch.manual_seed(0)
    model = CityLM(config)
    model.reset_parameters(std=0.3)
    return model.to(dtype).eval()


def naive_greedy(model: CityLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence at every step, with no cache."""
    seq, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            token = int(model(torch.tensor(seq))[-1].argmax())
            out.append(token)
            seq.append(token)
            if token == model.eos_id:
                break
    return out


def test_forward_shape_and_default_dtype() -> None:
    model = CityLM(SMALL)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    logits = model(torch.tensor(TOK.encode("FR: Paris")))
    assert logits.shape == (10, SMALL.vocab_size) and logits.dtype == torch.float32


def test_float64_model_computes_in_float64() -> None:
    model = random_model(torch.float64)
    assert model.dtype == torch.float64
    assert model(torch.tensor(TOK.encode("DE:"))).dtype == torch.float64


def test_float32_and_float64_agree() -> None:
    ids = torch.tensor(TOK.encode("JP: Tokyo, Yokohama"))
    lo = random_model(torch.float32)(ids)
    hi = random_model(torch.float64)(ids)
    assert torch.allclose(lo.double(), hi, atol=1e-4)


def test_citylm_parameter_count_matches_config() -> None:
    model = CityLM()
    assert sum(p.numel() for p in model.parameters()) == CITYLM.param_count


@pytest.mark.parametrize("splits", [[1] * 13, [5, 1, 1, 6], [12, 1], [3, 4, 6]])
def test_cached_chunks_equal_one_full_forward(splits: list[int]) -> None:
    model = random_model(torch.float64)
    ids = torch.tensor(TOK.encode("US: New York"))
    assert sum(splits) == len(ids)
    with torch.no_grad():
        full = model(ids)
        cache, chunks, start = model.new_cache(), [], 0
        for n in splits:
            chunks.append(model(ids[start : start + n], cache))
            start += n
            assert len(cache) == start
    assert torch.max(torch.abs(torch.cat(chunks) - full)) < 1e-12


def test_cache_stores_kv_heads_only() -> None:
    model = random_model()
    cache = model.new_cache()
    assert isinstance(cache, DenseKVCache) and len(cache) == 0
    with torch.no_grad():
        model(torch.tensor(TOK.encode("IT:")), cache)
    assert cache.keys[0].shape == (4, SMALL.n_kv_heads, SMALL.head_dim)
    assert cache.nbytes == 2 * SMALL.n_layers * 4 * SMALL.n_kv_heads * SMALL.head_dim * 8


def test_reference_generate_equals_full_recompute_greedy() -> None:
    model = random_model()
    prompt = TOK.encode("ES: Madrid, ")
    expected = naive_greedy(model, prompt, 30)
    assert model.reference_generate(prompt, 30) == expected


def test_reference_generate_is_deterministic() -> None:
    model = random_model(torch.float32)
    prompt = TOK.encode("CN:")
    assert model.reference_generate(prompt, 20) == model.reference_generate(prompt, 20)


def test_sampling_is_reproducible_per_seed() -> None:
    model = random_model(torch.float32)
    prompt = TOK.encode("BR:")

    def run(seed: int) -> list[int]:
        return model.reference_generate(prompt, 30, temperature=1.0, top_p=0.95, seed=seed)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_eos_stops_generation_unless_ignored() -> None:
    model = random_model()
    prompt = TOK.encode("GB:")
    free_run = model.reference_generate(prompt, 20, ignore_eos=True)
    stop = free_run[3]
    model.eos_id = stop  # pretend the 4th generated token is end-of-sequence
    first = free_run.index(stop)
    assert model.reference_generate(prompt, 20) == free_run[: first + 1]
    assert model.reference_generate(prompt, 20, ignore_eos=True) == free_run


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": [0], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_ids": [], "max_new_tokens": 4}, "prompt_ids is empty"),
        ({"prompt_ids": [0] * 60, "max_new_tokens": 5}, "exceeds max_seq_len=64"),
        ({"prompt_ids": [0], "max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"prompt_ids": [0], "max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"prompt_ids": [0, 999], "max_new_tokens": 4}, "token id 999"),
    ],
)
def test_reference_generate_rejects_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        random_model().reference_generate(**kwargs)


def test_forward_rejects_bad_ids_and_overflow_without_touching_the_cache() -> None:
    model = random_model()
    cache = model.new_cache()
    model(torch.zeros(60, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="60 cached \\+ 5 new tokens exceeds max_seq_len=64"):
        model(torch.zeros(5, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(0, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([-1]), cache)
    assert len(cache) == 60


def test_model_needs_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        CityLM(SMALL.with_(vocab_size=0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu() -> None:
    cpu = random_model(torch.float64)
    gpu = random_model(torch.float64).to("cuda")
    ids = torch.tensor(TOK.encode("FR: Paris, Lyon"))
    assert gpu.device.type == "cuda"
    assert torch.allclose(gpu(ids).cpu(), cpu(ids), atol=1e-10)
    prompt = TOK.encode("FR:")
    assert gpu.reference_generate(prompt, 20) == cpu.reference_generate(prompt, 20)
    sampled = {"temperature": 1.0, "seed": 3}
    assert gpu.reference_generate(prompt, 20, **sampled) == cpu.reference_generate(
        prompt, 20, **sampled
    )


# ----------------------------------------------------------------------------- shipped model


def test_shipped_model_loads_in_eval_mode_on_cpu(citylm) -> None:
    model, tok = citylm
    assert not model.training and model.device.type == "cpu" and model.dtype == torch.float32
    assert model.config.vocab_size == tok.vocab_size and model.eos_id == tok.eos_id


@pytest.mark.parametrize(
    ("code", "first_city"), [("FR", "Paris"), ("DE", "Berlin"), ("JP", "Tokyo"), ("US", "New York")]
)
def test_shipped_model_knows_the_largest_city(citylm, code: str, first_city: str) -> None:
    model, tok = citylm
    text = tok.decode(model.reference_generate(tok.encode(f"{code}:"), 12))
    assert text.startswith(f" {first_city}")


def test_shipped_model_continues_a_line_in_order(citylm) -> None:
    from minisrv.train.data import country_line

    model, tok = citylm
    prompt = tok.encode(country_line("FR", 2) + ",")
    expected = country_line("FR", 4)[len(country_line("FR", 2)) + 1 :]
    assert tok.decode(model.reference_generate(prompt, len(expected))) == expected
