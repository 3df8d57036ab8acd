"""A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, and the
chat template of ``tokenizer_config.json`` rendered with Jinja2 in a sandbox (what
``transformers`` does), with the same variables (``messages``, ``add_generation_prompt``, the
special tokens, ``raise_exception``), under the limits of :mod:`._chat`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as _Tokenizer

import orchestr as oc

from ._chat import ChatTemplate

__all__ = ["Tokenizer"]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encodes and decodes text and renders chat messages for one checkpoint folder."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as exc:  # the library raises plain Exception for a bad file
            raise oc.ConfigError(f"{path}: not a readable tokenizer ({exc})") from None
        config_path = os.path.join(folder, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.exists(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as exc:
                raise oc.ConfigError(f"{config_path}: not readable JSON: {exc}") from None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.chat_template: str | None = config.get("chat_template")
        self._template: ChatTemplate | None = None
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str):
                raise oc.ConfigError(
                    f"{config_path}: chat_template must be a string, got "
                    f"{type(self.chat_template).__name__}"
                )
            self._template = ChatTemplate(self.chat_template, where=config_path)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special``, with the template's added tokens (a BOS).
        Raises ``ValueError`` for text the vocabulary cannot spell (a word-level tokenizer
        without an unknown token)."""
        try:
            encoding = self._tok.encode(text, add_special_tokens=special)
        except Exception as exc:  # the tokenizers library raises its errors as Exception
            raise ValueError(f"this tokenizer cannot encode {text[:80]!r}: {exc}") from exc
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """The text of ``messages`` in the checkpoint's chat format. Raises
        :class:`ConfigError` when the checkpoint has no template or rendering fails, and
        ``ValueError`` when the render passes one of :mod:`._chat`'s limits (time, steps,
        size). Blocks its thread while it renders (at most the time limit)."""
        if self._template is None:
            raise oc.ConfigError("this tokenizer has no chat_template")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )
