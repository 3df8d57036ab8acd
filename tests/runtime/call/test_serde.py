"""Tests for values on the wire (``orchestr._call._serde``): msgpack plus tensors, arrays, dataclasses."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import orchestr
from orchestr._call._frames import ALIGN, FrameDecoder, encode_frame
from orchestr._call._registry import EXT_DATACLASS, EXT_NDARRAY, EXT_TENSOR, register
from orchestr._call._serde import decode, decode_plain, encode
from orchestr.errors import ProtocolError, SerializationError


@orchestr.register
@dataclasses.dataclass
class Point:
    x: int
    y: float


@orchestr.register
@dataclasses.dataclass
class Labelled:
    label: str
    points: list[Point]
    meta: dict[str, Any]


@orchestr.register
@dataclasses.dataclass
class Batch:
    name: str
    data: torch.Tensor
    weights: np.ndarray


@orchestr.register
@dataclasses.dataclass
class WithDerived:
    a: int
    doubled: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.doubled = 2 * self.a


@dataclasses.dataclass
class Unregistered:
    x: int


def packb(value: object) -> bytes:
    out = msgpack.packb(value)
    assert isinstance(out, bytes)
    return out


def to_frame(value: object) -> tuple[memoryview, memoryview]:
    """Encode ``value`` and pass it through a real frame decoder, like the call path does."""
    msg, buffers = encode(value)
    data = b"".join(bytes(p) for p in encode_frame(msg, buffers))
    frames = FrameDecoder(1 << 30).feed(data)
    assert len(frames) == 1
    msg_view, extra = frames[0]
    return msg_view, extra


def round_trip(value: object) -> Any:
    return decode(*to_frame(value))


def owner(extra: memoryview) -> bytearray:
    """The bytearray a frame's ``extra`` views."""
    obj = extra.obj
    assert isinstance(obj, bytearray)
    return obj


def address_range(extra: memoryview) -> tuple[int, int]:
    backing = owner(extra)
    start = int(np.frombuffer(backing, dtype=np.uint8).ctypes.data)
    return start, start + len(backing)


def forged(code: int, payload: object) -> bytes:
    return packb(msgpack.ExtType(code, msgpack.packb(payload)))


# -- plain msgpack values --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        1.5,
        -0.0,
        math.inf,
        "",
        "héllo ✓",
        b"",
        b"\x00\xff" * 100,
        [],
        [1, [2, [3, None]]],
        {},
        {"a": 1, "b": [True, {"c": b"x"}]},
        {1: "int key", 2: "another"},
    ],
)
def test_msgpack_values_round_trip_unchanged(value: object) -> None:
    out = round_trip(value)
    assert out == value
    assert type(out) is type(value)


def test_tuples_arrive_as_lists() -> None:
    assert round_trip((1, (2, 3), "x")) == [1, [2, 3], "x"]


def test_bytearray_and_memoryview_arrive_as_bytes() -> None:
    assert round_trip([bytearray(b"ab"), memoryview(b"cd")]) == [b"ab", b"cd"]


def test_nan_round_trips() -> None:
    assert math.isnan(round_trip(math.nan))


def test_decode_of_plain_message_needs_no_extra() -> None:
    msg, buffers = encode({"k": [1, 2]})
    assert buffers == []
    assert decode(msg) == {"k": [1, 2]}


def test_int_beyond_64_bits_is_refused() -> None:
    with pytest.raises(SerializationError):
        encode(2**64)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.int64(-7), -7),
        (np.uint8(200), 200),
        (np.int32(5), 5),
        (np.float32(1.5), 1.5),
        (np.float64(2.25), 2.25),
        (np.bool_(True), True),
    ],
)
def test_numpy_scalars_become_python_scalars(value: object, expected: object) -> None:
    out = round_trip(value)
    assert out == expected
    assert type(out) is type(expected)


# -- tensors ---------------------------------------------------------------------------------

