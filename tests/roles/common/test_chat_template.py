"""A checkpoint's chat template renders as Jinja2's sandbox renders it, but under limits: a
source over 1 MiB is refused at load; a render stops at its step budget (loop iterations and
calls), its time limit and its output size, and values built by ``+``, ``*``, ``**`` and ``~``
are checked before they are built."""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any

import jinja2.sandbox
import pytest

import orchestr as oc
from orchestr.roles import models
from orchestr.roles._common._hf._chat import MAX_SOURCE_BYTES, ChatTemplate
from orchestr.roles._common._hf._tiny import CHAT_TEMPLATE

MESSAGES = [
    {"role": "system", "content": "reverse the digits"},
    {"role": "user", "content": "1 2 3"},
    {"role": "assistant", "content": "3 2 1"},
]
#: What real chat templates use: namespace, loop.last/index, ~ and +, a macro, a recursive
#: loop, a filter test, slicing, tojson, raise_exception behind a condition.
TEMPLATES = [
    CHAT_TEMPLATE,
    "{% set ns = namespace(system='') %}"
    "{% for m in messages if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}"
    "{% endfor %}{{ bos_token ~ '[' ~ ns.system | upper ~ ']' }}"
    "{% for m in messages[1:] %}{{ loop.index ~ ':' ~ m.role ~ '=' ~ m.content | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}"
    "{% if messages | length > 99 %}{{ raise_exception('too long') }}{% endif %}",
    "{% macro show(m, depth) %}{{ ' ' * depth ~ m.role }}{% endmacro %}"
    "{% for m in messages %}{{ show(m, loop.index0) }}\n{% endfor %}"
    "{% for item in tree recursive %}<{{ item.name }}{{ loop(item.kids) if item.kids }}>"
    "{% endfor %}{{ (2 ** 10) * 3 }} {{ [1, 2] + [3] }} {{ 'ab' * 3 }}",
]
TREE = [{"name": "a", "kids": [{"name": "b", "kids": [{"name": "c", "kids": []}]}]}]


def render(source: str, **limits: Any) -> str:
    return ChatTemplate(source, **limits).render(messages=MESSAGES, bos_token="<s>", tree=TREE)


@pytest.mark.parametrize("source", TEMPLATES)
def test_a_normal_template_renders_as_the_plain_sandbox_does(source: str) -> None:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(source).render(messages=MESSAGES, bos_token="<s>", tree=TREE)
    assert render(source) == want and want


@pytest.mark.timeout(30)
def test_nested_range_loops_stop_at_the_step_budget() -> None:
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match=r"limit of 1,000,000 steps|time limit of 2 s"):
        render(nested)  # 10^10 iterations without the budget
    with pytest.raises(ValueError, match="limit of 1,000 steps"):
        render(nested, max_steps=1000)
    # not only range: iterating a string, and a recursive loop's levels, are steps too
    strings = "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match="limit of 1,000 steps"):
        render(strings, max_steps=1000)
    deep = (
        "{% for x in tree recursive %}{% if x is mapping %}{{ loop('y' * 5000) }}{% endif %}"
        "{% endfor %}"
    )
    with pytest.raises(ValueError, match="limit of 1,000 steps"):
        render(deep, max_steps=1000)
    macro = (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    )
    with pytest.raises(ValueError, match="limit of 1,000 steps"):
        render(macro, max_steps=1000)


@pytest.mark.timeout(30)
def test_a_slow_render_stops_at_the_time_limit() -> None:
    # few steps, each slow: the step budget alone would let it run for many minutes
    slow = "{% for i in range(100000) %}{{ range(100000) | join(',') | length }}{% endfor %}"
    with pytest.raises(ValueError, match=r"time limit of 0.2 s"):
        render(slow, max_seconds=0.2)


def test_output_and_values_over_the_size_limit_fail() -> None:
    many = "{% for i in range(100) %}{{ 'x' * 400000 }}{% endfor %}"  # 40M characters
    with pytest.raises(ValueError, match="output passed its limit of 33,554,432 characters"):
        render(many)
    assert len(render(many, max_chars=50_000_000)) == 40_000_000
    with pytest.raises(ValueError, match=r"100,000,000 characters or items with '\*'"):
        render("{{ 'x' * 100000000 }}")
    for op in ("~", "+"):  # doubling a string 64 times stops at the limit, not at 2^64
        double = (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
            f"{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}{{{{ ns.s | length }}}}"
        )
        with pytest.raises(ValueError, match=f"67,108,864 characters or items with '\\{op}'"):
            render(double)
    with pytest.raises(ValueError, match=r"bits with '\*\*', over the limit of 16,384"):
        render("{{ 7 ** 1000000 }}")
    with pytest.raises(ValueError, match=r"bits with '\*', over the limit"):
        render("{% set n = 2 ** 8000 %}{{ n * n * n }}")


def test_recursion_without_end_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="recursed too deeply"):
        render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")


def test_a_template_over_the_source_limit_is_refused_at_load(tmp_path: pathlib.Path) -> None:
    folder = pathlib.Path(models.make_tiny("llama", tmp_path / "m", tokenizer="digits"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    padding = "{# " + "x" * MAX_SOURCE_BYTES + " #}"
    config["chat_template"] = CHAT_TEMPLATE + padding
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        oc.ConfigError, match=r"tokenizer_config.json: the chat template is .* over"
    ):
        models.Tokenizer(folder)
    with pytest.raises(oc.ConfigError, match="nests too deeply"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    config["chat_template"] = 42
    config_path.write_text(json.dumps(config))
    with pytest.raises(oc.ConfigError, match="chat_template must be a string"):
        models.Tokenizer(folder)


@pytest.mark.timeout(30)
def test_the_tokenizer_renders_under_the_limits(tmp_path: pathlib.Path) -> None:
    folder = pathlib.Path(models.make_tiny("llama", tmp_path / "m", tokenizer="digits"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% if messages[0].content == 'spin' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + CHAT_TEMPLATE
    )
    config_path.write_text(json.dumps(config))
    tok = models.Tokenizer(folder)
    spin = [{"role": "user", "content": "spin"}]
    with pytest.raises(ValueError, match="steps|time limit") as info:
        tok.apply_chat_template(spin)
    assert not isinstance(info.value, oc.ConfigError)  # the request's doing, not the config's
    # each render has its own budget, in each thread
    want = "<|im_start|>user\n1 2<|im_end|>\n<|im_start|>assistant\n"
    got: list[str] = []

    def chat() -> None:
        got.append(
            tok.apply_chat_template(
                [{"role": "user", "content": "1 2"}], add_generation_prompt=True
            )
        )

    threads = [threading.Thread(target=chat) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4
