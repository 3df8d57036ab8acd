"""Reading HTTP/2 as a fake server captured it: frames, and their headers through HPACK."""

from __future__ import annotations

import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS, CONTINUATION = 1, 4, 9
#: What a server sends first: its (empty) SETTINGS, and the ACK of the client's.
SERVER_GREETING = struct.pack(">I", 0)[1:] + bytes([SETTINGS, 0]) + bytes(4)
SETTINGS_ACK = struct.pack(">I", 0)[1:] + bytes([SETTINGS, 1]) + bytes(4)


def header_blocks(data: bytes) -> list[list[tuple[str, str]]]:
    """The header lists of every HEADERS frame (with its CONTINUATIONs) in one direction of
    one connection, in order."""
    if data.startswith(PREFACE):
        data = data[len(PREFACE) :]
    decoder = hpack.Decoder()
    blocks: list[list[tuple[str, str]]] = []
    pending = b""
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        kind, flags = data[3], data[4]
        payload, data = data[9 : 9 + length], data[9 + length :]
        if kind == HEADERS:
            if flags & 0x8:  # PADDED
                payload = payload[1 : len(payload) - payload[0]]
            if flags & 0x20:  # PRIORITY
                payload = payload[5:]
            pending = payload
        elif kind == CONTINUATION:
            pending += payload
        else:
            continue
        if flags & 0x4:  # END_HEADERS
            blocks.append([(str(k), str(v)) for k, v in decoder.decode(pending)])
            pending = b""
    return blocks