TENSORS = {
    "float32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
    "bfloat16": torch.linspace(-3, 3, 10, dtype=torch.bfloat16),
    "float16": torch.tensor([0.5, -1.25, 65504.0], dtype=torch.float16),
    "float64": torch.tensor([[math.pi, -math.e]], dtype=torch.float64),
    "int64": torch.tensor([-(2**62), 0, 2**62 + 1], dtype=torch.int64),
    "int32": torch.arange(-5, 5, dtype=torch.int32).reshape(2, 5),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "bool": torch.tensor([[True, False, True], [False, False, True]]),
    "complex64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
    "0-d": torch.tensor(3.5),
    "0-d int": torch.tensor(-9, dtype=torch.int64),
    "empty": torch.empty(0),
    "empty 2-d": torch.empty(0, 3, dtype=torch.int64),
    "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    "strided slice": torch.arange(20, dtype=torch.int64)[1::3],
    "offset slice": torch.arange(20, dtype=torch.float64).reshape(4, 5)[2:],
    "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_tensor_round_trips_with_dtype_shape_and_values(name: str) -> None:
    t = TENSORS[name]
    out = round_trip(t)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert torch.equal(out, t)


def test_tensor_that_requires_grad_arrives_detached_with_equal_values() -> None:
    t = torch.randn(4, 3, requires_grad=True)
    out = round_trip(t)
    assert not out.requires_grad
    assert torch.equal(out, t.detach())


def test_non_contiguous_tensor_arrives_contiguous() -> None:
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()
    assert not t.is_contiguous()
    out = round_trip(t)
    assert out.is_contiguous()
    assert out.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_encode_does_not_copy_contiguous_tensor_memory() -> None:
    t = torch.arange(16, dtype=torch.float32)
    _, buffers = encode(t)
    assert len(buffers) == 1
    (buf,) = buffers
    assert buf.nbytes == 64
    t[0] = 42.0
    assert np.frombuffer(buf, dtype=np.float32)[0] == 42.0


def test_decoded_tensor_is_a_view_into_extra() -> None:
    t = torch.arange(1000, dtype=torch.int64)
    msg, extra = to_frame(t)
    out = decode(msg, extra)
    start, end = address_range(extra)
    assert start <= out.data_ptr() < end
    assert out.data_ptr() + out.nbytes <= end
    owner(extra)[:8] = (12345).to_bytes(8, "little")
    assert out[0].item() == 12345


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float32])
def test_decoded_tensor_of_any_dtype_shares_the_extra_bytearray(dtype: torch.dtype) -> None:
    t = torch.zeros(64, dtype=dtype)
    msg, extra = to_frame(t)
    out = decode(msg, extra)
    assert out.dtype == dtype
    start, end = address_range(extra)
    assert start <= out.data_ptr() < end
    backing = owner(extra)
    backing[:] = b"\x01" * len(backing)
    assert out.view(torch.uint8).flatten()[0].item() == 1


def test_several_tensors_in_one_message_get_aligned_buffers() -> None:
    value = [torch.ones(3, dtype=torch.uint8), torch.arange(5.0), torch.ones(7, dtype=torch.bool)]
    msg, _ = encode(value)
    descriptors = msgpack.unpackb(msg, ext_hook=lambda code, data: msgpack.unpackb(data))
    offsets = [d[2] for d in descriptors]
    assert offsets == [0, 16, 48]
    assert all(o % ALIGN == 0 for o in offsets)
    msg_view, extra = to_frame(value)
    out = decode(msg_view, extra)
    start, _ = address_range(extra)
    assert [t.data_ptr() - start for t in out] == [0, 16, 48]
    for got, want in zip(out, value, strict=True):
        assert torch.equal(got, want)


def test_tensors_nested_in_containers_round_trip() -> None:
    value = {"a": [torch.tensor([1, 2]), {"b": torch.tensor([[True]])}], "c": 3}
    out = round_trip(value)
    assert torch.equal(out["a"][0], torch.tensor([1, 2]))
    assert torch.equal(out["a"][1]["b"], torch.tensor([[True]]))
    assert out["c"] == 3


# -- numpy arrays ----------------------------------------------------------------------------

