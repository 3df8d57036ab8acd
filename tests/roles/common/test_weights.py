"""Weight sync (bucket plan, checksums, publisher and loader, in one process and between real
actors) and the torch backend seam."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import orchestr as oc
from orchestr._call import _serde
from orchestr.roles._common import _backend, _weights
from orchestr.roles._common._backend import (
    Backend,
    BackendError,
    BackendSpec,
    BackendUnavailableError,
    choose_backend,
)
from orchestr.roles._common._weightplan import (
    BucketPlan,
    BucketSpec,
    ChecksumMismatchError,
    ManifestMismatchError,
    StaleWeightsError,
    TensorSlot,
    WeightSyncError,
    checksum,
    plan_buckets,
    to_dtype,
    weight_tensors,
    weights_digest,
)
from orchestr.roles._common._weights import (
    ShardedWeightsRef,
    WeightLoader,
    WeightPublisher,
    WeightsRef,
)
from tests.roles.weight_actors import Generator, Trainer, make_net

# -- the bucket plan ----------------------------------------------------------------------------


def test_the_plan_sorts_by_dtype_then_name_and_packs_buckets() -> None:
    tensors = {
        "b": torch.zeros(10),
        "d": torch.zeros(100),
        "c": torch.zeros(3, dtype=torch.bfloat16),
        "a": torch.zeros(5),
    }
    plan = plan_buckets(tensors, bucket_bytes=64)  # 16 float32s
    assert plan.tensors == (
        TensorSlot("c", "bfloat16", (3,), 0, 0),
        TensorSlot("a", "float32", (5,), 1, 0),
        TensorSlot("b", "float32", (10,), 1, 5),
        TensorSlot("d", "float32", (100,), 2, 0),  # larger than a bucket: one of its own
    )
    assert plan.buckets == (
        BucketSpec("bfloat16", 3),
        BucketSpec("float32", 15),
        BucketSpec("float32", 100),
    )
    assert plan.nbytes == 3 * 2 + 115 * 4
    assert plan_buckets(dict(reversed(tensors.items())), 64) == plan  # order-independent
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(tensors, 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int8]),
            st.lists(st.integers(0, 40), max_size=3),
        ),
        max_size=25,
    ),
    st.integers(1, 512),
)
def test_every_plan_is_consistent_and_respects_the_bucket_size(
    specs: list[tuple[torch.dtype, list[int]]], bucket_bytes: int
) -> None:
    tensors = {f"t{i}": torch.zeros(shape, dtype=dt) for i, (dt, shape) in enumerate(specs)}
    plan = plan_buckets(tensors, bucket_bytes)
    plan.validate()
    plan.check(tensors)
    assert {t.name for t in plan.tensors} == set(tensors)
    for i, b in enumerate(plan.buckets):
        members = [t for t in plan.tensors if t.bucket == i]
        assert members and all(t.dtype == b.dtype for t in members)
        itemsize = getattr(torch, b.dtype).itemsize
        assert b.numel * itemsize <= bucket_bytes or len([t for t in members if t.numel]) == 1
        assert b.numel == sum(t.numel for t in members)  # contiguous, no gaps


def test_a_manifest_that_does_not_fit_the_model_is_refused_with_what_differs() -> None:
    model = weight_tensors(make_net(0))
    plan = plan_buckets(model, 1 << 12)
    renamed = {("fc9.bias" if k == "fc1.bias" else k): v for k, v in model.items()}
    with pytest.raises(ManifestMismatchError, match=r"missing from the model fc1\.bias.*fc9"):
        plan.check(renamed)
    with pytest.raises(ManifestMismatchError, match=r"emb: the model holds float32.*bfloat16"):
        plan.check({**model, "emb": model["emb"].float()})
    with pytest.raises(ManifestMismatchError, match=r"fc2.weight: the model's shape is \[2\]"):
        plan.check({**model, "fc2.weight": torch.zeros(2)})


@pytest.mark.parametrize(
    ("plan", "error"),
    [
        (
            BucketPlan((TensorSlot("a", "float32", (4,), 1, 0),), (BucketSpec("float32", 4),)),
            "bucket 1 does not exist",
        ),
        (
            BucketPlan((TensorSlot("a", "float32", (4,), 0, 1),), (BucketSpec("float32", 4),)),
            "outside bucket",
        ),
        (
            BucketPlan((TensorSlot("a", "int8", (4,), 0, 0),), (BucketSpec("float32", 4),)),
            "int8 placed in a float32",
        ),
        (
            BucketPlan(
                (TensorSlot("a", "float32", (4,), 0, 0), TensorSlot("b", "float32", (2,), 0, 3)),
                (BucketSpec("float32", 8),),
            ),
            "a and b overlap",
        ),
        (
            BucketPlan((TensorSlot("a", "float32", (1,), 0, 0),) * 2, (BucketSpec("float32", 2),)),
            "twice",
        ),
        (
            BucketPlan((TensorSlot("a", "floaty", (1,), 0, 0),), (BucketSpec("floaty", 1),)),
            "unknown torch dtype",
        ),
    ],
)
def test_malformed_manifests_are_refused(plan: BucketPlan, error: str) -> None:
    with pytest.raises(ManifestMismatchError, match=error):
        plan.validate()


def test_synced_tensors_are_the_state_dict_with_tied_ones_once() -> None:
    net = make_net(0)
    names = set(weight_tensors(net))
    assert "out.weight" in names and "tied.weight" not in names  # tied: first name only
    assert {"steps", "scale", "emb"} <= names and "cache" not in names  # not persistent
    with pytest.raises(WeightSyncError, match="not a tensor"):
        weight_tensors({"x": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "sha256", "blake2b"])
def test_a_flipped_byte_changes_the_checksum(algorithm: str) -> None:
    t = torch.randn(1000, dtype=torch.float64)
    before = checksum(t, algorithm)
    assert checksum(t.clone(), algorithm) == before
    t.view(torch.uint8)[4321] ^= 1
    assert checksum(t, algorithm) != before
    with pytest.raises(ValueError, match="unknown checksum 'md4'"):
        checksum(t, "md4")


# -- publisher and loader in one process --------------------------------------------------------


async def test_publish_and_load_in_one_process() -> None:
    trainer, gen = make_net(0), make_net(1)
    assert weights_digest(trainer) != weights_digest(gen)
    loader = WeightLoader(borrow=False)  # reads (borrowing: the next test)
    with WeightPublisher(bucket_bytes=4096) as publisher:
        for version in (1, 2, 3):
            with torch.no_grad():
                trainer.fc1.weight.add_(1.0)
            ref = publisher.publish(trainer, version)
            assert len(ref.buckets) > 3
            assert await loader.load(gen, ref) is True
            assert weights_digest(gen) == weights_digest(trainer)
            assert loader.transports == {"inproc"}
        assert await loader.load(gen, ref) is False  # already there: nothing moves
        # a ref of the older form (one digest per bucket, no pieces) still loads
        publisher.publish(trainer, 4)
        old = publisher.publish(trainer, 5)  # into slot 0, as versions 1 and 3
        digests = [checksum(b, old.algorithm) for b in publisher._slots[0].buckets]
        old = dataclasses.replace(
            old,
            piece_bytes=0,
            buckets=tuple(
                b._replace(checksum=d) for b, d in zip(old.buckets, digests, strict=True)
            ),
        )
        assert await loader.load(gen, old) and weights_digest(gen) == weights_digest(trainer)
        with pytest.raises(WeightSyncError, match="not newer than the last published 5"):
            publisher.publish(trainer, 3)
        with pytest.raises(WeightSyncError, match="changed since the first publish"):
            publisher.publish({"x": torch.zeros(3)}, 6)


async def test_a_borrowed_version_is_never_rewritten_while_a_model_uses_it() -> None:
    """A CPU model on the publisher's host uses the published buckets in place; the publisher
    writes later versions around the slots loaders borrow (a new slot when it must, up to
    max_slots, then a clear refusal that publishes nothing), and takes a slot back once a
    newer load let go of it."""
    trainer, a, b = make_net(0), make_net(1), make_net(2)
    first, second = WeightLoader(), WeightLoader()

    async def step(version: int) -> WeightsRef:
        with torch.no_grad():
            trainer.fc1.weight.add_(1.0)
        return publisher.publish(trainer, version)

    with WeightPublisher(bucket_bytes=4096, max_slots=3) as publisher:
        v1 = await step(1)  # slot 0
        assert await first.load(a, v1) and first.borrowing and first.transports == {"shm"}
        assert not first._sets  # no bytes of its own
        mine = {t.data_ptr() for t in weight_tensors(trainer).values()}
        assert not {t.data_ptr() for t in weight_tensors(a).values()} & mine
        at_v1 = weights_digest(a)
        v2 = await step(2)  # slot 1
        assert await second.load(b, v2) and second.borrowing
        at_v2 = weights_digest(b)
        v3 = await step(3)  # slot 0 is borrowed and 1 holds the newest: a new slot 2
        at_v3 = weights_digest(trainer)
        assert len(publisher._slots) == 3
        assert (weights_digest(a), weights_digest(b)) == (at_v1, at_v2)  # untouched
        with pytest.raises(WeightSyncError, match="3 slots is still borrowed.*max_slots=3"):
            await step(4)  # 0 and 1 borrowed, 2 the newest, and no room for a fourth
        assert publisher.version == 3 and (weights_digest(a), weights_digest(b)) == (at_v1, at_v2)
        assert await first.load(a, v3) and weights_digest(a) == at_v3
        v4 = publisher.publish(trainer, 4)  # slot 0, let go by the first loader's load of 3
        assert len(publisher._slots) == 3 and weights_digest(b) == at_v2
        assert await second.load(b, v4) and weights_digest(b) == weights_digest(trainer)
        with pytest.raises(StaleWeightsError, match="version 1 now holds version 4"):
            await WeightLoader().load(make_net(3), v1)
        # a loader that cannot borrow (asked not to) reads, as across hosts
        reader = WeightLoader(borrow=False)
        assert await reader.load(make_net(3), v4) and not reader.borrowing


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "sha256", "blake2b"])
async def test_a_cpu_model_flips_between_two_halves_read_in_pieces(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each load reads the half the model does not view, in pieces hashed as they land (the
    same digest as the publisher's whole-bucket one), then points the tensors at it; a load
    that fails changes nothing, the half in use included."""
    monkeypatch.setattr(_weights, "PIECE_BYTES", 1000)  # buckets of 4096 bytes: 5 pieces each
    trainer, gen = make_net(0), make_net(1)
    names = list(weight_tensors(gen))

    def where() -> list[int]:
        return [weight_tensors(gen)[n].data_ptr() for n in names]

    loader = WeightLoader()
    with WeightPublisher(bucket_bytes=4096, checksum=algorithm) as publisher:
        seen = []
        for version in (1, 2, 3):
            with torch.no_grad():
                trainer.fc1.weight.mul_(1.5)
            assert await loader.load(gen, publisher.publish(trainer, version))
            assert weights_digest(gen) == weights_digest(trainer)
            seen.append(where())
        assert seen[0] != seen[1] and seen[0] == seen[2]  # two halves, alternating
        assert gen.fc1.weight.data_ptr() == seen[2][names.index("fc1.weight")]
        ref = publisher.publish(trainer, 4)
        sizes = [b.numel * to_dtype(b.dtype).itemsize for b in ref.buckets]
        big = sizes.index(max(sizes))
        assert sizes[big] > 3000  # several pieces
        await ref.buckets[big].buffer.write_from(torch.tensor([9], dtype=torch.uint8), offset=2100)
        before = weights_digest(gen)
        with pytest.raises(ChecksumMismatchError, match=f"bucket {big} of weights version 4"):
            await loader.load(gen, ref)
        assert weights_digest(gen) == before and where() == seen[2] and loader.version == 3
    copying = WeightLoader(double_buffer=False)
    other = make_net(2)
    first = where_of(other)
    with WeightPublisher(bucket_bytes=4096) as publisher:
        assert await copying.load(other, publisher.publish(trainer, 1))
    assert where_of(other) == first and weights_digest(other) == weights_digest(trainer)


