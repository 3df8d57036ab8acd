"""Tiny checkpoints of each family, made locally (nothing is downloaded): a Hugging Face format
folder with ``config.json``, safetensors weights (random init; sharded on request),
``tokenizer.json`` (a byte-level BPE trained with the ``tokenizers`` library on text this
module generates) and ``tokenizer_config.json`` with a ChatML chat template. Tests, examples
and benchmarks use them; ``orchestr model make-tiny`` is the command. The folder is written as
:mod:`._folder` says: never through a link, never into a folder another user could change."""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

import orchestr as oc

from ._config import FAMILIES, ModelConfig
from ._folder import CheckpointFolder
from ._layers import CausalLM

__all__ = ["ARCHS", "CHAT_TEMPLATE", "DIGIT_TOKENS", "SPECIAL_TOKENS", "TOKENIZERS", "make_tiny"]

ARCHS = tuple(FAMILIES)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
#: The ``digits`` tokenizer's whole vocabulary, in id order: each digit is its own id, then the
#: digit tasks' markers (begin, separator, end, padding, and a filler for fixed-width fields).
DIGIT_TOKENS = [*"0123456789", "<s>", "<sep>", "</s>", "<pad>", "_"]
#: ``bpe``: byte-level BPE trained on generated text; ``digits``: :data:`DIGIT_TOKENS` only.
TOKENIZERS = ("bpe", "digits")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS = (
    "the a model token layer block cache prefix request reply reverse digits of number and "
    "to in is what please user assistant system you answer short long first last train serve"
).split()
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


def corpus(seed: int, lines: int = 3000) -> list[str]:
    """Text to train the tokenizer on: digit strings and their reversals, short sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        digits = " ".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 12)))
        out.append(f"reverse {digits} -> {' '.join(reversed(digits.split()))}")
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) + ".")
    return out


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    """A byte-level BPE pre-tokenized as Qwen2's and Llama 3's are: NFC, then a regex split
    (contractions, letter runs, single digits, punctuation, whitespace), then bytes."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def digit_tokenizer() -> Tokenizer:
    """A word-level tokenizer over :data:`DIGIT_TOKENS`: every character is a token except the
    markers, which are special; no text outside that vocabulary encodes (an error names the
    piece). Decoding joins the tokens with nothing between them."""
    vocab = {t: i for i, t in enumerate(DIGIT_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens([t for t in DIGIT_TOKENS if t.startswith("<")])
    tok.decoder = decoders.Fuse()
    return tok


def make_tiny(
    arch: str,
    folder: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    rope_theta: float = 10000.0,
    tie: bool | None = None,
    shards: int = 1,
    experts: int = 4,
    experts_per_token: int = 2,
    seed: int = 0,
    tokenizer: str = "bpe",
    init_std: float = 0.05,
    max_positions: int = 4096,
    force: bool = False,
) -> str:
    """Write a randomly initialised ``arch`` checkpoint (``llama``, ``qwen2`` or
    ``qwen2_moe``) to ``folder`` and return its path. The folder is made (mode 0755) when
    missing; an existing one must be empty unless ``force``, which replaces the checkpoint
    files in it and keeps other files. Even with ``force``, a folder that is a symbolic link,
    belongs to another user or is writable by other users is refused. Files are created new
    (never through a link), mode 0644. Qwen2 ties its embeddings unless ``tie`` says
    otherwise; ``shards`` > 1 splits the weights into that many files with an index.
    ``qwen2_moe`` has ``experts`` routed experts of width ``intermediate`` (default
    ``hidden``), ``experts_per_token`` of them per token, and a shared expert twice as wide.
    ``tokenizer`` is ``bpe`` (``vocab`` entries, a ChatML chat template; ``<|im_end|>`` ends
    a turn) or ``digits`` (:data:`DIGIT_TOKENS`, for the digit tasks of
    :mod:`orchestr.roles.rl`; ``</s>`` ends; ``vocab`` is ignored). Weight matrices are
    drawn with standard deviation ``init_std``, norms near 1. Raises :class:`ConfigError`
    for a bad argument or a folder it must not write into; on any error, what it wrote is
    removed (and the folder, when it made it)."""
    if arch not in ARCHS:
        raise oc.ConfigError(f"unknown arch {arch!r}; use one of {', '.join(ARCHS)}")
    if tokenizer not in TOKENIZERS:
        raise oc.ConfigError(f"unknown tokenizer {tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
    if not 0.0 < init_std < 1.0 or max_positions < 1:
        raise oc.ConfigError(
            f"init_std must be in (0, 1) and max_positions at least 1, got {init_std} and "
            f"{max_positions}"
        )
    if shards < 1:
        raise oc.ConfigError(f"shards must be at least 1, got {shards}")
    with CheckpointFolder(folder, force=force) as out:  # checked before the slow part
        digits = tokenizer == "digits"
        tok = digit_tokenizer() if digits else train_tokenizer(vocab, seed)
        eos = "</s>" if digits else "<|im_end|>"
        raw = {
            "architectures": [_CLASSES[arch]],
            "model_type": arch,
            "vocab_size": tok.get_vocab_size(),
            "hidden_size": hidden,
            "intermediate_size": intermediate or 2 * hidden + hidden // 2,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hidden // heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": rope_theta,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": arch == "qwen2" if tie is None else tie,
            "bos_token_id": tok.token_to_id("<s>"),
            "eos_token_id": tok.token_to_id(eos),
            "pad_token_id": tok.token_to_id("<pad>"),
            "torch_dtype": "float32",
        }
        if arch == "qwen2_moe":
            raw["intermediate_size"] = 2 * hidden + hidden // 2  # the dense layers' width
            raw |= {
                "num_experts": experts,
                "num_experts_per_tok": experts_per_token,
                "moe_intermediate_size": intermediate or hidden,
                "shared_expert_intermediate_size": 2 * hidden,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        cfg = ModelConfig.from_dict(raw)  # checks the sizes
        torch.manual_seed(seed)
        model = CausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                elif name.endswith("mlp.gate.weight"):  # a router: decisive, rarely near a tie
                    p.normal_(0.0, 0.5)
                else:
                    p.normal_(0.0, init_std)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            del state["lm_head.weight"]
        _save(state, out, shards)
        out.write("config.json", _json(raw))
        out.write("tokenizer.json", tok.to_str(pretty=True).encode())
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": eos,
            "pad_token": "<pad>",
            "model_max_length": max_positions,
        }
        if not digits:
            tok_config["chat_template"] = CHAT_TEMPLATE
        out.write("tokenizer_config.json", _json(tok_config))
    return out.path


def _json(value: object) -> bytes:
    return json.dumps(value, indent=2).encode()


def _save(state: dict[str, torch.Tensor], out: CheckpointFolder, shards: int) -> None:
    if shards == 1:
        out.write("model.safetensors", save(state, metadata={"format": "pt"}))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        out.write(file, save({n: state[n] for n in part}, {"format": "pt"}))
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    out.write("model.safetensors.index.json", _json(index))
