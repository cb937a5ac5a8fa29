"""``load_model``: the shipped CityLM by name, or a local HF Llama checkpoint folder with its
tokenizer, generating exactly what ``transformers`` generates. Offline: the checkpoint is a
random tiny Llama and a word-level tokenizer built with the ``tokenizers`` library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import minisrv  # noqa: E402
from minisrv.model import HFTokenizer, default_dtype, load_model  # noqa: E402
from minisrv.tokenizer import Tokenizer  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [f"w{i}" for i in range(len(SPECIALS), 50)]
PAD, BOS, EOS = 0, 1, 2
PROMPT = "w5 w9 w13 w7"


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whitespace-split words, one id each, with ``<s>`` put before every text."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )


def tiny_llama(eos: int | list[int]) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, bos_token_id=BOS, eos_token_id=eos, pad_token_id=PAD,
    )
    return transformers.LlamaForCausalLM(config).eval()


def hf_greedy(hf: transformers.LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A saved tiny Llama whose greedy output hits its SECOND eos id, and that id.

    The second stop id is chosen as a token the free-running model emits mid-way, so a
    loader that kept only the first eos id would generate past it and fail the test.
    """
    prompt = word_tokenizer().encode(PROMPT)
    free_run = hf_greedy(tiny_llama(EOS), prompt, 30)
    second = next(t for t in free_run[5:] if t not in free_run[:5] and t != EOS)
    assert EOS not in free_run[: free_run.index(second) + 1]
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama([EOS, second]).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder, second


def test_folder_gives_hf_greedy_output(checkpoint: tuple[Path, int]) -> None:
    folder, second = checkpoint
    model, tok = load_model(folder, device="cpu")
    assert isinstance(tok, HFTokenizer) and model.dtype == torch.float32
    assert model.eos_ids == (EOS, second) and tok.eos_ids == (EOS, second)
    prompt = tok.encode(PROMPT)
    assert prompt == [BOS, 5, 9, 13, 7] and tok.encode(PROMPT, bos=False) == prompt[1:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = hf_greedy(hf, prompt, 30)
    got = model.reference_generate(prompt, 30)
    assert got == expected and got[-1] == second  # stopped on the second eos id
    assert tok.decode(prompt) == PROMPT
    assert tok.decode(prompt, skip_special=False) == "<s> " + PROMPT


def test_tokenizer_interface(checkpoint: tuple[Path, int]) -> None:
    tok = HFTokenizer.from_folder(checkpoint[0])
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (BOS, EOS, 50)
    assert tok.id_to_str(9) == "w9"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_str(50)


def test_dtype_is_kept_when_given(checkpoint: tuple[Path, int]) -> None:
    model, _ = load_model(str(checkpoint[0]), device="cpu", dtype=torch.float64)
    assert model.dtype == torch.float64 and model.inv_freq.dtype == torch.float32


def test_citylm_by_name_is_the_shipped_model() -> None:
    model, tok = minisrv.load_model("citylm", device="cpu")
    assert isinstance(tok, Tokenizer) and model.dtype == torch.float32
    shipped, _ = minisrv.load_citylm("cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), shipped.parameters()))


def test_unknown_name_is_refused_without_downloading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'citylm' or a local folder"):
        load_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_default_dtype() -> None:
    assert default_dtype(torch.device("cpu")) == torch.float32
    if torch.cuda.is_available():
        assert default_dtype(torch.device("cuda")) in (torch.bfloat16, torch.float16)


def test_a_byte_level_bpe_folder_with_tied_embeddings_generates_as_transformers(
        tmp_path: Path) -> None:
    """SmolLM2's kind of checkpoint (the GPU appendix offers it on Colab): a byte-level BPE
    tokenizer, as GPT-2's, and an output layer tied to the embedding. Trained and saved here,
    offline; ``load_model`` reads it, round-trips text and generates what transformers does."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    text = ["a server batches requests, and a cache keeps their keys and values"] * 20
    raw.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    tok_hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    eos = tok_hf.eos_token_id
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp_path)
    tok_hf.save_pretrained(tmp_path)
    model, tok = load_model(tmp_path, device="cpu")
    assert model.config.tie_embeddings and model.lm_head.weight is model.embed.weight
    words = "a cache keeps keys, batches requests"
    ids = tok.encode(words, bos=False)
    assert ids == tok_hf.encode(words) and tok.decode(ids) == words
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.reference_generate(ids, 12) == hf_greedy(hf, ids, 12)[:12]