def where_of(model: torch.nn.Module) -> list[int]:
    return [t.data_ptr() for t in weight_tensors(model).values()]


async def test_the_ref_is_small_and_survives_the_wire() -> None:
    trainer = make_net(0, width=512)
    with WeightPublisher(bucket_bytes=4096) as publisher:
        ref = publisher.publish(trainer, 7)
        msg, buffers = _serde.encode(ref)
        assert not buffers and len(msg) < 4096 < ref.nbytes // 100
        back = _serde.decode(msg)
        assert isinstance(back, WeightsRef) and back.version == 7 and back.plan == ref.plan
        gen = make_net(1, width=512)
        assert await WeightLoader().load(gen, back)
        assert weights_digest(gen) == weights_digest(trainer)


async def test_older_versions_and_lagging_readers_are_refused() -> None:
    trainer = make_net(0)
    with WeightPublisher(bucket_bytes=4096, slots=2) as publisher:
        refs = {v: publisher.publish(trainer, v) for v in (1, 2)}
        loader = WeightLoader()
        assert await loader.load(make_net(1), refs[2])
        with pytest.raises(StaleWeightsError, match="version 1 is older than version 2"):
            await loader.load(make_net(1), refs[1])
        refs[3] = publisher.publish(trainer, 3)  # reuses version 1's slot
        lagging, model = WeightLoader(), make_net(1)
        before = weights_digest(model)
        with pytest.raises(StaleWeightsError, match="version 1 now holds version 3"):
            await lagging.load(model, refs[1])
        assert weights_digest(model) == before and lagging.version is None
        assert await lagging.load(model, refs[2])  # the previous version stays readable
    with pytest.raises(StaleWeightsError, match="released its weight buffers"):
        await WeightLoader().load(make_net(1), refs[3])


