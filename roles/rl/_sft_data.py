"""Prompt and response rows for supervised fine-tuning: read from a local file (JSONL,
Parquet), split into train and held-out, rendered with the checkpoint's tokenizer, and the
order a run takes them in.

A row's prompt field holds plain text or chat messages (``[{"role": ..., "content": ...}]``);
messages are rendered with the checkpoint's chat template with the generation prompt (the
assistant turn's opening), and so is plain text when ``chat`` is set (as one user turn,
after ``system`` if given); other plain text is encoded with the tokenizer's special tokens (a
BOS where it adds one). The response field is text: its tokens, encoded on their own, follow
the prompt's, then the tokenizer's end token (``eos_token``, a chat template's end of turn), so
the model learns to stop. Rows longer than ``max_tokens`` in all are left out and counted.

The order is seeded as the RL data's is (:class:`~._data.DataSource`): epoch ``e`` visits the
train rows in a permutation drawn from ``(seed, e)`` and step ``s`` takes positions ``s *
batch_size ...`` of that sequence, so the rows of a step follow from the step alone. No I/O
but reading the files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orchestr as oc
from orchestr.roles._common._hf._tokenizer import Tokenizer

from ._data import messages_of, read_rows, reasoning_gym_rows, split_rows
from ._order import EpochOrder

__all__ = ["SFTDataSpec", "SFTOrder", "SFTRows", "load_sft_rows"]


@dataclasses.dataclass(frozen=True)
class SFTDataSpec:
    """The rows: ``path`` (a ``.jsonl`` or ``.parquet`` file) or ``reasoning_gym`` (a task
    name, ``size`` rows drawn with ``seed``, ``options`` passed to the task: its questions and
    answers); ``held_out`` a file of held-out rows, else ``held_out_fraction`` of the rows (at
    most ``held_out_size``) are kept out of training, drawn with the schedule's seed.
    ``prompt_field`` names the prompt (text, or chat messages rendered with the checkpoint's
    chat template; a reasoning-gym row's is ``question``), ``response_field`` the response
    (text, the end token added; a reasoning-gym row's is ``answer``). ``chat`` renders text
    prompts with the template too (as a user turn, after a ``system`` turn if given). Rows
    whose prompt and response (with the end token) pass ``max_tokens`` are left out
    (counted)."""

    path: str | None = None
    reasoning_gym: str | None = None
    size: int = 1000
    seed: int = 0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    held_out: str | None = None
    held_out_fraction: float = 0.1
    held_out_size: int = 64
    prompt_field: str | None = None
    response_field: str | None = None
    chat: bool = False
    system: str | None = None
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if (self.path is None) == (self.reasoning_gym is None):
            raise oc.ConfigError(
                "data needs one of path (a JSONL or Parquet file) or reasoning_gym"
            )
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise oc.ConfigError(
                f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}"
            )
        for name in ("size", "held_out_size", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise oc.ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.prompt == self.response:
            raise oc.ConfigError(
                f"prompt_field and response_field are both {self.prompt!r}; name two fields"
            )

    def _field(self, given: str | None, gym: str, file: str) -> str:
        if given is not None:
            return given
        return gym if self.reasoning_gym is not None else file

    @property
    def prompt(self) -> str:
        """The prompt's field: ``prompt_field``, else the source's (``question`` for
        reasoning-gym rows, ``prompt`` for a file's)."""
        return self._field(self.prompt_field, "question", "prompt")

    @property
    def response(self) -> str:
        """The response's field: ``response_field``, else the source's (``answer`` for
        reasoning-gym rows, ``response`` for a file's)."""
        return self._field(self.response_field, "answer", "response")

    @property
    def source(self) -> str:
        """What the rows come from, as messages name it."""
        return self.path if self.path is not None else f"reasoning_gym {self.reasoning_gym}"


@dataclasses.dataclass
class SFTRows:
    """Rendered rows: each prompt's and each response's token ids (the end token included)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    #: Rows left out for passing ``max_tokens``.
    too_long: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def tokens(self) -> int:
        """The response tokens of every row: what the loss counts."""
        return sum(len(r) for r in self.responses)

    def samples(self, rows: list[int] | None = None) -> list[dict[str, list[int]]]:
        """Rows (all by default) as :meth:`~orchestr.roles.Trainer.sft_step` takes them."""
        picked = range(len(self)) if rows is None else rows
        return [{"prompt": self.prompts[i], "tokens": self.responses[i]} for i in picked]


def _prompt_ids(spec: SFTDataSpec, tok: Tokenizer, prompt: Any, where: str, i: int) -> list[int]:
    field = spec.prompt
    if isinstance(prompt, list):
        turns = messages_of(prompt, where, i)
    elif isinstance(prompt, str):
        if not spec.chat:
            return tok.encode(prompt, special=True)
        turns = [{"role": "user", "content": prompt}]
        if spec.system is not None:
            turns.insert(0, {"role": "system", "content": spec.system})
    else:
        raise oc.ConfigError(
            f"{where}: row {i}'s {field!r} is text or chat messages, got {type(prompt).__name__}"
        )
    try:
        text = tok.apply_chat_template(turns, add_generation_prompt=True)
    except oc.ConfigError as exc:
        raise oc.ConfigError(
            f"{where}: row {i}'s chat prompt cannot be rendered: {exc} (give text prompts "
            "without data.chat, or a checkpoint with a chat_template)"
        ) from None
    return tok.encode(text)


def render_rows(
    spec: SFTDataSpec, tok: Tokenizer, rows: list[tuple[int, dict[str, Any]]], where: str
) -> SFTRows:
    """``rows`` (each with its number in the file ``where``, counted from 1) rendered. Raises
    :class:`ConfigError` naming the file, the row and the fix."""
    eos = tok.eos_id
    if eos is None:
        raise oc.ConfigError(
            "the checkpoint's tokenizer has no eos_token (tokenizer_config.json): the responses "
            "need an end token for the model to learn to stop"
        )
    out = SFTRows([], [])
    for i, row in rows:
        for field in (spec.prompt, spec.response):
            if field not in row:
                key = "prompt_field" if field == spec.prompt else "response_field"
                raise oc.ConfigError(
                    f"{where}: row {i} has no field {field!r} (it has "
                    f"{', '.join(sorted(row)) or 'none'}); set data.{key}"
                )
        response = row[spec.response]
        if not isinstance(response, str):
            raise oc.ConfigError(
                f"{where}: row {i}'s {spec.response!r} must be text, got {type(response).__name__}"
            )
        try:
            prompt = _prompt_ids(spec, tok, row[spec.prompt], where, i)
            answer = [*tok.encode(response), eos]
        except ValueError as exc:  # text the vocabulary cannot spell, a template's limit
            raise oc.ConfigError(f"{where}: row {i}: {exc}") from None
        if not prompt:
            raise oc.ConfigError(
                f"{where}: row {i}'s {spec.prompt!r} encodes to no token; give it text"
            )
        if len(prompt) + len(answer) > spec.max_tokens:
            out.too_long += 1
            continue
        out.prompts.append(prompt)
        out.responses.append(answer)
    return out


def load_sft_rows(spec: SFTDataSpec, tokenizer: Tokenizer, seed: int) -> tuple[SFTRows, SFTRows]:
    """``(train, held_out)`` rows for ``spec``, rendered with ``tokenizer``; the held-out rows
    drawn with ``seed`` unless a file gives them. Raises :class:`ConfigError` naming the file,
    the row and the fix (a missing file or field, a value of the wrong type, no rows left)."""
    if spec.reasoning_gym is not None:
        rows = reasoning_gym_rows(spec.reasoning_gym, spec.size, spec.seed, spec.options)
    else:
        assert spec.path is not None
        rows = read_rows(spec.path)
    if not rows:
        raise oc.ConfigError(f"{spec.source} has no rows")
    train_rows, held = split_rows(
        rows, spec.held_out, spec.held_out_fraction, spec.held_out_size, seed
    )
    train = render_rows(spec, tokenizer, train_rows, spec.source)
    held_where = spec.held_out or spec.source
    held_out = render_rows(spec, tokenizer, held[: spec.held_out_size], held_where)
    for rendered, what, where in (
        (train, "training", spec.source),
        (held_out, "held-out", held_where),
    ):
        if rendered.too_long and not len(rendered):
            raise oc.ConfigError(
                f"every {what} row of {where} is longer than max_tokens ({spec.max_tokens}) "
                "with its response; raise it"
            )
    if not len(train):
        raise oc.ConfigError(
            f"{spec.source}: no rows are left to train on; lower held_out_fraction"
        )
    if not len(held_out):
        raise oc.ConfigError(
            f"no held-out rows; give data.held_out (a file) or a held_out_fraction that "
            f"leaves at least one of {len(rows)} rows out"
        )
    return train, held_out


class SFTOrder(EpochOrder):
    """Which train rows each step takes: ``batch_size`` consecutive positions of the epochs'
    seeded permutations of ``rows`` rows (:class:`~._data.EpochOrder`). Pure."""

    def __init__(self, rows: int, batch_size: int, seed: int) -> None:
        super().__init__(rows, batch_size, seed)
        self.batch_size = batch_size

    def step(self, step: int) -> list[int]:
        """The train rows of ``step``, in order."""
        return [self.row(step, i) for i in range(self.batch_size)]


def shares(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` cut into ``n`` consecutive shares whose sizes differ by at most one (the
    first ones the larger). Pure."""
    per, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        size = per + (1 if k < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out
