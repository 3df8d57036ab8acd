"""orchestr.roles.models: Hugging Face format checkpoints in orchestr's own torch modules.

- :func:`load_model` reads a local folder (``config.json``, safetensors weights, one file or
  sharded) into a :class:`CausalLM` of the ``llama``, ``qwen2`` or ``qwen2_moe`` (mixture of
  experts) family; a config orchestr cannot run or weights that do not match it raise
  :class:`orchestr.ConfigError` naming the file and the tensor. Nothing is ever downloaded.
- :func:`load_reward_model` reads a reward model (a one-label
  ``LlamaForSequenceClassification`` or ``Qwen2ForSequenceClassification`` checkpoint) into a
  :class:`RewardModel`: the same decoder and a score head; :meth:`RewardModel.score` gives one
  float per token sequence (the ``Reward`` role's ``model=``).
- :class:`Tokenizer` encodes, decodes and renders the checkpoint's chat template.
- :func:`make_tiny` writes a small random checkpoint of a family, with a tokenizer trained on
  text it generates (``orchestr model make-tiny``).
- :func:`export_checkpoint` writes a model (trained) back out as a Hugging Face folder that
  ``transformers`` and ``orchestr serve`` load.

The modules are cut along the lines the serving roles need: each layer's :class:`Attention`
and :class:`MLP` (or :class:`SparseMoE`: routing, experts, shared expert) take explicit
inputs, so they can run apart.
"""

from .._common._hf._config import ModelConfig, MoEConfig, RopeScaling, read_config
from .._common._hf._export import export_checkpoint
from .._common._hf._layers import MLP, Attention, CausalLM, DecoderLayer, SparseMoE
from .._common._hf._load import load_model
from .._common._hf._scorer import RewardModel, load_reward_model
from .._common._hf._tiny import ARCHS, make_tiny
from .._common._hf._tokenizer import Tokenizer

__all__ = [
    "ARCHS",
    "MLP",
    "Attention",
    "CausalLM",
    "DecoderLayer",
    "MoEConfig",
    "ModelConfig",
    "RewardModel",
    "RopeScaling",
    "SparseMoE",
    "Tokenizer",
    "export_checkpoint",
    "load_model",
    "load_reward_model",
    "make_tiny",
    "read_config",
]
