"""Step-time profiles of accelerators nobody here can time, from published figures.

:func:`roofline` turns an accelerator's peak dense throughput and memory bandwidth, the share
of each a serving engine reaches, and a model's shape into a
:class:`~._generation.StepTimeModel` (the same terms :func:`~._calibrate.calibrate` fits here):

- ``base_s``: one read of the weights per step, at ``mbu`` of the memory bandwidth;
- ``prefill_token_s`` and ``decode_s``: a token's dense work (2 FLOPs per parameter) at
  ``mfu`` of the peak;
- ``prefill_attention_s``: a (query, key) pair's score and value products (4 FLOPs per head
  dimension per query head per layer) at ``mfu``;
- ``decode_attention_s``: a decode reads one cached token's keys and values per pair, at
  ``mbu``.

The terms add, where a roofline would take the larger of compute and memory time: a step
mixing both is charged somewhat more than a perfectly overlapped kernel would take. The
figures below are the vendors' and the model cards' (say which in ``machine``); ``mfu`` 0.5
and ``mbu`` 0.8 are what well-tuned engines are reported to reach, an assumption, not a
measurement.
"""

from __future__ import annotations

import dataclasses

from ._generation import StepTimeModel

__all__ = ["BUILTIN", "Accelerator", "ModelShape", "roofline"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    dense_flops: float  # peak dense BF16 FLOP/s
    memory_bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


#: NVIDIA's H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s
#: HBM3. The H800 SXM5 has the same compute and memory (only its NVLink is cut to 400 GB/s),
#: so one profile serves both for a model on one accelerator.
H100_SXM = Accelerator("H100/H800 SXM5", 989.4e12, 3.35e12)
#: Meta's Llama 3 8B model card and config: 8.03B parameters, 32 layers, 32 query heads,
#: 8 key-value heads of 128 dimensions.
LLAMA3_8B = ModelShape("Llama-3-8B", 8.03e9, 32, 32, 8, 128)
#: Llama 3 70B (its config): 70.6B parameters, 80 layers, 64 query heads, 8 KV heads of 128.
LLAMA3_70B = ModelShape("Llama-3-70B", 70.6e9, 80, 64, 8, 128)


def roofline(
    acc: Accelerator, model: ModelShape, *, devices: int = 1, mfu: float = 0.5, mbu: float = 0.8
) -> StepTimeModel:
    """The step-time model of ``model`` on ``devices`` of ``acc`` (tensor parallel: compute
    and bandwidth add up; communication is not charged)."""
    if not (0 < mfu <= 1 and 0 < mbu <= 1) or devices < 1:
        raise ValueError(f"mfu and mbu are in (0, 1] and devices >= 1, got {mfu}, {mbu}, {devices}")
    flops = acc.dense_flops * mfu * devices
    memory = acc.memory_bytes_per_s * mbu * devices
    token = 2 * model.params / flops
    return StepTimeModel(
        base_s=model.params * model.dtype_bytes / memory,
        prefill_token_s=token,
        decode_s=token,
        prefill_attention_s=4 * model.layers * model.heads * model.head_dim / flops,
        decode_attention_s=model.kv_bytes_per_token / memory,
        machine=f"{model.name} on {devices} x {acc.name}, roofline at {mfu:.0%} of peak "
        f"FLOP/s and {mbu:.0%} of memory bandwidth (published figures, not measured)",
    )


BUILTIN = {
    "h100-llama3-8b": lambda: roofline(H100_SXM, LLAMA3_8B),
    "h100x8-llama3-70b": lambda: roofline(H100_SXM, LLAMA3_70B, devices=8),
}
