"""What the server serves: the embedded CityLM, or a local Hugging Face Llama folder.

A ``TextCodec`` hides which tokenizer turns text into ids and back, and which chat template
applies, so the rest of the server is the same for both. CityLM needs no download; a
folder is read with ``minisrv.model.from_hf_llama`` and its own tokenizer (through
``transformers``, only when such a folder is served). Every stop id of the folder's
``eos_token_id`` lists is kept: the engine stops on all of them (``CityLM.eos_ids``), and
the codec drops them from the text it streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TextCodec", "load_served_model", "model_name"]


@dataclass
class TextCodec:
    """Encodes prompts and decodes outputs for one served model."""

    tokenizer: Any
    kind: str  # "citylm" or "hf"
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # extra ids ending a reply

    @property
    def prefix_stable(self) -> bool:
        """True when decoding more ids only appends text (CityLM: one character per id), so
        a stream may decode each new id alone instead of the whole output again."""
        return self.kind == "citylm"

    def encode(self, text: str) -> list[int]:
        """Prompt ids, ``<bos>`` included; ValueError for text the tokenizer cannot take."""
        if self.kind == "citylm":
            return self.tokenizer.encode(text)
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens (``<eos>``) dropped."""
        if self.kind == "citylm":
            return self.tokenizer.decode(ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[Any]) -> list[int]:
        """Prompt ids for a chat: CityLM's template, or the folder's own chat template."""
        from minisrv.server.protocol import citylm_chat_prompt

        if self.kind == "citylm" or getattr(self.tokenizer, "chat_template", None) is None:
            return self.encode(citylm_chat_prompt(messages))
        plain = [{"role": m.role, "content": m.content} for m in messages]
        ids = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def model_name(model: str) -> str:
    """The id ``/v1/models`` lists: ``citylm``, or the folder's name."""
    return "citylm" if model == "citylm" else Path(model).resolve().name


def load_codec(model: str) -> TextCodec:
    """The tokenizer side of ``model`` alone (what a data-parallel front end needs)."""
    if model == "citylm":
        from minisrv.tokenizer import Tokenizer

        return TextCodec(Tokenizer(), "citylm")
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model must be 'citylm' or a local Hugging Face Llama folder; "
                         f"{model!r} has no config.json")
    from transformers import AutoTokenizer

    from minisrv.model import folder_eos_ids

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return TextCodec(tokenizer, "hf", frozenset(folder_eos_ids(folder)))


def load_served_model(model: str, device: str | None = None) -> tuple[Any, TextCodec]:
    """The model to serve and its codec; ``device=None`` picks CUDA when available."""
    if model == "citylm":
        from minisrv.model import load_citylm

        net, _ = load_citylm(device)
        return net, load_codec(model)
    from minisrv.model import from_hf_llama

    codec = load_codec(model)
    net = from_hf_llama(model, device=device)
    return net, codec
