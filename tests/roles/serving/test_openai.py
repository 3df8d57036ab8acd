"""OpenAI request bodies checked (sans-IO): what is accepted, what each refusal names, and the
text of a choice shown as its tokens arrive."""

from __future__ import annotations

from typing import Any

import pytest

from orchestr.roles.serving._answers import ChoiceText, finish_reason
from orchestr.roles.serving._openai import APIError, chat_request, completion_request


class FakeModel:
    """A model of one-character tokens: token ``i`` is ``chr(32 + i)``."""

    names = ("tiny", "alias")
    aliases = frozenset(names)
    max_len = 64
    vocab_size = 96
    max_prompt_chars = 64  # one character a token

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        if "\n" in text:
            raise ValueError("cannot spell a newline")
        return ([0] if special else []) + [ord(c) - 32 for c in text]

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("no tool role in this template")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


MODEL = FakeModel()


def test_a_completion_with_vllm_bench_fields_is_accepted() -> None:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "some_field_nobody_knows": [1, 2],
    }
    job = completion_request(body, MODEL)
    assert job.prompts == [[0, *(ord(c) - 32 for c in "hello")]]
    assert job.params == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": None,
        "stop": [],
        "ignore_eos": True,
        "max_new_tokens": 8,
        "top_logprobs": 0,
    }
    assert job.stream and job.include_usage and job.logprobs is None
    assert job.id.startswith("cmpl-")


def test_prompt_shapes_and_choice_seeds() -> None:
    job = completion_request(
        {"model": "alias", "prompt": [[1, 2], [3]], "n": 3, "seed": 7, "stop": "x"}, MODEL
    )
    assert job.prompts == [[1, 2], [3]] and job.n == 3
    assert [job.choice_params(i)["seed"] for i in range(6)] == [7, 8, 9, 7, 8, 9]
    assert job.params["stop"] == ["x"]
    assert completion_request({"model": "tiny", "prompt": [5, 6]}, MODEL).prompts == [[5, 6]]
    assert completion_request({"model": "tiny", "prompt": ["a", "b"]}, MODEL).prompts == [
        [0, 65],
        [0, 66],
    ]
    # without a model, the one served (as vLLM does)
    assert completion_request({"prompt": "a"}, MODEL).model == "tiny"
    # a batch of more strings than the context has tokens: each is a prompt, not a token
    many = completion_request({"prompt": ["a"] * 100, "max_tokens": 1}, MODEL)
    assert len(many.prompts) == 100
    # a prompt of token ids longer than the context is refused before its ids are checked
    with pytest.raises(APIError, match="context length is 64 tokens"):
        completion_request({"prompt": [1] * 65}, MODEL)


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ([1, 2], None, "must be a JSON object"),
        ({"model": "gpt-4", "prompt": "a"}, "model", "does not exist"),
        ({"model": "tiny"}, "prompt", "'prompt' must be"),
        (
            {"model": "tiny", "prompt": "", "add_special_tokens": False},
            "prompt",
            "at least one token",
        ),
        ({"model": "tiny", "prompt": [1, 500]}, "prompt", "outside the vocabulary"),
        ({"model": "tiny", "prompt": [[1], "a"]}, "prompt", "'prompt' must be"),
        ({"model": "tiny", "prompt": "a\nb"}, "prompt", "cannot spell"),
        ({"model": "tiny", "prompt": "a", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"model": "tiny", "prompt": "a", "max_tokens": -3}, "max_tokens", "at least 1"),
        ({"model": "tiny", "prompt": "a", "max_tokens": "8"}, "max_tokens", "integer"),
        (
            {"model": "tiny", "prompt": "a", "max_tokens": 64},
            "max_tokens",
            "maximum context length is 64",
        ),
        ({"model": "tiny", "prompt": "a" * 70}, "prompt", "maximum context length"),
        ({"model": "tiny", "prompt": "a", "temperature": -1}, "temperature", "from 0.0 to 2.0"),
        ({"model": "tiny", "prompt": "a", "temperature": "hot"}, "temperature", "number"),
        ({"model": "tiny", "prompt": "a", "top_p": 0}, "top_p", "greater than 0"),
        ({"model": "tiny", "prompt": "a", "n": 0}, "n", "from 1 to 128"),
        ({"model": "tiny", "prompt": "a", "n": True}, "n", "integer"),
        ({"model": "tiny", "prompt": "a", "logprobs": 21}, "logprobs", "from 0 to 20"),
        ({"model": "tiny", "prompt": "a", "stop": [1]}, "stop", "list of strings"),
        ({"model": "tiny", "prompt": "a", "seed": 2**70}, "seed", "64-bit"),
        ({"model": "tiny", "prompt": "a", "stream": "yes"}, "stream", "true or false"),
        (
            {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed",
        ),
        (
            {"model": "tiny", "prompt": "a", "repetition_penalty": 1.2},
            "repetition_penalty",
            "not supported",
        ),
        ({"model": "tiny", "prompt": "a", "echo": True}, "echo", "not supported"),
        ({"model": "tiny", "prompt": "a", "best_of": 3}, "best_of", "not supported"),
        (
            {"model": "tiny", "prompt": "a", "presence_penalty": 0.5},
            "presence_penalty",
            "not supported",
        ),
    ],
)
def test_bad_completions_are_refused_naming_the_field(
    body: Any, param: str | None, text: str
) -> None:
    with pytest.raises(APIError) as info:
        completion_request(body, MODEL)
    err = info.value
    assert err.status == 400 and text in err.message
    assert err.body() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": err.code,
        }
    }


