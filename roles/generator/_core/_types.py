"""What a generator is asked and answers: a :class:`Request`, its :class:`Completion`, the
engine's :class:`EngineStats`, and the :class:`Handoff` of a prompt's KV from a prefill
generator to a decode one. Registered dataclasses, pinned to ``orchestr.roles``."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from orchestr import register

if TYPE_CHECKING:
    from orchestr.fabric import Buffer

__all__ = [
    "MAX_ID_CHARS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "Completion",
    "EngineStats",
    "Handoff",
    "Request",
    "TokenDelta",
    "Updates",
    "as_handoff",
    "as_request",
]

#: Limits of a :class:`Request` that every engine checks on submission (and the front door
#: before it): the most ``top_logprobs`` (OpenAI's and vLLM's limit), stop strings, the
#: characters of one stop string (each is looked for after every token, over a window as
#: long as the longest), and the characters of a request id.
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 256


@register
@dataclasses.dataclass
class Request:
    """One prompt to complete. ``temperature`` 0 decodes greedily; ``stop_token`` (else the
    engine's ``eos_id``) ends the completion when sampled (it is included in ``tokens``);
    so does any of the ``stop`` strings once the output's text contains it (the engine needs
    a tokenizer for those). ``top_k`` (0: all) and ``top_p`` (1.0: all) narrow what is
    sampled from to the ``top_k`` likeliest tokens and then to the fewest whose probability
    reaches ``top_p``. ``top_logprobs`` (at most 20) asks for that many likeliest tokens and
    their log-probs at each position, untempered as ``Completion.logprobs`` is.
    ``ignore_eos`` generates past the engine's end-of-sequence token (benchmarks do, to fix
    every output's length); ``stop_token`` and ``stop`` still end it. ``cache_salt`` (at
    most 256 characters) keeps the request's prefix-cache blocks apart: it reuses only
    blocks computed for requests with the same salt, as vLLM's ``cache_salt`` does."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop_token: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    stop: list[str] = dataclasses.field(default_factory=list)
    top_logprobs: int = 0
    ignore_eos: bool = False
    cache_salt: str | None = None


@register
@dataclasses.dataclass
class Completion:
    """A finished request. Lists are per generated token (see the module docstring).
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"cancelled"``. Times are seconds from
    submission: ``queue_s`` to admission, ``ttft_s`` to the first token (NaN when none),
    ``latency_s`` to the end; ``steps`` is the number of decode steps it took part in.
    ``top_logprobs`` (when the request asked) maps, per token, the likeliest token ids to
    their log-probs; ``text`` (for a request with stop strings) is the output's text up to
    the stop string; ``stop_reason`` is the stop token or string that ended it."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    versions: list[int]
    version: int
    finish_reason: str
    queue_s: float
    ttft_s: float
    latency_s: float
    steps: int
    top_logprobs: list[dict[int, float]] | None = None
    text: str | None = None
    stop_reason: int | str | None = None


@register
@dataclasses.dataclass
class TokenDelta:
    """The tokens a streamed request was given since the last :class:`Updates`, with their
    log-probs (and the likeliest tokens' when asked). ``finish_reason`` is ``None`` while it
    runs, then ``"stop"``, ``"length"``, ``"cancelled"`` or ``"dropped"`` (the generator was
    reset); ``text`` and ``stop_reason`` are the completion's, in the last delta."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    id: str
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    text: str | None = None
    stop_reason: int | str | None = None


@register
@dataclasses.dataclass
class Updates:
    """What one reader of a generator's streams is told at once (``Generator.updates``):
    the new tokens of its requests, the prefix cache's block events since the last call
    (``("stored" | "removed" | "cleared", hashes)`` in order), and the load: ``waiting`` and
    ``running`` requests and, on the paged engine, ``prefill_blocks`` (prompt blocks still to
    compute) and ``decode_blocks`` (held by decoding sequences). ``block_size`` and
    ``extra_keys`` are what the engine's block hashes carry (``0`` and ``[]`` without a
    prefix cache); ``metrics`` its counters under vLLM's names."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    deltas: list[TokenDelta]
    events: list[tuple[str, list[bytes]]]
    waiting: int
    running: int
    prefill_blocks: int
    decode_blocks: int
    block_size: int
    extra_keys: list[Any]
    metrics: dict[str, float]


@register
@dataclasses.dataclass
class EngineStats:
    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    version: int
    paused: bool
    waiting: int
    running: int
    finished: int
    steps: int
    tokens: int
    #: seconds spent inside step() doing work, and tokens per such second
    busy_s: float
    tokens_per_s: float
    mean_batch: float


def as_request(r: Any) -> Request:
    if isinstance(r, Request):
        return r
    if isinstance(r, dict):
        return Request(**r)
    raise TypeError(f"a request is a Request or a dict of its fields, got {type(r).__name__}")


@register
@dataclasses.dataclass(frozen=True)
class Handoff:
    """A prompt's KV held by a prefill generator for a decode generator to read
    (``Generator.prefill``): ``lease`` (``0``: nothing held, the reader computes the prompt),
    ``buffer`` (read-only, over the held blocks of the prefill generator's pool, revoked
    when the lease ends; ``None`` without a lease), the blocks' ids and ``keys``, the pool's
    layout (``planes`` per block, ``plane_bytes`` a plane, ``row_bytes`` a block's row in a
    plane), the prompt ``tokens`` held, the lease's ``ttl`` in seconds and the weights
    ``version`` the blocks were computed under. ``stream``: granted before the prompt ran,
    its blocks read layer by layer as they are computed. ``source`` is the prefill
    generator's one-actor mesh, which the caller adds (:meth:`sent_from`) before handing the
    handoff on."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    lease: int
    buffer: Buffer | None
    blocks: list[int]
    keys: list[bytes]
    planes: int
    plane_bytes: int
    row_bytes: int
    tokens: int
    ttl: float
    version: int
    stream: bool = False
    source: Any = None

    def sent_from(self, source: Any) -> Handoff:
        """This handoff, naming ``source`` (the prefill generator's one-actor mesh)."""
        return dataclasses.replace(self, source=source)


_HANDOFF_FIELDS = frozenset(f.name for f in dataclasses.fields(Handoff))
_HANDOFF_NEEDED = frozenset(
    f.name for f in dataclasses.fields(Handoff) if f.default is dataclasses.MISSING
)


def as_handoff(h: Any) -> Handoff:
    """``h`` as a :class:`Handoff`: one already, or a dict of its fields, the form this
    release still reads (deprecated: the next one takes only a :class:`Handoff`). Raises
    ``TypeError`` for anything else and ``ValueError`` for a dict with fields missing or
    unknown."""
    if isinstance(h, Handoff):
        return h
    if not isinstance(h, dict):
        raise TypeError(f"a handoff is a Handoff (Generator.prefill's), got {type(h).__name__}")
    missing, unknown = sorted(_HANDOFF_NEEDED - set(h)), sorted(set(h) - _HANDOFF_FIELDS)
    if missing or unknown:
        raise ValueError(f"a handoff dict lacks {missing} or has unknown {unknown}")
    warnings.warn(
        "a handoff given as a dict is deprecated: pass the Handoff that prefill returns "
        "(handoff.sent_from(mesh) instead of {**handoff, 'source': mesh})",
        DeprecationWarning,
        stacklevel=3,
    )
    return Handoff(**h)