async def test_a_corrupted_bucket_is_caught_and_nothing_is_loaded() -> None:
    trainer, gen = make_net(0), make_net(1)
    with WeightPublisher(bucket_bytes=4096, checksum="sha256") as publisher:
        ref = publisher.publish(trainer, 1)
        await ref.buckets[2].buffer.write_from(torch.tensor([7], dtype=torch.uint8), offset=9)
        before = weights_digest(gen)
        with pytest.raises(ChecksumMismatchError, match="bucket 2 of weights version 1.*sha256"):
            await WeightLoader().load(gen, ref)
        assert weights_digest(gen) == before


def _rows_of(model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    """``rank``'s rows of each of ``model``'s tensors, as FSDP2 cuts them (``torch.chunk``;
    a rank past the last chunk holds none), and rank 0 a scalar whole."""
    out = {}
    for name, t in weight_tensors(model).items():
        if t.dim() == 0:
            if rank == 0:
                out[name] = t
            continue
        chunks = torch.chunk(t, world)
        if rank < len(chunks) and chunks[rank].numel():
            out[name] = chunks[rank]
    return out


async def test_a_sharded_publish_is_laid_together_by_the_loader() -> None:
    trainer, gen = make_net(0), make_net(1)
    manifest = tuple(
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for n, t in weight_tensors(trainer).items()
    )
    publishers = [WeightPublisher(bucket_bytes=4096) for _ in range(3)]
    try:
        own = [
            ShardedWeightsRef(4, manifest, (p.publish(_rows_of(trainer, r, 3), 4),))
            for r, p in enumerate(publishers)
        ]
        ref = ShardedWeightsRef.join(_serde.decode(_serde.encode(own)[0]))  # as over the wire
        assert len(ref.parts) == 3 and all(p.nbytes < ref.nbytes / 2 for p in ref.parts)
        loader = WeightLoader()
        assert await loader.load(gen, ref)
        assert weights_digest(gen) == weights_digest(trainer)
        # a corrupted piece of one part fails the load; the model stays as it was
        with torch.no_grad():
            for t in weight_tensors(trainer).values():
                t.add_(1)
        newer = ShardedWeightsRef.join(
            [
                ShardedWeightsRef(5, manifest, (p.publish(_rows_of(trainer, r, 3), 5),))
                for r, p in enumerate(publishers)
            ]
        )
        before = weights_digest(gen)
        bucket = newer.parts[1].buckets[0].buffer
        await bucket.write_from(torch.tensor([9], dtype=torch.uint8), offset=3)
        with pytest.raises(ChecksumMismatchError, match="version 5"):
            await loader.load(gen, newer)
        assert weights_digest(gen) == before and loader.version == 4
    finally:
        for p in publishers:
            p.close()


def test_bad_sharded_refs_are_refused() -> None:
    trainer = make_net(0)
    manifest = tuple(
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for n, t in weight_tensors(trainer).items()
    )
    with WeightPublisher(bucket_bytes=4096) as a, WeightPublisher(bucket_bytes=4096) as b:
        first = ShardedWeightsRef(1, manifest, (a.publish(_rows_of(trainer, 0, 2), 1),))
        second = ShardedWeightsRef(1, manifest, (b.publish(_rows_of(trainer, 1, 2), 1),))
        with pytest.raises(ManifestMismatchError, match="not its rows"):
            first.rows()  # half of each tensor's rows
        with pytest.raises(ManifestMismatchError, match="not its rows"):
            ShardedWeightsRef(1, manifest, first.parts * 2).rows()  # rank 0's rows twice
        assert ShardedWeightsRef.join([first, second]).rows()
        with pytest.raises(ManifestMismatchError, match="different versions"):
            ShardedWeightsRef.join([first, ShardedWeightsRef(2, manifest)])
        with pytest.raises(ManifestMismatchError, match="not a WeightsRef of it"):
            ShardedWeightsRef(2, manifest, first.parts)
        with pytest.raises(ManifestMismatchError, match="malformed"):
            ShardedWeightsRef(1, (("w", "float32"),))
        with pytest.raises(ManifestMismatchError, match="no member"):
            ShardedWeightsRef.join([])


async def test_a_load_can_hand_verified_tensors_to_the_model_instead() -> None:
    """An engine with its own weight layout (vLLM's) gets the verified tensors by name, and
    none from a load that failed to verify."""
    trainer = make_net(0)
    shapes = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in weight_tensors(trainer).items()
    }
    handed: list[dict[str, torch.Tensor]] = []

    async def apply(tensors: list[tuple[str, torch.Tensor]]) -> None:
        handed.append({k: v.clone() for k, v in tensors})

    loader = WeightLoader()
    with WeightPublisher(bucket_bytes=4096) as publisher:
        ref = publisher.publish(trainer, 1)
        assert await loader.load(shapes, ref, apply=apply) is True
        assert await loader.load(shapes, ref, apply=apply) is False  # already there
        (got,) = handed
        want = weight_tensors(trainer)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        bad = publisher.publish(trainer, 2)
        await bad.buckets[1].buffer.write_from(torch.tensor([7], dtype=torch.uint8), offset=3)
        with pytest.raises(ChecksumMismatchError):
            await loader.load(shapes, bad, apply=apply)
        assert len(handed) == 1 and loader.version == 1
        wrong = {**shapes, "fc1.weight": torch.empty(3, device="meta")}
        with pytest.raises(ManifestMismatchError, match="fc1.weight"):
            await WeightLoader().load(wrong, ref, apply=apply)


