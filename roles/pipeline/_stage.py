"""A pipeline's ranks as actors: each member of a mesh holds its model chunks and runs its list
of a schedule, sending activations forward and gradients back straight to its neighbours.

A :class:`PipelineStage` mesh has one member per rank; member ``r`` builds the stages
``r, r + ranks, ...`` (its chunks, :meth:`Schedule.placement`) from the model factory and
runs ``build(schedule, ranks, microbatches, chunks).ops[r]`` for each step. An activation or a
gradient for a stage on another rank is an actor call to that rank (:meth:`PipelineStage.take`)
carrying the tensor: it moves actor to actor on the data plane (on one host, a tensor of 1 MiB
or more through shared memory), never through the controller. A pass waits for its input in
the rank's inbox; sends go out as the passes finish, without waiting for the receiver, so the
links are unbounded (what :func:`~orchestr.roles.pipeline.check` calls ``capacity=None``).

The passes themselves, the split backward of zero-bubble schedules included, are
:mod:`._passes`.

Each micro-batch's loss is divided by the number of micro-batches before its backward, so a
step's gradients are those of the mean loss over the whole batch: what the single-process
model gives for the batch (the tests hold them to float tolerance for every schedule).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._factory import import_object
from orchestr.tasks import TaskOwner

from ._builders import build
from ._ops import Op, Pass, Schedule
from ._passes import Saved, backward, backward_input, backward_weights, forward

__all__ = ["PipelineStage"]

ACTIVATION = "activation"
GRADIENT = "gradient"


class PipelineStage(oc.Actor):
    """One rank of a pipeline-parallel model: its chunks, its optimizer, its list of passes.

    ``model`` names a factory ``"package.module:callable"`` called as
    ``factory(stage, stages, **model_options)`` for each stage this rank holds, after
    ``torch.manual_seed(seed + stage)``: every rank builds its stages from its constructor
    arguments alone, and the single-process model is the same factory's stages in order.
    ``loss`` names ``loss(output, target) -> scalar`` for the last stage (mean squared error by
    default); ``optimizer`` a ``torch.optim`` class taking ``(params, **optimizer_options)``.
    ``threads`` sets torch's intra-op threads in this process. Raises
    :class:`~orchestr.ConfigError` for a schedule :func:`~orchestr.roles.pipeline.build`
    refuses or a factory that does not give modules.
    """

    def __init__(
        self,
        model: str,
        schedule: str = "1f1b",
        ranks: int = 1,
        microbatches: int = 1,
        chunks: int = 1,
        *,
        model_options: dict[str, Any] | None = None,
        loss: str = "torch.nn.functional:mse_loss",
        optimizer: str = "torch.optim:SGD",
        optimizer_options: dict[str, Any] | None = None,
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        try:
            self.schedule: Schedule = build(schedule, ranks, microbatches, chunks)
        except ValueError as exc:
            raise oc.ConfigError(f"pipeline schedule: {exc}") from exc
        if threads is not None:
            torch.set_num_threads(threads)
        factory = import_object(model, "pipeline stage factory")
        self._loss: Callable[..., torch.Tensor] = import_object(loss, "loss")
        self._model_options = dict(model_options or {})
        self._factory = factory
        self._seed = seed
        self._optimizer_spec = (optimizer, dict(optimizer_options or {"lr": 0.01}))
        self._chunks: dict[int, torch.nn.Module] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._peers: oc.Mesh | None = None
        self._inbox: dict[tuple[int, str, int, int], asyncio.Future[torch.Tensor]] = {}
        self._step = 0
        self._abandoned: dict[int, str] = {}  # step -> why, once a rank failed in it
        self._split = any(op.kind is Pass.BW for ops in self.schedule.ops for op in ops)

    def _build(self) -> None:
        # after __init__, where self.rank is set by the runtime
        s = self.schedule
        for chunk in range(s.chunks):
            stage = chunk * s.ranks + self.rank
            torch.manual_seed(self._seed + stage)
            module = self._factory(stage, s.stages, **self._model_options)
            if not isinstance(module, torch.nn.Module):
                raise oc.ConfigError(
                    f"pipeline stage factory returned {type(module).__name__} for stage "
                    f"{stage}, not a torch nn.Module"
                )
            self._chunks[chunk] = module
        params = [p for m in self._chunks.values() for p in m.parameters() if p.requires_grad]
        name, options = self._optimizer_spec
        if params:
            self._optimizer = import_object(name, "optimizer")(params, **options)

    def _chunk(self, op: Op) -> torch.nn.Module:
        if not self._chunks:
            self._build()
        return self._chunks[op.chunk]

    @oc.endpoint
    def connect(self, mesh: oc.Mesh) -> int:
        """Remember the mesh of all the ranks (this one's neighbours are in it); returns the
        number of parameters this rank holds. Raises :class:`~orchestr.ConfigError` for a mesh
        of another size."""
        if len(mesh) != self.schedule.ranks:
            raise oc.ConfigError(
                f"a {self.schedule.ranks}-rank pipeline needs a mesh of {self.schedule.ranks} "
                f"members, got {len(mesh)}"
            )
        self._peers = mesh
        if not self._chunks:
            self._build()
        return sum(p.numel() for m in self._chunks.values() for p in m.parameters())

    @oc.endpoint(concurrent=True)
    async def take(
        self, step: int, what: str, stage: int, microbatch: int, value: torch.Tensor
    ) -> None:
        """Receive the activation (``what="activation"``) or gradient (``"gradient"``) that
        ``stage``'s pass of ``microbatch`` in ``step`` reads. Raises ``ValueError`` for an item
        this rank does not run or already has."""
        s = self.schedule
        if what not in (ACTIVATION, GRADIENT):
            raise ValueError(f"a pipeline item is an activation or a gradient, not {what!r:.40}")
        if not (isinstance(stage, int) and 0 <= stage < s.stages) or s.placement(stage)[0] != (
            self.rank
        ):
            raise ValueError(f"stage {stage!r:.20} does not run on rank {self.rank}")
        if not (isinstance(microbatch, int) and 0 <= microbatch < s.microbatches):
            raise ValueError(f"micro-batch {microbatch!r:.20} is outside 0..{s.microbatches - 1}")
        if not isinstance(step, int) or step < self._step:
            raise ValueError(f"step {step!r:.20} is over (this rank is at step {self._step})")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"a pipeline item is a tensor, got {type(value).__name__}")
        self._put((step, what, stage, microbatch), value)

    def _put(self, key: tuple[int, str, int, int], value: torch.Tensor) -> None:
        future = self._inbox.setdefault(key, asyncio.get_running_loop().create_future())
        if future.done():
            raise ValueError(f"pipeline item {key} arrived twice")
        future.set_result(value)

    @oc.endpoint(concurrent=True)
    async def abandon(self, step: int, why: str) -> None:
        """Give ``step`` up: a rank failed in it, so what this rank waits for in it will never
        come. Its waits end with the reason; idempotent."""
        self._abandoned[step] = why
        for key, future in self._inbox.items():
            if key[0] == step and not future.done():
                future.set_exception(RuntimeError(why))

    async def _get(self, key: tuple[int, str, int, int]) -> torch.Tensor:
        why = self._abandoned.get(key[0])
        if why is not None:
            raise RuntimeError(why)
        future = self._inbox.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await future
        finally:
            del self._inbox[key]

    @oc.endpoint
    async def step(
        self,
        step: int,
        inputs: list[torch.Tensor] | None = None,
        targets: list[torch.Tensor] | None = None,
        update: bool = True,
    ) -> dict[str, Any]:
        """Run this rank's passes for ``step``: the first rank takes the micro-batches'
        ``inputs``, the last their ``targets``. Zeroes the gradients first and, with
        ``update``, takes an optimizer step after. Returns ``{"losses": [...]}`` (the last
        rank: each micro-batch's loss) and ``"timeline"``: ``[kind, microbatch, chunk,
        start, end]`` per pass, in ``time.perf_counter`` seconds (one clock for every process
        of a host)."""
        s = self.schedule
        if self._peers is None:
            raise oc.ConfigError("a pipeline stage runs steps once connect() has given its mesh")
        m = s.microbatches
        for name, given, needed in (
            ("inputs", inputs, self.rank == 0),
            ("targets", targets, self.rank == s.ranks - 1),
        ):
            if needed and (given is None or len(given) != m):
                raise ValueError(
                    f"rank {self.rank} needs {m} micro-batch {name}, got "
                    f"{'none' if given is None else len(given)}"
                )
            if needed and not all(isinstance(t, torch.Tensor) for t in given or ()):
                raise ValueError(f"micro-batch {name} are tensors")
        if step < self._step:
            raise ValueError(f"step {step} is over (this rank is at step {self._step})")
        self._step = step
        for module in self._chunks.values():
            module.zero_grad(set_to_none=True)
        losses: list[float] = [math.nan] * m
        for old in [k for k in self._inbox if k[0] < step]:
            del self._inbox[old]  # a failed step's items
        self._abandoned = {k: v for k, v in self._abandoned.items() if k >= step}
        try:
            timeline = await self._run(step, inputs, targets, losses)
        except BaseException as exc:
            if step not in self._abandoned:  # the first to fail tells the others to stop waiting
                why = f"step {step} was abandoned: rank {self.rank} failed: {exc!r:.200}"
                self._abandoned[step] = why
                assert self._peers is not None
                self._peers.abandon.broadcast(step, why)
            raise
        if update and self._optimizer is not None:
            self._optimizer.step()
        self._step = step + 1
        return {"losses": losses if self.rank == s.ranks - 1 else [], "timeline": timeline}

    async def _run(
        self,
        step: int,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        losses: list[float],
    ) -> list[list[Any]]:
        s, m = self.schedule, self.schedule.microbatches
        saved: dict[tuple[int, int], Saved] = {}
        timeline: list[list[Any]] = []
        sent: list[asyncio.Task[None]] = []
        async with TaskOwner() as sends:
            for op in s.ops[self.rank]:
                stage = s.stage(op)
                key = (op.chunk, op.microbatch)
                if op.kind is Pass.F:
                    if stage == 0:
                        x = (inputs or [])[op.microbatch]
                    else:
                        x = await self._get((step, ACTIVATION, stage, op.microbatch))
                    target = (targets or [])[op.microbatch] if stage == s.stages - 1 else None
                    start = time.perf_counter()
                    saved[key] = await asyncio.to_thread(self._forward, op, x, target, m)
                    end = time.perf_counter()
                    if stage == s.stages - 1:
                        losses[op.microbatch] = float(saved[key].out.detach()) * m
                    else:
                        value = saved[key].out.detach()
                        sent += self._send(sends, step, ACTIVATION, stage + 1, op.microbatch, value)
                elif op.kind is Pass.BW:
                    start = time.perf_counter()
                    await asyncio.to_thread(self._backward_weights, saved.pop(key))
                    end = time.perf_counter()
                else:
                    item = saved[key]
                    if stage < s.stages - 1:
                        item.grad_out = await self._get((step, GRADIENT, stage, op.microbatch))
                    start = time.perf_counter()
                    if op.kind is Pass.B:
                        grad_x = await asyncio.to_thread(backward, item)
                        del saved[key]
                    else:
                        grad_x = await asyncio.to_thread(backward_input, item)
                    end = time.perf_counter()
                    if stage > 0:
                        if grad_x is None:
                            raise oc.ConfigError(
                                f"stage {stage}'s input gets no gradient: its output does not "
                                f"depend on its input"
                            )
                        sent += self._send(sends, step, GRADIENT, stage - 1, op.microbatch, grad_x)
                timeline.append([str(op.kind), op.microbatch, op.chunk, start, end])
            await asyncio.gather(*sent)  # every send's failure surfaces here
        return timeline

    def _send(
        self, owner: TaskOwner, step: int, what: str, stage: int, mb: int, value: torch.Tensor
    ) -> list[asyncio.Task[None]]:
        rank = self.schedule.placement(stage)[0]
        if rank == self.rank:
            self._put((step, what, stage, mb), value)
            return []
        assert self._peers is not None
        call = self._peers[rank].take.call_one(step, what, stage, mb, value.contiguous())
        return [owner.start(call, name=f"pipeline send {what} {stage}.{mb}")]

    def _forward(self, op: Op, x: torch.Tensor, target: torch.Tensor | None, m: int) -> Saved:
        loss = None if target is None else (lambda out: self._loss(out, target) / m)
        x = x.detach().requires_grad_(self.schedule.stage(op) > 0)
        return forward(self._chunk(op), x, loss, split=self._split)

    def _backward_weights(self, item: Saved) -> None:
        params = [p for m in self._chunks.values() for p in m.parameters() if p.requires_grad]
        backward_weights(item, params)

    @oc.endpoint
    def grads(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each stage this rank holds: its parameters' gradients from the last step, by name
        (a parameter with none is left out)."""
        return {
            chunk * self.schedule.ranks + self.rank: {
                name: p.grad.detach().clone()
                for name, p in module.named_parameters()
                if p.grad is not None
            }
            for chunk, module in self._chunks.items()
        }

    @oc.endpoint
    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each stage this rank holds: its state dict (copies)."""
        return {
            chunk * self.schedule.ranks + self.rank: {
                k: v.detach().clone() for k, v in module.state_dict().items()
            }
            for chunk, module in self._chunks.items()
        }
