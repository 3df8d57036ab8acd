"""Tests for the sans-IO call-path framing in ``orchestr._call._frames``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr._call._frames import HEADER, FrameDecoder, encode_frame, padded
from orchestr.errors import ProtocolError

Frame = tuple[bytes, bytes]

KIB64 = 64 * 1024  # the size of a socket read the decoder offers, at least


def join(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def raw_frame(msg: bytes, extra: bytes = b"") -> bytes:
    header: bytes = HEADER.pack(len(msg), len(extra))
    return header + msg + extra


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    """Feed ``chunks`` one by one, copying each frame before the next feed (as documented)."""
    frames: list[Frame] = []
    for chunk in chunks:
        frames.extend((bytes(m), bytes(e)) for m, e in decoder.feed(chunk))
    return frames


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# -- padded / encode_frame -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "expected"), [(0, 0), (1, 16), (15, 16), (16, 16), (17, 32), (33, 48)]
)
def test_padded_rounds_up_to_alignment(offset: int, expected: int) -> None:
    assert padded(offset) == expected


def test_header_is_u32_msg_len_then_u64_extra_len() -> None:
    assert HEADER.size == 12
    assert HEADER.pack(1, 2) == b"\x01\x00\x00\x00" + b"\x02" + b"\x00" * 7


def test_encode_frame_without_buffers_is_one_piece() -> None:
    parts = encode_frame(b"hello", [])
    assert parts == [HEADER.pack(5, 0) + b"hello"]


def test_encode_frame_aligns_each_buffer_to_16_bytes() -> None:
    bufs = [memoryview(b"abc"), memoryview(b"defgh"), memoryview(bytes(range(17)))]
    data = join(encode_frame(b"m", bufs))
    msg_len, extra_len = HEADER.unpack_from(data)
    assert (msg_len, extra_len) == (1, 32 + 17)
    extra = data[HEADER.size + msg_len :]
    assert len(extra) == extra_len
    assert extra[0:3] == b"abc"
    assert extra[3:16] == bytes(13)  # padding is zeros
    assert extra[16:21] == b"defgh"
    assert extra[21:32] == bytes(11)
    assert extra[32:49] == bytes(range(17))


def test_encode_frame_adds_no_padding_after_aligned_buffers() -> None:
    bufs = [memoryview(b"x" * 16), memoryview(b"y" * 32)]
    data = join(encode_frame(b"", bufs))
    assert HEADER.unpack_from(data) == (0, 48)
    assert data[HEADER.size :] == b"x" * 16 + b"y" * 32


def test_encode_frame_passes_buffers_through_without_copy() -> None:
    buf = memoryview(bytearray(b"payload"))
    parts = encode_frame(b"m", [buf])
    assert any(p is buf for p in parts)


# -- round trips -----------------------------------------------------------------------------


def test_round_trip_frame_without_buffers() -> None:
    frames = FrameDecoder(1 << 20).feed(join(encode_frame(b"\x93\x01\x02\x03", [])))
    assert [(bytes(m), bytes(e)) for m, e in frames] == [(b"\x93\x01\x02\x03", b"")]


def test_round_trip_frame_with_buffers_exposes_them_at_aligned_offsets() -> None:
    bufs = [memoryview(b"abc"), memoryview(b"0123456789abcdefXYZ")]
    frames = FrameDecoder(1 << 20).feed(join(encode_frame(b"msg", bufs)))
    assert len(frames) == 1
    msg, extra = frames[0]
    assert bytes(msg) == b"msg"
    assert extra.nbytes == 16 + 19
    assert bytes(extra[0:3]) == b"abc"
    assert bytes(extra[16:35]) == b"0123456789abcdefXYZ"


def test_empty_frame_round_trips() -> None:
    frames = FrameDecoder(1 << 20).feed(HEADER.pack(0, 0))
    assert [(bytes(m), bytes(e)) for m, e in frames] == [(b"", b"")]


def test_extra_of_a_frame_with_buffers_is_writable_memory_it_owns() -> None:
    decoder = FrameDecoder(1 << 20)
    (_, extra), *_ = decoder.feed(raw_frame(b"m", b"0123456789abcdef"))
    assert not extra.readonly
    assert isinstance(extra.obj, bytearray)
    decoder.feed(raw_frame(b"n", b"fedcba9876543210"))
    assert bytes(extra) == b"0123456789abcdef"  # not overwritten by the next frame


@pytest.mark.parametrize("extra", [b"", b"buffers!" * 3])
def test_frame_fed_one_byte_at_a_time_arrives_once_at_the_last_byte(extra: bytes) -> None:
    data = raw_frame(b"a message", extra)
    decoder = FrameDecoder(1 << 20)
    for i in range(len(data) - 1):
        assert decoder.feed(data[i : i + 1]) == []
    frames = [(bytes(m), bytes(e)) for m, e in decoder.feed(data[-1:])]
    assert frames == [(b"a message", extra)]


def test_stream_split_at_every_byte_boundary_yields_the_same_frames() -> None:
    expected = [(b"one", b""), (b"two", b"\x01" * 20), (b"", b"\x02" * 3), (b"four" * 10, b"")]
    data = b"".join(raw_frame(m, e) for m, e in expected)
    for cut in range(len(data) + 1):
        got = feed_all(FrameDecoder(1 << 20), [data[:cut], data[cut:]])
        assert got == expected, f"split at byte {cut}"


def test_stream_fed_one_byte_at_a_time_yields_every_frame() -> None:
    expected = [(bytes([i]) * i, bytes([255 - i]) * (i % 3) * 7) for i in range(20)]
    data = b"".join(raw_frame(m, e) for m, e in expected)
    got = feed_all(FrameDecoder(1 << 20), [data[i : i + 1] for i in range(len(data))])
    assert got == expected


def test_many_small_frames_in_one_chunk() -> None:
    expected = [(f"msg {i}".encode(), b"") for i in range(1000)]
    data = b"".join(raw_frame(m, e) for m, e in expected)
    got = [(bytes(m), bytes(e)) for m, e in FrameDecoder(1 << 20).feed(data)]
    assert got == expected


def test_many_small_frames_in_one_chunk_larger_than_the_shared_buffer() -> None:
    # 5000 frames of 112 bytes: the chunk (560 KB) is bigger than the decoder's initial buffer,
    # so feed() must refill the shared buffer while earlier frames of the same call are held.
    expected = [(bytes([i % 256]) * 100, b"") for i in range(5000)]
    data = b"".join(raw_frame(m, e) for m, e in expected)
    frames = FrameDecoder(1 << 30).feed(data)
    got = [(bytes(m), bytes(e)) for m, e in frames]
    wrong = [i for i, (g, x) in enumerate(zip(got, expected, strict=True)) if g != x]
    assert len(got) == len(expected)
    assert wrong == [], f"{len(wrong)} frames corrupted, first at index {wrong[0]}"


def test_frames_with_and_without_buffers_interleaved_in_one_chunk() -> None:
    expected = [(b"m%d" % i, (b"e%d" % i) * (i % 4)) for i in range(200)]
    data = b"".join(raw_frame(m, e) for m, e in expected)
    got = [(bytes(m), bytes(e)) for m, e in FrameDecoder(1 << 20).feed(data)]
    assert got == expected


@pytest.mark.parametrize("msg_len", [KIB64 - 1, KIB64, KIB64 + 1, 3 * KIB64, 5 * 1024 * 1024])
def test_messages_without_buffers_of_any_size_round_trip(msg_len: int) -> None:
    msg = bytes(i % 251 for i in range(msg_len))
    data = raw_frame(msg) + raw_frame(b"after")
    got = feed_all(FrameDecoder(1 << 30), split_at(data, [7, 1000, msg_len // 2]))
    assert got == [(msg, b""), (b"after", b"")]


def test_large_frame_buffer_region_is_received_directly_into_extra() -> None:
    extra_len = 8 * 1024 * 1024 + 5
    payload = bytes(i % 253 for i in range(4096)) * (extra_len // 4096) + b"tail!"
    assert len(payload) == extra_len
    decoder = FrameDecoder(1 << 30)
    head = HEADER.pack(3, extra_len) + b"msg" + payload[:100]
    assert decoder.feed(head) == []

    # Like a BufferedProtocol transport: write straight into the memory get_buffer() hands out.
    target = decoder.get_buffer(-1)
    assert target.nbytes == extra_len - 100  # exactly the missing bytes of this frame
    owner = target.obj
    received = 100
    frames: list[tuple[memoryview, memoryview]] = []
    while received < extra_len:
        target = decoder.get_buffer(-1)
        assert target.obj is owner  # the same memory until the frame completes
        n = min(1 << 20, target.nbytes)
        target[:n] = payload[received : received + n]
        received += n
        frames = decoder.buffer_updated(n)
        if received < extra_len:
            assert frames == []
    assert len(frames) == 1
    msg, extra = frames[0]
    assert bytes(msg) == b"msg"
    assert extra.obj is owner  # the decoded buffer region is the memory the "kernel" wrote
    assert extra.nbytes == extra_len
    assert bytes(extra) == payload


def test_large_frame_followed_by_small_frame_in_one_chunk() -> None:
    extra = b"\xab" * (3 * 1024 * 1024)
    data = raw_frame(b"big", extra) + raw_frame(b"small") + raw_frame(b"x")[:5]
    decoder = FrameDecoder(1 << 30)
    got = [(bytes(m), bytes(e)) for m, e in decoder.feed(data)]
    assert got == [(b"big", extra), (b"small", b"")]
    assert [(bytes(m), bytes(e)) for m, e in decoder.feed(raw_frame(b"x")[5:])] == [(b"x", b"")]


# -- limits ----------------------------------------------------------------------------------


def test_oversized_frame_raises_protocol_error_naming_the_limit() -> None:
    decoder = FrameDecoder(1000)
    with pytest.raises(ProtocolError, match=r"1001 bytes.*limit of 1000 bytes"):
        decoder.feed(HEADER.pack(1, 1000))


def test_oversized_header_is_refused_before_its_body_arrives() -> None:
    decoder = FrameDecoder(4096)
    with pytest.raises(ProtocolError, match="4096"):
        decoder.feed(HEADER.pack(2**32 - 1, 2**64 - 1))


def test_oversized_message_without_buffers_is_refused() -> None:
    with pytest.raises(ProtocolError, match="limit of 10 bytes"):
        FrameDecoder(10).feed(HEADER.pack(11, 0))


def test_frame_of_exactly_max_bytes_is_accepted() -> None:
    got = feed_all(FrameDecoder(10), [raw_frame(b"12345", b"67890")])
    assert got == [(b"12345", b"67890")]


def test_oversized_header_split_across_feeds_is_refused_once_complete() -> None:
    decoder = FrameDecoder(100)
    header = HEADER.pack(50, 51)
    assert decoder.feed(header[:7]) == []
    with pytest.raises(ProtocolError, match="limit of 100 bytes"):
        decoder.feed(header[7:])


# -- fuzz ------------------------------------------------------------------------------------


def reference_parse(data: bytes, max_bytes: int) -> tuple[list[Frame], bool]:
    """The frames a correct decoder yields for ``data``, and whether it must refuse a header."""
    frames: list[Frame] = []
    pos = 0
    while len(data) - pos >= HEADER.size:
        msg_len, extra_len = HEADER.unpack_from(data, pos)
        if msg_len + extra_len > max_bytes:
            return frames, True
        body = pos + HEADER.size
        if len(data) - body < msg_len + extra_len:
            break
        frames.append(
            (data[body : body + msg_len], data[body + msg_len : body + msg_len + extra_len])
        )
        pos = body + msg_len + extra_len
    return frames, False


def check_decoder_against_reference(data: bytes, cuts: list[int], max_bytes: int) -> None:
    expected, must_refuse = reference_parse(data, max_bytes)
    decoder = FrameDecoder(max_bytes)
    got: list[Frame] = []
    refused = False
    for chunk in split_at(data, cuts):
        try:
            frames = decoder.feed(chunk)
        except ProtocolError:
            refused = True
            break
        for msg, extra in frames:
            assert isinstance(msg, memoryview)
            assert isinstance(extra, memoryview)
            got.append((bytes(msg), bytes(extra)))
    assert refused == must_refuse
    if refused:
        assert got == expected[: len(got)]
    else:
        assert got == expected
    for (got_msg, got_extra), (want_msg, want_extra) in zip(got, expected, strict=False):
        assert len(got_msg) == len(want_msg)
        assert len(got_extra) == len(want_extra)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=2000),
    cuts=st.lists(st.integers(0, 2000), max_size=20),
    max_bytes=st.integers(0, 1 << 20),
)
def test_random_bytes_yield_only_frames_or_protocol_error(
    data: bytes, cuts: list[int], max_bytes: int
) -> None:
    check_decoder_against_reference(data, cuts, max_bytes)


frame_strategy = st.tuples(
    st.binary(max_size=300), st.binary(max_size=300) | st.just(b""), st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(frame_strategy, max_size=12),
    garbage=st.binary(max_size=40),
    cuts=st.lists(st.integers(0, 8000), max_size=30),
    max_bytes=st.integers(0, 700),
)
def test_random_frame_streams_yield_headers_lengths_or_protocol_error(
    frames: list[tuple[bytes, bytes, bool]], garbage: bytes, cuts: list[int], max_bytes: int
) -> None:
    parts = []
    for msg, extra, lie in frames:
        if lie:  # a header whose lengths disagree with what follows: still just bytes
            parts.append(HEADER.pack(len(extra), len(msg)) + msg + extra)
        else:
            parts.append(raw_frame(msg, extra))
    data = b"".join(parts) + garbage
    check_decoder_against_reference(data, cuts, max_bytes)


def test_message_and_buffers_have_limits_of_their_own() -> None:
    dec = FrameDecoder(100, 1000)
    frames = dec.feed(b"".join(encode_frame(b"m" * 50, [memoryview(b"x" * 900)])))
    assert [bytes(m) for m, _ in frames] == [b"m" * 50]
    with pytest.raises(ProtocolError, match="ORCHESTR_MAX_MESSAGE_BYTES"):
        FrameDecoder(100, 1000).feed(HEADER.pack(200, 0))
    with pytest.raises(ProtocolError, match="ORCHESTR_MAX_BULK_BYTES"):
        FrameDecoder(100, 1000).feed(HEADER.pack(10, 2000))
