"""The names the book's server experiments import (``load_codec``, ``model_name``).

The one loader is ``minisrv.model.load_model`` (``load_tokenizer`` for the tokenizer
alone); its tokenizers serve the server themselves (chat template, stop ids, prefix-stable
decoding). This module only keeps the older names working.
"""

from __future__ import annotations

from minisrv.server.config import model_name
from minisrv.tokenizer import load_tokenizer as load_codec

__all__ = ["load_codec", "model_name"]