ARRAYS = {
    "float32": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
    "float64": np.array([math.pi, -math.inf, 0.0]),
    "int16": np.arange(-10, 10, dtype=np.int16),
    "uint64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "bool": np.array([[True, False], [False, True]]),
    "complex128": np.array([1 + 1j, -2j]),
    "big-endian": np.arange(5, dtype=">f8"),
    "0-d": np.array(7, dtype=np.int32),
    "empty": np.empty(0, dtype=np.float32),
    "empty 2-d": np.empty((2, 0), dtype=np.int64),
    "fortran order": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
    "strided": np.arange(30, dtype=np.float64)[::4],
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_numpy_array_round_trips_with_dtype_shape_and_values(name: str) -> None:
    a = ARRAYS[name]
    out = round_trip(a)
    assert isinstance(out, np.ndarray)
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    assert np.array_equal(out, a)


def test_decoded_array_is_a_view_into_extra() -> None:
    a = np.arange(100, dtype=np.int32)
    msg, extra = to_frame(a)
    out = decode(msg, extra)
    assert np.shares_memory(out, np.frombuffer(owner(extra), dtype=np.uint8))
    owner(extra)[:4] = (777).to_bytes(4, "little")
    assert out[0] == 777


# -- dataclasses -----------------------------------------------------------------------------


def test_registered_dataclass_round_trips() -> None:
    out = round_trip(Point(1, 2.5))
    assert type(out) is Point
    assert out == Point(1, 2.5)


def test_registered_dataclasses_nested_in_lists_and_dicts_round_trip() -> None:
    value = {
        "items": [Point(1, 0.5), Labelled("l", [Point(2, 1.0), Point(3, -1.0)], {"k": Point(4, 0)})]
    }
    out = round_trip(value)
    assert out == value
    assert type(out["items"][1].points[0]) is Point
    assert type(out["items"][1].meta["k"]) is Point


def test_dataclass_containing_tensor_and_array_round_trips_with_views() -> None:
    value = Batch("b", torch.arange(6, dtype=torch.float32).reshape(2, 3), np.ones(4, np.int16))
    msg, extra = to_frame(value)
    out = decode(msg, extra)
    assert type(out) is Batch
    assert out.name == "b"
    assert torch.equal(out.data, value.data)
    assert np.array_equal(out.weights, value.weights)
    start, end = address_range(extra)
    assert start <= out.data.data_ptr() < end


def test_dataclass_fields_not_in_init_are_recomputed() -> None:
    out = round_trip(WithDerived(21))
    assert type(out) is WithDerived
    assert (out.a, out.doubled) == (21, 42)


def test_register_is_idempotent_and_returns_the_class() -> None:
    assert register(Point) is Point
    assert register(Point) is Point
    assert round_trip(Point(5, 6.0)) == Point(5, 6.0)


def test_register_refuses_a_non_dataclass() -> None:
    class NotADataclass:
        pass

    with pytest.raises(SerializationError, match="dataclass"):
        register(NotADataclass)
    with pytest.raises(SerializationError, match="dataclass"):
        register(int)


def test_register_refuses_a_dataclass_instance() -> None:
    with pytest.raises(SerializationError, match="dataclass"):
        register(Point(1, 2.0))  # type: ignore[arg-type,unused-ignore]


def test_register_refuses_a_class_defined_inside_a_function() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(SerializationError, match="module level"):
        register(Local)
    with pytest.raises(SerializationError, match="Local"):
        encode(Local(1))  # and it was not registered


# -- refused values --------------------------------------------------------------------------


def a_function() -> None:
    pass


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "builtins.set"),
        (frozenset(), "builtins.frozenset"),
        (object(), "builtins.object"),
        (Unregistered(1), "Unregistered"),
        (a_function, "function"),
        (lambda: None, "function"),
        (1 + 2j, "builtins.complex"),
        (np.array([object()], dtype=object), "numpy"),
        ([1, {"nested": {3}}], "builtins.set"),
        ({"k": [Point(1, 2.0), Unregistered(2)]}, "Unregistered"),
    ],
)
def test_unsupported_values_raise_serialization_error_naming_the_type(
    value: object, type_name: str
) -> None:
    with pytest.raises(SerializationError) as info:
        encode(value)
    assert type_name in str(info.value)


def test_object_array_error_says_why() -> None:
    with pytest.raises(SerializationError, match="objects"):
        encode(np.array(["a", 1], dtype=object))


