"""The model a front door serves (:class:`ServedModel`): its names, context, vocabulary and
tokenizer, read from the checkpoint folder, and the limits that follow from them (the most
characters a prompt can have, the largest body worth reading: :func:`body_limit`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from .._common._hf._config import read_config
from .._common._hf._tokenizer import Tokenizer
from ._openai import MAX_PROMPTS

__all__ = ["MAX_BODY", "ServedModel", "body_limit"]

#: The largest request body read, in bytes, whatever the model.
MAX_BODY = 16 * 1024 * 1024


def body_limit(model: ServedModel) -> int:
    """The largest body read for ``model``: room for a few prompts' text as long as its
    context (in JSON, each character up to 6 bytes as an escape), or for a batch of
    ``MAX_PROMPTS`` prompts of token ids as long as it (up to 8 bytes an id), at least
    1 MiB, at most :data:`MAX_BODY`."""
    ids = MAX_PROMPTS * model.max_len * 8
    return min(MAX_BODY, max(1 << 20, 4 * 6 * model.max_prompt_chars, ids))


class ServedModel:
    """The model a front door serves: its names (the first is the one ``/v1/models`` lists
    first), context length, vocabulary, tokenizer and chat template, read from the
    checkpoint folder. Raises :class:`ConfigError` for a folder that is not a checkpoint."""

    def __init__(self, checkpoint: str | os.PathLike[str], names: Sequence[str] = ()) -> None:
        self.root = os.fspath(checkpoint)
        config = read_config(self.root)
        self.tokenizer = Tokenizer(self.root)
        # listed names never show where the checkpoint lies: the folder's name by default,
        # its path (as given, or absolute) still accepted as vLLM's default name is
        self.names = list(names) or [os.path.basename(os.path.normpath(self.root))]
        self.aliases = set(self.names) | (
            set() if names else {self.root, os.path.abspath(self.root)}
        )
        self.max_len = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        self.max_prompt_chars = self.max_len * _longest_token(self.tokenizer)
        self.created = int(time.time())
        self._texts: dict[int, str] = {}

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (cached)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special=False)
        return text


def _longest_token(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters of one token's text (at least 16)."""
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    return max(16, max(map(len, vocab), default=0))