async def test_a_model_of_another_shape_is_refused_before_any_read() -> None:
    with WeightPublisher() as publisher:
        ref = publisher.publish(make_net(0), 1)
        with pytest.raises(ManifestMismatchError, match="the model's shape is"):
            await WeightLoader().load(make_net(0, width=32), ref)
        with pytest.raises(ManifestMismatchError, match="cast the model"):
            await WeightLoader().load(make_net(0).double(), ref)


# -- between real actors ------------------------------------------------------------------------


async def test_generators_match_the_trainer_bitwise_after_every_sync(ctx: oc.JobContext) -> None:
    width = 256  # about 0.3 MB of weights in 6 buckets of 4 dtypes
    trainer, gens = await asyncio.gather(
        ctx.spawn(Trainer, 0, width, 64 << 10), ctx.spawn(Generator, 100, width, n=2)
    )
    assert len(set(await gens.digest.call())) == 2
    received = await gens.received.call()
    for version in range(1, 6):
        ref = await trainer.step.call_one(version)  # the controller holds only this ref
        assert isinstance(ref, WeightsRef) and len(ref.buckets) == 6
        results = await gens.load.call(ref)
        want = await trainer.digest.call_one()
        for r in results:
            assert (r["loaded"], r["version"], r["digest"]) == (True, version, want)
            assert r["tied"] and r["transports"] == ["shm"]
    # the weights went actor to actor: the generators' call frames carried far less than them
    moved = [b - a for a, b in zip(received, await gens.received.call(), strict=True)]
    assert all(m < ref.nbytes for m in moved), (moved, ref.nbytes)
    want_tensors = await trainer.tensors.call_one()
    for got in await gens.tensors.call():
        assert got.keys() == want_tensors.keys()
        for name, t in want_tensors.items():
            assert got[name].dtype == t.dtype and torch.equal(_raw(got[name]), _raw(t)), name
    assert {t.dtype for t in want_tensors.values()} >= {torch.bfloat16, torch.float64}

    old = await trainer.publish.call_one(6)
    newer = await trainer.step.call_one(7)
    await gens.load.call(newer)
    with pytest.raises(oc.ActorError, match="StaleWeightsError: weights version 6 is older"):
        await gens[0].load.call_one(old)

    bad = await trainer.step.call_one(8)
    await trainer.corrupt.call_one(bad, 3, 100)
    with pytest.raises(oc.ActorError, match="ChecksumMismatchError: bucket 3 of weights version 8"):
        await gens[1].load.call_one(bad)
    assert (await gens[1].load.call_one(newer))["loaded"] is False  # still at 7, untouched
    assert await gens[1].digest.call_one() == await gens[0].digest.call_one()

    await trainer.close.call_one()
    with pytest.raises(oc.ActorError, match="StaleWeightsError: the publisher released"):
        await gens[0].load.call_one(bad)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# -- the torch backend seam ---------------------------------------------------------------------


