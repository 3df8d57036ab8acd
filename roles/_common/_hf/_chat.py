"""A checkpoint's chat template, rendered with Jinja2 in its immutable sandbox and under limits.

The sandbox keeps a template away from Python's internals; the limits keep one from running
or growing without end (a checkpoint's author writes the template, and a request's messages
feed it). Each limit is a keyword of :class:`ChatTemplate`; the defaults:

- source: :data:`MAX_SOURCE_BYTES` (1 MiB of UTF-8). A longer template is refused at load.
- steps: every iteration of a ``{% for %}`` loop (over anything: ``range``, a string, a list;
  the levels of a recursive loop too) and every call (macros, methods, ``range``,
  ``loop(...)``) is a step; :data:`MAX_STEPS` (1,000,000) per render. The ChatML template
  of ``make_tiny`` takes one step per message.
- time: :data:`MAX_SECONDS` (2 s) of wall-clock time per render, checked at every step and
  after every piece of output.
- size: the output, and every string, list or tuple built by ``+``, ``*`` or ``~``, at most
  :data:`MAX_CHARS` (32 Mi) characters or items (twice the largest request body the front
  door reads, so any request's messages fit); integers built by ``*`` or ``**`` at most :data:`MAX_INT_BITS`
  bits. These are checked before the value is built.

A render past a limit raises ``ValueError`` naming the limit; the template is left as it was
and the next render starts afresh. Between two steps a template runs only straight-line code
(no longer than its source) and the filters in it, so the time check comes back soon, with
one exception: a filter or method given a huge size argument (``'' | center(10 ** 9)``)
builds its result before any check sees it. Treat a checkpoint from a source you do not
trust as code.

The hooks cost about 2.5 us per message on top of Jinja2's own 0.5 us with the ChatML
template (1,000 messages: 2.9 ms against 0.45 ms, best of 3 x 20 renders on a shared 2-core
machine).

Rendering is synchronous and CPU-bound: it blocks its thread for up to the time limit. It is
safe to render one template from several threads at once (each render's budget lives in its
own context).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.runtime import Context, LoopContext
from jinja2.visitor import NodeTransformer

import orchestr as oc

__all__ = [
    "MAX_CHARS",
    "MAX_INT_BITS",
    "MAX_SECONDS",
    "MAX_SOURCE_BYTES",
    "MAX_STEPS",
    "ChatTemplate",
]

MAX_SOURCE_BYTES = 1 << 20
MAX_STEPS = 1_000_000
MAX_SECONDS = 2.0
MAX_CHARS = 32 << 20
MAX_INT_BITS = 1 << 14


class _Budget:
    """One render's steps left and deadline."""

    __slots__ = ("deadline", "max_seconds", "max_steps", "steps")

    def __init__(self, max_steps: int, max_seconds: float) -> None:
        self.max_steps, self.max_seconds = max_steps, max_seconds
        self.steps = max_steps
        self.deadline = time.monotonic() + max_seconds

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise ValueError(
                f"the chat template ran past its limit of {self.max_steps:,} steps (loop "
                f"iterations and calls) in one render"
            )
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ValueError(
                f"the chat template ran past its time limit of {self.max_seconds:g} s in one render"
            )


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


#: What ``+`` and ``*`` make longer copies of.
_SIZED = (str, list, tuple)


