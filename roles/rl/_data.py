"""A user's prompts for RL: rows read from local files (JSONL, Parquet) or drawn from a
reasoning-gym task, split into train and held-out, rendered with the checkpoint's tokenizer, and
the :class:`DataSource` the job trains on.

A row's prompt field holds plain text or chat messages (``[{"role": ..., "content": ...}]``);
messages are rendered with the checkpoint's chat template (with the generation prompt), and so
is plain text when ``chat`` is set (as one user turn, after ``system`` if given). Every other
field of the row travels with its samples to the reward functions.

The order is seeded: epoch ``e`` visits the train rows in a permutation drawn from
``(seed, e)``, and step ``s`` takes positions ``s * prompts_per_step ...`` of that sequence, so
the position in the data is a function of the step (a resumed run goes on from its step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from typing import Any

import orchestr as oc
from orchestr.roles._common._hf._tokenizer import Tokenizer
from orchestr.roles._common._seeding import derive_seed
from orchestr.roles.generator import Completion, Request
from orchestr.roles.trainer import overlong_penalty

from ._order import EpochOrder
from ._reference import TrainConfig, kv_options
from ._source import Source, group_of

__all__ = [
    "DataSource",
    "DataSpec",
    "Rows",
    "load_rows",
    "messages_of",
    "read_rows",
    "reasoning_gym_rows",
    "split_rows",
]

#: The file kinds read, by suffix.
SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where the prompts come from: ``path`` (a ``.jsonl`` or ``.parquet`` file) or
    ``reasoning_gym`` (a task name, ``size`` rows drawn with ``seed``, ``options`` passed to
    the task). ``held_out`` is a file of held-out rows, else ``held_out_fraction`` of the rows
    (at most ``held_out_size``) are kept out of training. ``prompt_field`` names the prompt
    (a reasoning-gym row's is ``question``): text, or chat messages rendered with the
    checkpoint's chat template; ``chat`` renders text prompts with it too (as a user turn,
    after a ``system`` turn if given). Rows whose prompt has more than ``max_prompt_tokens``
    tokens are left out (counted)."""

    path: str | None = None
    reasoning_gym: str | None = None
    size: int = 1000
    seed: int = 0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_field: str | None = None
    held_out: str | None = None
    held_out_fraction: float = 0.1
    held_out_size: int = 64
    chat: bool = False
    system: str | None = None
    max_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        if (self.path is None) == (self.reasoning_gym is None):
            raise oc.ConfigError(
                "data needs one of path (a JSONL or Parquet file) or reasoning_gym"
            )
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise oc.ConfigError(
                f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}"
            )
        for name in ("size", "held_out_size", "max_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise oc.ConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def field(self) -> str:
        if self.prompt_field is not None:
            return self.prompt_field
        return "question" if self.reasoning_gym is not None else "prompt"


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a local ``.jsonl`` or ``.parquet`` file. Raises :class:`ConfigError` naming
    the file (and the line) for a missing file, another kind, or a row that is not an object."""
    if not os.path.isfile(path):
        raise oc.ConfigError(f"{path}: no such data file")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise oc.ConfigError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
            ) from None
        try:
            rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors are many kinds
            raise oc.ConfigError(f"{path}: not a readable Parquet file: {exc}") from None
        return rows
    if not path.endswith(".jsonl"):
        raise oc.ConfigError(f"{path}: data files are {' or '.join(SUFFIXES)}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise oc.ConfigError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise oc.ConfigError(f"{path}:{number}: a row is a JSON object, got {line[:60]!r}")
            rows.append(row)
    return rows


def reasoning_gym_rows(
    task: str, size: int, seed: int, options: dict[str, Any]
) -> list[dict[str, Any]]:
    """``size`` rows of reasoning-gym's procedural ``task`` drawn with ``seed`` (``options``
    passed to the task), as plain JSON values. Raises :class:`ConfigError` without the package,
    or for an unknown task or option."""
    try:
        import reasoning_gym
    except ImportError:
        raise oc.ConfigError("reasoning_gym data needs the reasoning-gym package") from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    except Exception as exc:  # an unknown name or option: the library raises several kinds
        raise oc.ConfigError(f"reasoning_gym task {task!r}: {exc}") from None
    # through JSON: the metadata's tuples and the like travel as plain lists and values
    return [json.loads(json.dumps(dict(entry), default=str)) for entry in dataset]


@dataclasses.dataclass
class Rows:
    """Rendered rows: each prompt's token ids and text, and its other fields."""

    ids: list[list[int]]
    texts: list[str]
    fields: list[dict[str, Any]]
    #: Rows left out for a prompt longer than ``max_prompt_tokens``.
    too_long: int = 0

    def __len__(self) -> int:
        return len(self.ids)