def test_chat_renders_the_template_and_sizes_the_completion() -> None:
    job = chat_request(
        {
            "model": "tiny",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "logprobs": True,
            "top_logprobs": 2,
        },
        MODEL,
    )
    text = "<system>be brief<user>hi<assistant>"
    assert job.prompts == [[ord(c) - 32 for c in text]]
    # no max_tokens: the rest of the context
    assert job.params["max_new_tokens"] == MODEL.max_len - len(text)
    assert job.logprobs == 2 and job.params["top_logprobs"] == 2 and job.id.startswith("chatcmpl-")
    job = chat_request(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5,
            "max_tokens": 9,
        },
        MODEL,
    )
    assert job.params["max_new_tokens"] == 5 and job.logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0]"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 0,
            },
            "max_completion_tokens",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            "tools",
        ),
    ],
)
def test_bad_chats_are_refused_naming_the_field(body: Any, param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_request(body, MODEL)
    assert info.value.status == 400 and info.value.param == param


def test_choice_text_holds_back_what_may_start_a_stop_string() -> None:
    def decode(tokens: list[int]) -> str:
        return "".join(chr(32 + t) for t in tokens)

    def ids(text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    text = ChoiceText(decode, ["END", "x"])
    shown = [text.push(ids(c)) for c in "abcdEN"]
    assert "".join(shown) == "abcd"  # "EN" may begin "END"
    # the last token completes the stop string; the engine cut the completion before it
    assert text.finish(ids("D"), "abcd") == ""
    text = ChoiceText(decode, ["END", "x"])
    assert "".join(text.push(ids(c)) for c in "abE") + text.finish(ids("x"), "abE") == "abE"
    text = ChoiceText(decode, ["END"])
    assert "".join(text.push(ids(c)) for c in "abENx") + text.finish(ids("y"), None) == "abENxy"
    # a whole answer: every token at the end
    assert ChoiceText(decode, ["END"]).finish(ids("abcdEND"), "abcd") == "abcd"
    # a character split over tokens is held until it is whole
    text = ChoiceText(lambda tokens: bytes(tokens).decode(errors="replace"), [])
    assert [text.push([97]), text.push([0xC3]), text.push([0xA9])] == ["a", "", "\u00e9"]


def test_finish_reasons_read_as_openai_and_vllm_say() -> None:
    assert [finish_reason(r) for r in (None, "stop", "length", "cancelled", "dropped")] == [
        None,
        "stop",
        "length",
        "abort",
        "abort",
    ]