class _LimitedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox with the hooks the limits need: ``call`` counts steps, the intercepted
    operators check sizes, and :meth:`counted` and :meth:`join_text` are what the rewritten
    loops and ``~`` call (see :class:`_Bounds`)."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.max_chars = max_chars
        self.globals["raise_exception"] = _raise

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _BUDGET.get().step()
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (self.counted(args[0]), *args[1:])
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        size = bits = 0
        if operator == "+":
            if isinstance(left, _SIZED) and isinstance(right, _SIZED):
                size = len(left) + len(right)
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                bits = left.bit_length() + right.bit_length()
            elif isinstance(left, _SIZED) and isinstance(right, int):
                size = len(left) * right
            elif isinstance(left, int) and isinstance(right, _SIZED):
                size = left * len(right)
        elif isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = left.bit_length() * right  # "**"
        if size > self.max_chars:
            self._refuse_items(size, operator)
        if bits > MAX_INT_BITS:
            raise ValueError(
                f"the chat template would build a number of about {bits:,} bits with "
                f"'{operator}', over the limit of {MAX_INT_BITS:,}"
            )
        return self.binop_table[operator](left, right)

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable``'s items, one step each."""
        budget = _BUDGET.get()
        for item in iterable:
            budget.step()
            yield item

    def join_text(self, items: list[Any]) -> str:
        """What ``a ~ b ~ ...`` gives, refused before joining when it would be too long."""
        parts = [str(item) for item in items]
        if (size := sum(map(len, parts))) > self.max_chars:
            self._refuse_items(size, "~")
        return "".join(parts)

    def _refuse_items(self, size: int, operator: str) -> None:
        raise ValueError(
            f"the chat template would build a value of {size:,} characters or items with "
            f"'{operator}', over the limit of {self.max_chars:,}"
        )


def _hook(name: str, arg: nodes.Expr, lineno: int) -> nodes.Call:
    func = nodes.EnvironmentAttribute(name, lineno=lineno)
    return nodes.Call(func, [arg], [], None, None, lineno=lineno)


class _Bounds(NodeTransformer):
    """Rewrites a parsed template so that every loop iterates through
    :meth:`_LimitedEnvironment.counted` and every ``~`` joins through
    :meth:`_LimitedEnvironment.join_text`. The names are environment attributes, which a
    template can neither see nor shadow."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        assert isinstance(node.iter, nodes.Expr)  # what the parser makes of a loop's iterable
        node.iter = _hook("counted", node.iter, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _hook("join_text", nodes.List(node.nodes, lineno=node.lineno), node.lineno)


class ChatTemplate:
    """A chat template compiled once, rendered under the limits the module's docstring
    describes. Raises :class:`ConfigError` at construction for a template over
    ``max_source_bytes`` or one Jinja2 cannot parse; ``where`` (the file it came from) starts
    those messages."""

    def __init__(
        self,
        source: str,
        *,
        where: str = "chat_template",
        max_source_bytes: int = MAX_SOURCE_BYTES,
        max_steps: int = MAX_STEPS,
        max_seconds: float = MAX_SECONDS,
        max_chars: int = MAX_CHARS,
    ) -> None:
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > max_source_bytes:
            raise oc.ConfigError(
                f"{where}: the chat template is {size:,} bytes, over the limit of "
                f"{max_source_bytes:,}; chat templates of real models are a few KiB, so this "
                f"checkpoint's tokenizer_config.json needs a look"
            )
        self.max_steps, self.max_seconds, self.max_chars = max_steps, max_seconds, max_chars
        env = _LimitedEnvironment(max_chars)
        try:
            tree = _Bounds().visit(env.parse(source))
            tree.set_environment(env)
            self._template = env.from_string(tree)
        except jinja2.TemplateError as exc:
            raise oc.ConfigError(f"{where}: bad chat_template: {exc}") from None
        except RecursionError:
            raise oc.ConfigError(f"{where}: the chat template nests too deeply") from None

    def render(self, **variables: Any) -> str:
        """The template's text for ``variables``. Raises ``ValueError`` when the render passes
        a limit or recurses too deeply, and :class:`ConfigError` when the template fails
        (``raise_exception``, a sandbox violation, a bad expression). Blocks its thread for
        at most the time limit, plus what runs between two checks (see the module's
        docstring); idempotent."""
        budget = _Budget(self.max_steps, self.max_seconds)
        token = _BUDGET.set(budget)
        stream = self._template.generate(**variables)
        chunks: list[str] = []
        size = 0
        try:
            for chunk in stream:
                size += len(chunk)
                if size > self.max_chars:
                    raise ValueError(
                        f"the chat template's output passed its limit of {self.max_chars:,} "
                        f"characters"
                    )
                budget.check_time()
                chunks.append(chunk)
        except RecursionError:
            raise ValueError("the chat template recursed too deeply") from None
        except jinja2.TemplateError as exc:
            raise oc.ConfigError(f"chat template failed: {exc}") from None
        finally:
            if isinstance(stream, Generator):
                stream.close()
            _BUDGET.reset(token)
        return "".join(chunks)
