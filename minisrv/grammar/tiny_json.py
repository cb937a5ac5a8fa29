"""An offline Hugging Face Llama folder whose byte-level BPE tokenizer can spell JSON.

CityLM cannot write a brace or a digit, so JSON schemas are shown on a tiny random Llama
checkpoint. Its tokenizer is a byte-level BPE (GPT-2 style, every one of the 256 bytes a
token) trained in a fraction of a second on a few JSON records, so it has multi-character
tokens such as ``"city"`` and can spell any text. Needs the ``hf`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minisrv.model.hf import save_hf_folder

SPECIALS = ("<pad>", "<s>", "</s>")
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Accra")


def json_corpus() -> list[str]:
    """The BPE's training texts: JSON records of cities and ranks, compact and spaced."""
    records = [{"city": c, "rank": r, "country": c[:2].upper()}
               for r, c in enumerate(CITIES, 1)]
    texts = [json.dumps(r) for r in records] + [json.dumps(r, separators=(",", ":"))
                                                for r in records]
    return texts + [json.dumps(records[:3]), json.dumps({"cities": list(CITIES)})]


def write_json_llama(folder: str | Path, *, seed: int = 0, vocab_size: int = 400,
                     hidden: int = 64, layers: int = 2, max_positions: int = 512) -> Path:
    """Save a random tiny Llama and its byte-level BPE tokenizer to ``folder``; return it.

    ``</s>`` is the eos id; ``<s>`` goes before every text. The weights are random
    (``initializer_range`` 0.1), so what the model writes is decided by the grammar's mask
    and the random logits: ideal for checking that every output follows its grammar.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(json_corpus(), trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False)
    ids = {tok: raw.token_to_id(tok) for tok in SPECIALS}
    config = transformers.LlamaConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, initializer_range=0.1,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = Path(folder)
    save_hf_folder(model, tokenizer, folder)
    return folder