def _render(
    spec: DataSpec, tok: Tokenizer, rows: list[tuple[int, dict[str, Any]]], where: str
) -> Rows:
    """``rows`` (each with its number in the file, counted from 1) rendered."""
    out = Rows([], [], [])
    field = spec.field
    for i, row in rows:
        if field not in row:
            raise oc.ConfigError(
                f"{where}: row {i} has no field {field!r} (it has {', '.join(sorted(row)) or 'none'});"
                " set data.prompt_field"
            )
        prompt = row[field]
        if isinstance(prompt, list):
            text = tok.apply_chat_template(
                messages_of(prompt, where, i), add_generation_prompt=True
            )
            ids = tok.encode(text)
        elif isinstance(prompt, str):
            if spec.chat:
                turns = [{"role": "user", "content": prompt}]
                if spec.system is not None:
                    turns.insert(0, {"role": "system", "content": spec.system})
                text = tok.apply_chat_template(turns, add_generation_prompt=True)
                ids = tok.encode(text)
            else:
                text, ids = prompt, tok.encode(prompt, special=True)
        else:
            raise oc.ConfigError(
                f"{where}: row {i}'s {field!r} is text or chat messages, got {type(prompt).__name__}"
            )
        if not ids or len(ids) > spec.max_prompt_tokens:
            out.too_long += 1
            continue
        out.ids.append(ids)
        out.texts.append(text)
        out.fields.append({k: v for k, v in row.items() if k != field})
    return out


def messages_of(value: list[Any], where: str, i: int) -> list[dict[str, Any]]:
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise oc.ConfigError(
                f"{where}: row {i}'s messages are objects with a role and content, got {m!r:.80}"
            )
    return value


Numbered = list[tuple[int, dict[str, Any]]]


def split_rows(
    rows: list[dict[str, Any]], held_out: str | None, fraction: float, size: int, seed: int
) -> tuple[Numbered, Numbered]:
    """``(train, held_out)`` rows, each with its number in its file (from 1): the held-out
    file's rows and all of ``rows``, or ``fraction`` of ``rows`` (at most ``size``) drawn
    with ``seed`` and the rest."""
    numbered = list(enumerate(rows, start=1))
    if held_out is not None:
        return numbered, list(enumerate(read_rows(held_out), start=1))
    order = list(range(len(rows)))
    random.Random(derive_seed("held-out", seed)).shuffle(order)
    n = min(size, int(len(rows) * fraction))
    return [numbered[i] for i in sorted(order[n:])], [numbered[i] for i in sorted(order[:n])]


def load_rows(spec: DataSpec, tokenizer: Tokenizer) -> tuple[Rows, Rows]:
    """``(train, held_out)`` rows for ``spec``, rendered with ``tokenizer``. Raises
    :class:`ConfigError` naming the file, the row and the fix."""
    if spec.reasoning_gym is not None:
        rows = reasoning_gym_rows(spec.reasoning_gym, spec.size, spec.seed, spec.options)
        source = f"reasoning_gym {spec.reasoning_gym}"
    else:
        assert spec.path is not None
        rows, source = read_rows(spec.path), spec.path
    if not rows:
        raise oc.ConfigError(f"{source} has no rows")
    train_rows, held = split_rows(
        rows, spec.held_out, spec.held_out_fraction, spec.held_out_size, spec.seed
    )
    train = _render(spec, tokenizer, train_rows, source)
    held_out = _render(spec, tokenizer, held[: spec.held_out_size], spec.held_out or source)
    for rendered, what in ((train, "training"), (held_out, "held-out")):
        if rendered.too_long and not len(rendered):
            raise oc.ConfigError(
                f"every {what} prompt of {source} is longer than max_prompt_tokens "
                f"({spec.max_prompt_tokens}); raise it"
            )
    if not len(held_out):
        raise oc.ConfigError(
            f"no held-out rows; give data.held_out (a file) or a held_out_fraction that "
            f"leaves at least one of {len(rows)} rows out"
        )
    return train, held_out