def test_the_node_picks_what_it_has() -> None:
    backend = choose_backend()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert backend.name == expected == backend.device.type
    assert choose_backend(None) == choose_backend(BackendSpec()) == backend
    assert choose_backend("cpu").describe() == {
        "name": "cpu",
        "device": "cpu",
        "dtype": None,
        "compiled": False,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="this node has a GPU")
def test_cuda_without_a_gpu_is_refused_with_the_reason() -> None:
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run on this node: .*'cpu'"):
        choose_backend("cuda")
    with pytest.raises(BackendUnavailableError, match="cuda:1"):
        choose_backend(BackendSpec("cuda:1", dtype="bfloat16"))
    row = next(r for r in _backend.backend_report() if r["name"] == "cuda")
    assert not row["available"] and row["reason"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_backends_name_their_device() -> None:
    backend = choose_backend(BackendSpec("cuda:0", dtype="bfloat16"))
    model = backend.prepare(torch.nn.Linear(4, 4))
    assert model.weight.device == torch.device("cuda", 0)
    assert model.weight.dtype == torch.bfloat16
    with pytest.raises(BackendUnavailableError, match="does not exist on this node"):
        choose_backend(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("tpu", r"unknown torch backend 'tpu'; known: cpu, cuda.*orchestr\.backends"),
        ("cuda:x", "bad device"),
        ("cpu:3", "no device 3"),
        (BackendSpec("cpu", dtype="float7"), "unknown torch dtype 'float7'"),
    ],
)
def test_bad_names_are_refused(spec: str | BackendSpec, error: str) -> None:
    with pytest.raises(BackendError, match=error):
        choose_backend(spec)