def test_encode_after_a_refused_value_is_unaffected() -> None:
    with pytest.raises(SerializationError):
        encode([1, 2, torch.ones(3), {object()}])
    msg, buffers = encode([7, torch.arange(3)])
    assert len(buffers) == 1
    data = b"".join(bytes(p) for p in encode_frame(msg, buffers))
    (frame,) = FrameDecoder(1 << 20).feed(data)
    out = decode(*frame)
    assert out[0] == 7
    assert torch.equal(out[1], torch.arange(3))


def test_dataclass_subclass_of_registered_is_not_implicitly_registered() -> None:
    with pytest.raises(SerializationError, match="SubPoint"):
        encode(SubPoint(1, 2.0))


@dataclasses.dataclass
class SubPoint(Point):
    pass


# -- forged input ----------------------------------------------------------------------------


def extra_of(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.mark.parametrize(
    "descriptor",
    [
        ["float32", [2], 64, 8],  # offset beyond extra
        ["float32", [4], 24, 16],  # runs past the end
        ["float32", [2], -16, 8],  # negative offset
        ["float32", [2], 0, 4],  # nbytes too small for the shape
        ["float32", [2], 0, 12],  # nbytes too large for the shape
        ["float32", [-2], 0, 8],  # negative dimension
        ["float32", "2", 0, 8],  # shape not a list
        ["float32", [2.0], 0, 8],  # float dimension
        ["float99", [2], 0, 8],  # unknown dtype
        ["Tensor", [2], 0, 8],  # a torch attribute that is not a dtype
        ["float32", [2], "0", 8],  # non-integer offset
        ["float32", [2], 0, "8"],  # non-integer length
        ["float32", [2], 0],  # too few fields
        ["float32", [2], 0, 8, 0],  # too many fields
        [["float32"], [2], 0, 8],  # dtype not a string
        ["float32", [2**40, 2**40], 0, 8],  # huge shape
    ],
)
def test_forged_tensor_descriptor_raises_protocol_error(descriptor: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        decode(forged(EXT_TENSOR, descriptor), extra_of(32))


@pytest.mark.parametrize(
    "descriptor",
    [
        ["<f4", [2], 64, 8],
        ["<f4", [4], 24, 16],
        ["<f4", [2], -16, 8],
        ["<f4", [2], 0, 4],
        ["<f4", [-2], 0, 8],
        ["not a dtype", [2], 0, 8],
        ["|O", [1], 0, 8],  # an array of Python objects
        ["<f4", [2], 0],
    ],
)
def test_forged_array_descriptor_raises_protocol_error(descriptor: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        decode(forged(EXT_NDARRAY, descriptor), extra_of(32))


def test_forged_descriptor_error_names_the_bounds() -> None:
    with pytest.raises(ProtocolError, match=r"\[64, \+8\).*32 bytes"):
        decode(forged(EXT_TENSOR, ["float32", [2], 64, 8]), extra_of(32))


def test_tensor_descriptor_with_no_extra_at_all_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(forged(EXT_TENSOR, ["int64", [1], 0, 8]))


def test_tensor_ext_payload_that_is_not_msgpack_raises_protocol_error() -> None:
    msg = msgpack.packb(msgpack.ExtType(EXT_TENSOR, b"\xc1garbage"))
    with pytest.raises(ProtocolError):
        decode(msg, extra_of(32))


def test_unknown_extension_code_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unknown extension type 99"):
        decode(msgpack.packb(msgpack.ExtType(99, b"")))


@pytest.mark.parametrize(
    "payload",
    [["tests.runtime.call.test_serde:Point"], "just a string", [1, {"x": 1}], ["a:B", [1, 2]]],
)
def test_malformed_dataclass_payload_raises_protocol_error(payload: object) -> None:
    with pytest.raises(ProtocolError):
        decode(forged(EXT_DATACLASS, payload))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (["orchestr_no_such_module_xyz:Thing", {}], "not registered"),
        (["json:JSONDecoder", {}], "not registered"),
        (["tests.runtime.call.test_serde:Unregistered", {"x": 1}], "not registered"),
        (["tests.runtime.call.test_serde:Point", {"x": 1, "z": 2}], "cannot rebuild"),
        (["tests.runtime.call.test_serde:Point", {"x": 1}], "cannot rebuild"),
        (["tests.runtime.call.test_serde:Point", {1: 1, 2: 2}], "cannot rebuild"),
    ],
)
def test_dataclass_that_cannot_be_rebuilt_raises_serialization_error(
    payload: object, match: str
) -> None:
    with pytest.raises(SerializationError, match=match):
        decode(forged(EXT_DATACLASS, payload))


def test_decoding_never_imports_the_module_a_dataclass_names(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "orchestr_planted_mod.py"
    planted.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SerializationError, match="not registered in this process"):
        decode(forged(EXT_DATACLASS, ["orchestr_planted_mod:X", {}]))
    assert not (tmp_path / "ran").exists()
    assert "orchestr_planted_mod" not in sys.modules


def test_nested_dataclasses_past_the_depth_limit_are_refused() -> None:
    payload = forged(EXT_DATACLASS, ["tests.runtime.call.test_serde:Point", {"x": 1, "y": 2}])
    for _ in range(400):
        payload = msgpack.packb(
            msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["a:B", {"x": msgpack.unpackb(payload)}]))
        )
    with pytest.raises(ProtocolError, match="nested more than"):
        decode(payload)