class DataSource(Source):
    """Prompts from :class:`Rows`, ``group_size`` samples each, scored by a
    :class:`~orchestr.roles.Reward` mesh's weighted ``functions`` and (``scorer``: its
    ``model``, ``model_weight`` and ``model_name``) a reward model; the held-out score is the
    mean reward of greedy completions of the held-out rows."""

    reward_endpoint = "score_rows"

    def __init__(
        self,
        config: TrainConfig,
        train: Rows,
        held_out: Rows,
        *,
        max_new_tokens: int,
        checkpoint: str,
        functions: Sequence[dict[str, Any]],
        timeout_s: float = 5.0,
        default: float = 0.0,
        eos_id: int | None = None,
        pad_id: int = 0,
        overlong: tuple[int, float] = (0, 0.0),
        tokenizer: Tokenizer | None = None,
        keep_samples: int = 4,
        scorer: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.overlong_buffer, self.overlong_penalty = overlong
        self.tokenizer = tokenizer
        self.keep_samples = keep_samples
        self._last: list[dict[str, Any]] = []
        self.train, self.held = train, held_out
        self.max_new_tokens = max_new_tokens
        self.eos_id, self.pad_id = eos_id, pad_id
        reward_kwargs: dict[str, Any] = {"tokenizer": checkpoint, **(scorer or {})}
        if functions:
            reward_kwargs["functions"] = [dict(f) for f in functions]
        reward_kwargs |= {"timeout_s": timeout_s, "default": default}
        self.reward_args = ((), reward_kwargs)
        super().__init__()
        self.order = EpochOrder(len(train), config.prompts_per_step, config.seed)

    def row(self, step: int, index: int) -> int:
        """The train row of prompt ``index`` of ``step``: the step's own run through the
        epoch's order; dynamic sampling's extra prompts (``index >= prompts_per_step``) are
        drawn from the train rows by a stream keyed by the step and the index."""
        per = self.config.prompts_per_step
        if index >= per:
            key = derive_seed("extra-row", self.config.seed, step, index)
            return random.Random(key).randrange(len(self.train))
        return self.order.row(step, index)

    def step_requests(self, step: int) -> list[Request]:
        out = []
        for index in range(self.config.prompts_per_step):
            ids = self.train.ids[self.row(step, index)]
            out.extend(group_of(self.config, step, index, ids, self.max_new_tokens))
        return out

    def extra_requests(self, step: int, draw: int) -> list[Request]:
        per = self.config.prompts_per_step
        out = []
        for index in range(draw * per, (draw + 1) * per):
            ids = self.train.ids[self.row(step, index)]
            out.extend(group_of(self.config, step, index, ids, self.max_new_tokens))
        return out

    def reward_payload(self, completions: Sequence[Completion]) -> list[Any]:
        payload = []
        for c in completions:
            step, index, _ = (int(part) for part in c.id.split("/"))
            row = self.row(step, index)
            payload.append(self._row(self.train, row, c.tokens))
        # the batch's first few, kept for people to read (their rewards come with the result)
        self._last = [
            {"prompt": p["prompt"], "completion": self._text(p["completion_ids"])}
            for p in payload[: self.keep_samples]
        ]
        return payload

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _row(self, rows: Rows, i: int, tokens: Sequence[int]) -> dict[str, Any]:
        return {"prompt": rows.texts[i], "completion_ids": list(tokens), "fields": rows.fields[i]}

    def rewards(self, result: Any, held_out: bool = False) -> list[float]:
        rewards = [float(r) for r in result["rewards"]]
        if not held_out:
            self.tally.add(result["per_function"], result["failures"])
            per = result["per_function"]
            for i, sample in enumerate(self._last):
                sample["reward"] = rewards[i]
                sample["rewards"] = {name: values[i] for name, values in per.items()}
        return rewards

    def shape(self, completions: Sequence[Completion], rewards: list[float]) -> list[float]:
        if not self.overlong_buffer:
            return rewards
        return [
            r
            + overlong_penalty(
                len(c.tokens), self.max_new_tokens, self.overlong_buffer, self.overlong_penalty
            )
            for c, r in zip(completions, rewards, strict=True)
        ]

    def samples(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self._last]

    def held_out(self) -> tuple[list[list[int]], list[int]]:
        return [list(ids) for ids in self.held.ids], [self.max_new_tokens] * len(self.held)

    def held_out_payload(self, completions: Sequence[Sequence[int]]) -> list[Any] | None:
        return [self._row(self.held, i, c) for i, c in enumerate(completions)]

    def held_out_score(
        self, completions: Sequence[Sequence[int]], rewards: list[float] | None
    ) -> float:
        assert rewards is not None
        return sum(rewards) / max(1, len(rewards))

    def kv(self, config: TrainConfig) -> dict[str, Any]:
        longest = max(len(ids) for ids in [*self.train.ids, *self.held.ids]) + self.max_new_tokens
        return kv_options(config, longest)