def test_prepare_casts_floating_tensors_and_tensor_follows_the_dtype() -> None:
    backend = choose_backend(BackendSpec("cpu", dtype="float64"))
    net = backend.prepare(make_net(0))
    dtypes = {k: v.dtype for k, v in weight_tensors(net).items()}
    assert dtypes["fc1.weight"] == dtypes["emb"] == dtypes["scale"] == torch.float64
    assert dtypes["steps"] == torch.int64  # integers keep their dtype
    assert backend.tensor([1.0, 2.0]).dtype == torch.float64
    assert backend.tensor([1, 2]).dtype == torch.int64
    assert backend.empty(2, 3).shape == (2, 3) and backend.empty(1).dtype == torch.float64
    backend.synchronize()


def test_a_compiled_backend_wraps_the_module_in_torch_compile() -> None:
    spec = BackendSpec("cpu", compiled=True, compile_options={"backend": "eager"})
    backend = choose_backend(_serde.decode(_serde.encode(spec)[0]))  # specs travel in calls
    assert backend.compiled
    lin = torch.nn.Linear(4, 2)
    compiled = backend.prepare(lin)
    assert compiled is not lin and isinstance(compiled, torch.nn.Module)
    x = torch.randn(3, 4)
    assert torch.equal(compiled(x), lin(x))


class MetaKind:
    """A plug-in backend: tensors without storage."""

    def probe(self) -> str | None:
        return None

    def build(self, spec: BackendSpec, index: int | None) -> Backend:
        return Backend("meta", torch.device("meta"))


@pytest.fixture
def installed_backend(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path whose metadata declares two backends, one broken."""
    dist = tmp_path / "orchestr_metabackend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orchestr-meta\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[orchestr.backends]\n"
        "meta = tests.roles.common.test_weights:MetaKind\n"
        "broken = tests.roles.no_such_module:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_backend, "_entry_points_loaded", False)
    monkeypatch.setattr(_backend, "_kinds", dict(_backend._kinds))


def test_an_entry_point_backend_is_found(installed_backend: None) -> None:
    backend = choose_backend("meta")
    assert backend.prepare(torch.nn.Linear(2, 2)).weight.is_meta
    assert "meta" in _backend.backends() and "broken" not in _backend.backends()
