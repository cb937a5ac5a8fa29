"""The tokenizers: CityLM's characters, and any Hugging Face tokenizer behind the same face.

Characters, not subwords: the city language has a tiny alphabet, so every token is one
letter and a reader can see exactly which token the model produced at each step, which is
what the scheduling chapters draw. The alphabet is a constant written here (not learned
from data) so the shipped weights and any future data agree on what every id means.

Both tokenizers also serve the HTTP server (``load_model`` returns one, and so does
``load_tokenizer`` here, without the weights or torch): ``chat_prompt`` applies the model's
chat template, ``stop_ids`` are the ids whose text a reply never shows, and
``prefix_stable`` says whether decoding one more id only appends text (then a stream
decodes each new id alone).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ALPHABET", "BOS", "EOS", "HFTokenizer", "Tokenizer", "bounded_list",
           "checkpoint_folder", "concatenated_chat", "folder_eos_ids", "load_tokenizer",
           "merge_eos_ids", "read_json"]

BOS = "<bos>"
EOS = "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS)
BOS_ID, EOS_ID = 0, 1  # ids of the special tokens, fixed by their order above

# Punctuation first, then letters: "\n" separates country lines, ":" ends the country code,
# ", " separates cities, and ' . - occur inside folded city names (e.g. "St. John's").
ALPHABET: str = "\n ',-.:" + string.ascii_uppercase + string.ascii_lowercase


class Tokenizer:
    """Maps text to ids and back, one id per character plus ``<bos>`` and ``<eos>``.

    Ids ``0`` and ``1`` are ``<bos>`` and ``<eos>``; the characters of ``ALPHABET`` follow
    in order. There is no ``<pad>``: minisrv never pads, it packs requests into one flat
    batch instead.
    """

    def __init__(self) -> None:
        self._itos: list[str] = [*SPECIAL_TOKENS, *ALPHABET]
        self._stoi: dict[str, int] = {ch: i for i, ch in enumerate(ALPHABET, len(SPECIAL_TOKENS))}
        self._charset = frozenset(ALPHABET)
        self.bos_id: int = BOS_ID
        self.eos_id: int = EOS_ID
        self.eos_ids: tuple[int, ...] = (EOS_ID,)
        self.stop_ids: frozenset[int] = frozenset(self.eos_ids)
        self.prefix_stable = True  # one character per id: decoding only appends

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids: the special tokens plus the alphabet."""
        return len(self._itos)

    @property
    def alphabet(self) -> str:
        """The characters the tokenizer accepts, in id order."""
        return ALPHABET

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids for ``text``, preceded by ``<bos>`` unless ``bos`` is false.

        The characters outside the alphabet are reported at once, with their positions (the
        first few and a count: a message never grows with the text), so a user fixing a
        prompt sees the problems in one go.
        """
        if not self._charset.issuperset(text):
            unknown = ((pos, ch) for pos, ch in enumerate(text) if ch not in self._stoi)
            raise ValueError(
                "text contains characters outside the CityLM alphabet: "
                f"{bounded_list(f'{ch!r} at position {pos}' for pos, ch in unknown)} "
                "(fold accents first, e.g. with minisrv.train.data.fold_name)"
            )
        ids = [self._stoi[ch] for ch in text]
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special`` is false."""
        pieces = []
        for i in ids:
            i = int(i)
            if i < len(SPECIAL_TOKENS) and skip_special:
                continue
            pieces.append(self.id_to_str(i))
        return "".join(pieces)

    def id_to_str(self, i: int) -> str:
        """The string for one id: its character, or ``"<bos>"``/``"<eos>"``."""
        if not 0 <= int(i) < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._itos[int(i)]

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """CityLM's chat template: the contents as one document (``concatenated_chat``)."""
        return self.encode(concatenated_chat(messages))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def concatenated_chat(messages: Sequence[dict[str, str]]) -> str:
    """The plain chat template: every message's ``content`` in order, roles unmarked.

    CityLM is a completion model of country lines, so a conversation is one document and
    the reply continues it: ``[{"role": "user", "content": "FR:"}]`` asks what the
    completion prompt ``"FR:"`` asks, and a multi-turn chat (``"FR:"``, the reply
    ``" Paris, Lyon\\n"``, then ``"JP:"``) reads as ``"FR: Paris, Lyon\\nJP:"``.
    """
    return "".join(message["content"] for message in messages)


