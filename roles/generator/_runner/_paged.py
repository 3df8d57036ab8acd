"""The torch side of the paged engine: one model step over the KV cache (:mod:`._cache`).

:class:`PagedRunner` runs what a :class:`~.._core._scheduler.Step` scheduled:
the new tokens of every sequence packed into one row (no padding), each layer's keys and values
written to their slots, and each sequence's queries attending over its own blocks (positions
``0 ..`` its last new one, causally). It returns float32 logits at the last position of each
sequence that samples. The model is a :class:`orchestr.roles.models.CausalLM`, whose layers'
attention is split into ``project`` / ``core`` so the cache sits between them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, cast

import torch

from orchestr.roles._common._hf._layers import Attention, CausalLM, DecoderLayer

from .._core._scheduler import Step
from ._batch import Batch, causal, tables_of
from ._cache import KVCache
from ._decodes import decode_attention
from ._kernels import Kernels, kernels
from ._linears import Linears
from ._mirror import DecodeMirror
from ._tp import TPGroup, Work, plan

__all__ = ["AttentionMode", "PagedRunner"]

#: How decodes attend: ``"kernel"``, orchestr's paged kernel (:mod:`._kernels`: float32 on
#: the CPU) reading the block pool; ``"torch"``, torch's attention over a
#: :class:`~._mirror.DecodeMirror`; ``"auto"``, the kernel where it runs, else torch.
AttentionMode = Literal["auto", "kernel", "torch"]


class PagedRunner:
    """One model step of a :class:`Step` over a :class:`KVCache`.

    The step's new tokens run packed in one row through the projections and the MLPs. For
    attention, the sequences that compute one token (decodes) are batched into one call:
    orchestr's paged kernel reading their blocks in the pool (``attention="kernel"``), or
    torch's attention over a :class:`~._mirror.DecodeMirror` (``"torch"``: their keys and
    values in dense rows, appended to each step); grouped-query heads are shared, not
    copied. ``"auto"`` (the default) takes the kernel where it runs (float32 on the CPU, and
    built: :func:`~._kernels.kernel_status`). A prefill chunk of several tokens attends on
    its own over its blocks, causally within the chunk. The products run through
    :class:`~._linears.Linears` (packed on the CPU unless ``packed=False``); call
    :meth:`weights_changed` after writing new weights."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        *,
        packed: bool | None = None,
        attention: AttentionMode = "auto",
        group: TPGroup | None = None,
    ) -> None:
        if attention not in ("auto", "kernel", "torch"):
            raise ValueError(f"attention is 'auto', 'kernel' or 'torch', got {attention!r}")
        self.model = model
        self.kv = kv
        #: the tensor-parallel ranks this one runs with (:mod:`._tp`), else ``None``
        self.group = group
        self.linears = Linears(model, packed)
        cfg, keys = model.config, kv.keys[0]
        #: orchestr's kernels where they run (:meth:`_fused`), else ``None`` (torch's ops and
        #: the decode mirror: :meth:`_unfused`)
        self.ops: Kernels | None = None
        if attention != "torch":
            fits = keys.device.type == "cpu" and keys.dtype == torch.float32
            self.ops = kernels() if fits else None
            if attention == "kernel" and self.ops is None:
                why = "it takes float32 on the CPU" if not fits else "it is not built"
                raise ValueError(f"the paged attention kernel cannot run here: {why}")
        self._cos = self._sin = torch.zeros(0, device=keys.device)
        self.offload: Any = None  # long decodes' attention elsewhere (:mod:`._decodes`)
        #: Called ``(step, layer)`` from the step's thread once each layer's keys and values
        #: of the step are in the pool (a streamed handoff: :mod:`.._kv._streamed`), or ``None``.
        self.on_layer: Callable[[Step, int], None] | None = None
        self.mirror = DecodeMirror(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, keys.dtype, keys.device
        )

    def weights_changed(self) -> None:
        self.linears.invalidate()

    @torch.no_grad()
    def run(self, step: Step) -> dict[str, torch.Tensor]:
        """Compute ``step``'s tokens; the logits ``[vocab]`` of each sequence that samples,
        by id. Reads each sequence's ``num_computed`` and ``blocks`` as scheduled (call it
        before :meth:`Scheduler.update`). A tensor-parallel leader (rank 0 of
        :attr:`group`) first sends the work to the other ranks."""
        work = plan(step, self.kv.block_size)
        if self.group is not None and work:
            self.group.send_work(work)
        return self.run_work(work, step)

    @torch.no_grad()
    def run_work(self, work: list[Work], step: Step | None = None) -> dict[str, torch.Tensor]:
        """:meth:`run` of a step's :func:`plan` (a tensor-parallel rank runs the leader's;
        :attr:`on_layer` is called only with the ``step``)."""
        if not work:
            return {}
        model, size = self.model.model, self.kv.block_size
        device = self.kv.keys[0].device
        # decodes first (one token each, batched, in their mirror rows' order), then the
        # prefill chunks
        ones = [w for w in work if w.n == 1]
        if self.ops is None:
            by_seq = {id(w.seq): w for w in ones}
            placed = self.mirror.place([w.seq for w in ones], self.kv.keys, self.kv.values, size)
            ones = [by_seq[id(seq)] for seq in placed]
        ordered = ones + [w for w in work if w.n != 1]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks = []  # (offset, start, n, table) per prefill chunk
        last: dict[str, int] = {}
        for w in ordered:
            start, n = w.seq.num_computed, w.n
            if n > 1:
                table = torch.tensor(w.blocks, dtype=torch.int32, device=device)
                chunks.append((len(tokens), start, n, table))
            tokens += w.tokens
            for p in range(start, start + n):
                positions.append(p)
                slots.append(w.blocks[p // size] * size + p % size)
            if w.samples:
                last[w.seq.id] = len(tokens) - 1
        ids = torch.tensor([tokens], device=device)
        pos = torch.tensor([positions], device=device)
        slot = torch.tensor(slots, device=device)
        lengths = torch.tensor([w.seq.num_computed + 1 for w in ones], device=device)
        longest = int(lengths.max()) if ones else 0
        dtype = self.kv.keys[0].dtype
        if self.ops is not None:
            tables = tables_of([w.seq for w in ones], size, longest, device)
        else:
            # an additive mask: torch's CPU attention takes it at about half the time of a
            # bool one
            past = torch.arange(longest, device=device)[None, :] >= lengths[:, None]
            valid = torch.zeros(past.shape, dtype=dtype, device=device)
            valid = valid.masked_fill(past, float("-inf"))[:, None, None]
        masks = [causal(start, n, dtype, device) for _, start, n, _ in chunks]
        hidden = self._reduce(model.embed_tokens(ids))
        layers = cast(list[DecoderLayer], list(model.layers))
        hook = self.on_layer
        written = None if hook is None or step is None else functools.partial(hook, step)
        keep = list(last.values())
        if self.ops is not None:
            batch = Batch(len(ones), pos[0], slot, tables, lengths, chunks, masks, written, keep)
            final = self._fused(layers, hidden, batch)
        else:
            batch = Batch(
                len(ones), pos, slot, valid, lengths, chunks, masks, written, keep, longest
            )
            final = self._unfused(layers, hidden, batch)
            self.mirror.advance()
        if not last:
            return {}
        normed = final[0] if self.ops is not None else model.norm(final[0])
        logits = self.linears.linear(self.model.lm_head, normed).float()
        if self.group is not None:
            assert self.model.shard is not None
            logits = self.group.gather_vocab(logits, self.model.shard.vocab_sizes)
        return {sid: logits[i] for i, sid in enumerate(last)}

    def _unfused(self, layers: list[DecoderLayer], hidden: torch.Tensor, b: Batch) -> torch.Tensor:
        """The layers on torch's ops, decodes over the mirror: the last hidden states of the
        rows in ``b.keep``."""
        cos, sin = self.model.model.rotary(b.positions)
        for i, (layer, keys, values) in enumerate(
            zip(layers, self.kv.keys, self.kv.values, strict=True)
        ):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q, k, v = attn.project(normed, cos, sin, self.linears.qkv(attn, normed))
            heads = keys.shape[2:]
            flat_k, flat_v = keys.view(-1, *heads), values.view(-1, *heads)
            flat_k[b.slots] = k[0].transpose(0, 1).to(keys.dtype)
            flat_v[b.slots] = v[0].transpose(0, 1).to(values.dtype)
            if b.written is not None:
                b.written(i)
            outs = []
            if b.decodes:
                n = b.decodes
                qq = q[0, :, :n].transpose(0, 1)[:, :, None]  # [n, heads, 1, dim]
                self.mirror.append(i, k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1))
                kk, vv = self.mirror.view(i, b.longest)  # [n, kv_heads, longest, dim]
                core = attn.core(qq, kk.to(q.dtype), vv.to(q.dtype), b.decode_meta)
                outs.append(core.reshape(1, n, -1))
            outs += self._chunks(attn, q, keys, values, b)
            merged = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            if i == len(layers) - 1:  # only the rows that sample go on
                rows = torch.tensor(b.keep, dtype=torch.long, device=hidden.device)
                merged, hidden = merged[:, rows], hidden[:, rows]
            hidden = hidden + self._reduce(self.linears.linear(attn.o_proj, merged))
            mlp = self.linears.mlp(layer.mlp, layer.post_attention_layernorm(hidden))
            hidden = hidden + self._reduce(mlp)
        return hidden

    def _fused(self, layers: list[DecoderLayer], hidden: torch.Tensor, b: Batch) -> torch.Tensor:
        """The layers on orchestr's kernels (:mod:`._kernels`): rotary and the pool writes in
        one pass, decodes and prefill chunks attending in the pool, residual sums fused with
        the norms, SwiGLU in one pass. Returns the last layer's output of the rows in
        ``b.keep``, already through the final norm.

        The last layer computes every row's keys and values (they go to the pool) but its
        attention, output projection and MLP only for the rows that sample: no later layer
        reads the others' outputs. A prompt's chunks before its last skip those parts of
        that layer altogether, and its last chunk attends for one query, not all of them."""
        ops = self.ops
        assert ops is not None
        cos, sin = self._rotations(b.positions)
        norms = [layer.input_layernorm for layer in layers] + [self.model.model.norm]
        normed = ops.add_rms_norm(hidden, None, norms[0].weight, norms[0].eps)
        t = hidden.shape[1]
        for i, (layer, keys, values) in enumerate(
            zip(layers, self.kv.keys, self.kv.values, strict=True)
        ):
            attn = layer.self_attn
            qkv = self.linears.qkv(attn, normed)
            if qkv is None:
                qkv = torch.cat((attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)), -1)
            rows = qkv.reshape(t, -1).contiguous()
            ops.rope_and_cache(rows, b.positions, cos, sin, keys, values, b.slots, attn.heads)
            if b.written is not None:
                b.written(i)
            q = rows[:, : attn.heads * attn.head_dim].view(t, attn.heads, attn.head_dim)
            final = i == len(layers) - 1
            if final and len(b.keep) < t:
                if not b.keep:
                    return hidden[:, :0]
                hidden = hidden[:, torch.tensor(b.keep, dtype=torch.long)]
            outs = []
            decodes = [r for r in b.keep if r < b.decodes] if final else range(b.decodes)
            if decodes:
                out = decode_attention(
                    ops,
                    self.offload,
                    i,
                    q[: b.decodes],
                    keys,
                    values,
                    b.decode_meta,
                    b.lengths,
                    attn.head_dim**-0.5,
                )
                if len(decodes) < b.decodes:
                    out = out[torch.tensor(decodes, dtype=torch.long)]
                outs.append(out.reshape(1, len(decodes), -1))
            for offset, start, n, table in b.chunks:
                if final:  # the chunk's last query, if it samples
                    if offset + n - 1 not in b.keep:
                        continue
                    offset, start, n = offset + n - 1, start + n - 1, 1
                out = ops.prefill_attention(
                    q[offset : offset + n], keys, values, table, start, attn.head_dim**-0.5
                )
                outs.append(out.reshape(1, n, -1))
            merged = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            post = layer.post_attention_layernorm
            projected = self._reduce(self.linears.linear(attn.o_proj, merged))
            normed = ops.add_rms_norm(hidden, projected, post.weight, post.eps)
            mlp = self._reduce(self.linears.mlp(layer.mlp, normed, ops.silu_and_mul))
            normed = ops.add_rms_norm(hidden, mlp, norms[i + 1].weight, norms[i + 1].eps)
        return normed

    def _chunks(
        self,
        attn: Attention,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        b: Batch,
    ) -> list[torch.Tensor]:
        """Each prefill chunk's attention over its blocks (``q``: ``[1, heads, tokens,
        dim]``), ``[1, n, heads * dim]`` each."""
        heads = keys.shape[2:]
        outs = []
        for (offset, start, n, table), mask in zip(b.chunks, b.masks, strict=True):
            width = start + n
            kk = keys[table].reshape(-1, *heads)[:width].transpose(0, 1)[None]
            vv = values[table].reshape(-1, *heads)[:width].transpose(0, 1)[None]
            qq = q[:, :, offset : offset + n]
            outs.append(attn.core(qq, kk.to(q.dtype), vv.to(q.dtype), mask))
        return outs

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (a row-parallel product, a vocabulary slice's
        embedding); ``partial`` itself without tensor parallelism."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def _rotations(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[positions, head_dim / 2]`` of every position up to the highest in
        ``positions`` (kept, and extended when a longer sequence comes), as
        :class:`~orchestr.roles.models.Rotary` computes them."""
        top = int(positions.max()) + 1 if positions.numel() else 1
        if self._cos.shape[0] < top:
            rotary = self.model.model.rotary
            at = torch.arange(-(-top // 1024) * 1024, device=positions.device)
            cos, sin = rotary(at)
            half = cos.shape[-1] // 2
            self._cos, self._sin = cos[:, :half].contiguous(), sin[:, :half].contiguous()
        return self._cos, self._sin