def test_plain_decoding_refuses_every_extension_type() -> None:
    assert decode_plain(msgpack.packb([0, 0, {"nonce": b"x"}])) == [0, 0, {"nonce": b"x"}]
    for code in (EXT_DATACLASS, 1, 2, 99):
        with pytest.raises(ProtocolError, match="only plain values"):
            decode_plain(msgpack.packb([0, 0, msgpack.ExtType(code, b"\x90")]))
    with pytest.raises(ProtocolError, match="malformed"):
        decode_plain(b"\xc1")


def test_truncated_message_raises_protocol_error() -> None:
    msg, _ = encode({"key": [1, 2, 3, "a long enough string"]})
    with pytest.raises(ProtocolError):
        decode(msg[:-3])


def test_trailing_bytes_after_the_value_raise_protocol_error() -> None:
    msg, _ = encode([1, 2])
    with pytest.raises(ProtocolError):
        decode(msg + b"\x01")


# -- fuzz ------------------------------------------------------------------------------------


def decode_or_refuse(msg: bytes, extra: bytes) -> None:
    try:
        decode(msg, memoryview(bytearray(extra)))
    except (ProtocolError, SerializationError):
        pass


@settings(max_examples=200, deadline=None)
@given(msg=st.binary(max_size=200), extra=st.binary(max_size=64))
def test_decode_of_random_bytes_returns_or_raises_only_orchestr_errors(
    msg: bytes, extra: bytes
) -> None:
    decode_or_refuse(msg, extra)


descriptor_field = (
    st.integers(-(2**63), 2**64 - 1)
    | st.integers(-20, 80)
    | st.text(max_size=8)
    | st.sampled_from(["float32", "bfloat16", "bool", "int64", "<f4", "|b1", ">i8", "|O", "V0"])
    | st.lists(st.integers(-2, 2**33) | st.booleans() | st.floats(), max_size=4)
    | st.none()
)

dataclass_name = st.sampled_from(
    [
        "tests.runtime.call.test_serde:Point",
        "tests.runtime.call.test_serde:WithDerived",
        "tests.runtime.call.test_serde:Nope",
        "orchestr_no_such_module_xyz:X",
        "json:JSONDecoder",
        "",
        ":",
        ".relative:X",
    ]
)


@st.composite
def forged_message(draw: st.DrawFn) -> bytes:
    code = draw(st.sampled_from([EXT_TENSOR, EXT_NDARRAY, EXT_DATACLASS, 4, 16, 99]))
    if code == EXT_DATACLASS:
        fields = draw(
            st.dictionaries(
                st.sampled_from(["x", "y", "a", "z"]) | st.integers(-100, 100), descriptor_field
            )
        )
        payload: object = draw(st.sampled_from([[draw(dataclass_name), fields], fields]))
    else:
        payload = draw(st.lists(descriptor_field, min_size=3, max_size=5))
    ext = msgpack.ExtType(code, packb(payload))
    return packb(draw(st.sampled_from([ext, [ext], {"k": ext}])))


@settings(max_examples=200, deadline=None)
@given(msg=forged_message(), extra=st.binary(max_size=64))
def test_decode_of_forged_extensions_returns_or_raises_only_orchestr_errors(
    msg: bytes, extra: bytes
) -> None:
    decode_or_refuse(msg, extra)