def bounded_list(items: Iterable[str], shown: int = 5) -> str:
    """The first ``shown`` items joined, then how many more there are: a message of bounded
    length however many items (a 10 MB prompt of bad characters gives a short error)."""
    head: list[str] = []
    more = 0
    for item in items:
        if len(head) < shown:
            head.append(item)
        else:
            more += 1
    return ", ".join(head) + (f" and {more} more" if more else "")


def merge_eos_ids(*sources: int | Sequence[int] | None) -> tuple[int, ...]:
    """The stop ids named by ``sources`` (each an id, a list of ids or ``None``), first seen first.

    HF keeps them in several places (``config.json``, ``generation_config.json``, the
    tokenizer) as one id or a list; a generation must stop on any of them.
    """
    found: list[int] = []
    for src in sources:
        found.extend([] if src is None else [src] if isinstance(src, int) else src)
    return tuple(dict.fromkeys(int(i) for i in found))


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or an empty dict when the file does not exist."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def folder_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """Every stop id a checkpoint folder names, in ``config.json`` and then in
    ``generation_config.json`` (chat models often list end-of-text and end-of-turn)."""
    folder = Path(folder)
    return merge_eos_ids(read_json(folder / "config.json").get("eos_token_id"),
                         read_json(folder / "generation_config.json").get("eos_token_id"))


def checkpoint_folder(name_or_path: str | Path) -> Path:
    """``name_or_path`` as a checkpoint folder; ValueError if it holds no ``config.json``."""
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"cannot load {str(name_or_path)!r}: give 'citylm' or a local folder with a "
            "Hugging Face checkpoint (config.json, *.safetensors, tokenizer files)"
        )
    return folder


def load_tokenizer(name_or_path: str | Path = "citylm") -> Tokenizer | HFTokenizer:
    """The tokenizer ``load_model`` gives, without the model (a server's HTTP process
    encodes and decodes while its workers hold the weights); its stop ids are those of the
    folder's configs and of the tokenizer, as the model's. It lives here, not beside the
    loader in ``minisrv.model``, so that the HTTP process never imports torch for it (about
    1 s of CPU on every server start)."""
    if str(name_or_path) == "citylm":
        return Tokenizer()
    folder = checkpoint_folder(name_or_path)
    return HFTokenizer.from_folder(folder, folder_eos_ids(folder))


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface of minisrv's ``Tokenizer``.

    The engine, the workloads and the chapters use ``encode(text) -> ids``,
    ``decode(ids) -> text``, ``bos_id``, ``eos_id`` and ``vocab_size``; wrapping a
    ``transformers`` tokenizer this way lets them serve any Llama-family checkpoint unchanged.
    ``eos_ids`` lists every stop id: the ones given (the model's) and the tokenizer's own.
    Subwords change how the text before them reads, so it is not ``prefix_stable``.
    """

    prefix_stable = False

    def __init__(self, hf_tokenizer: Any, eos_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.bos_id: int | None = hf_tokenizer.bos_token_id
        self.eos_ids: tuple[int, ...] = merge_eos_ids(eos_ids, hf_tokenizer.eos_token_id)
        self.eos_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.stop_ids: frozenset[int] = frozenset(self.eos_ids)

    @classmethod
    def from_folder(cls, folder: str | Path, eos_ids: tuple[int, ...] = ()) -> HFTokenizer:
        """The tokenizer saved in a checkpoint folder (``tokenizer.json`` and its config)."""
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # optional: only real checkpoints need it
            raise ImportError(
                "loading a Hugging Face tokenizer needs transformers: pip install transformers"
            ) from err
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids, added special tokens included."""
        return len(self.hf)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids for ``text``, with the special tokens this tokenizer puts before a text (e.g.
        Llama's begin-of-text) unless ``bos`` is false, as ``transformers`` would feed it."""
        return list(self.hf.encode(text, add_special_tokens=bos))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special`` is false."""
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special))

    def id_to_str(self, i: int) -> str:
        """The text of one id (special tokens included), as drawings label tokens."""
        if not 0 <= int(i) < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
        return str(self.hf.decode([int(i)]))

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids for a chat: the folder's chat template, or the plain one without."""
        if getattr(self.hf, "chat_template", None) is None:
            return self.encode(concatenated_chat(messages))
        ids = self.hf.apply_chat_template(list(messages), add_generation_prompt=True,
                                          tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers: BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"

