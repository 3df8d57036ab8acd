"""The attacker: run as another, unprivileged user (see ``conftest.attack``), with only the
standard library (the cluster's interpreter and packages need not be readable to it).

Each mode takes one JSON object as its argument and prints one JSON object:

- ``send``: connect to ``port``, send ``data`` (hex), read until the server closes or ``wait``
  seconds pass; prints what came back (hex) and whether the server closed the connection.
- ``hold``: open ``count`` connections to ``port`` and send nothing; after ``first`` seconds,
  and again after ``then`` more, print how many the server has closed.
- ``serve``: listen on ``port`` (a port someone else just left) for ``seconds``, as a fake
  server that sends each connection ``greet`` (hex) when it comes and ``reply`` (hex) each time
  it has read something, or with ``relay`` set, passes the connection through to that port;
  prints what each connection sent, in order.
- ``peek``: open each of ``fds`` of process ``pid`` through ``/proc/PID/fd`` read-only (as an
  ``shm`` reader maps an owner's segment) and read ``nbytes`` from it; prints, per fd, the
  error's name or the bytes read (hex).
- ``flood``: post a JSON body of about ``mib`` MiB (``{"prompt": "hello world ..."}``, to
  ``path``) on ``port``; prints the status line's code (0: none) and the seconds it took.
- ``unix``: connect to the Unix-domain socket at ``path`` and send ``data`` (hex); prints the
  error's name, or what came back (hex).
- ``cmdline``: read the command lines of every process; prints them.
- ``http``: send each of ``requests`` (``[method, path, headers, body]``) to ``port`` over
  HTTP/1.1 without following redirects; prints, per request, the status, the ``Location``
  and ``Set-Cookie`` headers and the body's first 2,000 characters. Also tries to read each
  of ``files``; prints, per file, the error's name or ``read``.
- ``spray``: to each of ``ports`` at once, send each of ``payloads`` (hex) on a connection
  of its own and read for ``wait`` seconds; prints, per port, what came back (hex) or the
  error's name, per payload.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from typing import Any


def _read_all(sock: socket.socket, wait: float) -> tuple[bytes, bool]:
    sock.settimeout(wait)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return data, True
    except TimeoutError:
        return data, False


def send(args: dict[str, Any]) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", args["port"]), timeout=10) as sock:
        try:
            sock.sendall(bytes.fromhex(args["data"]))
        except (ConnectionResetError, BrokenPipeError):
            return {"received": "", "closed": True}
        data, closed = _read_all(sock, args.get("wait", 5.0))
    return {"received": data.hex(), "closed": closed}


def _is_closed(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(65536) == b"" or _is_closed(sock)
    except (ConnectionResetError, BrokenPipeError):
        return True


def hold(args: dict[str, Any]) -> dict[str, Any]:
    socks = [socket.create_connection(("127.0.0.1", args["port"])) for _ in range(args["count"])]
    time.sleep(args["first"])
    first = sum(_is_closed(s) for s in socks)
    time.sleep(args["then"])
    then = sum(_is_closed(s) for s in socks)
    for s in socks:
        s.close()
    return {"closed_first": first, "closed_then": then}


def serve(args: dict[str, Any]) -> dict[str, Any]:
    received: list[list[str]] = []
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args["port"]))
    listener.listen()
    listener.settimeout(0.2)
    print("listening", flush=True)
    deadline = time.monotonic() + args["seconds"]

    def pipe(src: socket.socket, dst: socket.socket | None, record: list[str] | None) -> None:
        src.settimeout(0.5)
        while time.monotonic() < deadline:
            try:
                chunk = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            if record is not None:
                record.append(chunk.hex())
            if dst is not None:
                try:
                    dst.sendall(chunk)
                except OSError:
                    break
            elif args.get("reply"):
                src.sendall(bytes.fromhex(args["reply"]))
        for s in (src, dst):
            if s is not None:
                s.close()

    threads = []
    while time.monotonic() < deadline:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        record: list[str] = []
        received.append(record)
        if args.get("greet"):
            conn.sendall(bytes.fromhex(args["greet"]))
        if args.get("relay"):
            upstream = socket.create_connection(("127.0.0.1", args["relay"]))
            pair: list[tuple[socket.socket, socket.socket | None, list[str] | None]] = [
                (conn, upstream, record),
                (upstream, conn, None),
            ]
        else:
            pair = [(conn, None, record)]
        for src, dst, into in pair:
            t = threading.Thread(target=pipe, args=(src, dst, into), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join(1.0)
    return {"connections": ["".join(r) for r in received]}


def peek(args: dict[str, Any]) -> dict[str, Any]:
    got = {}
    for fd in args["fds"]:
        try:
            with open(f"/proc/{args['pid']}/fd/{fd}", "rb") as f:
                got[str(fd)] = f.read(args["nbytes"]).hex()
        except OSError as exc:
            got[str(fd)] = type(exc).__name__
    return {"fds": got}


def flood(args: dict[str, Any]) -> dict[str, Any]:
    words = int(args["mib"] * (1 << 20)) // 12
    body = b'{"model": "m", "max_tokens": 1, "prompt": "' + b"hello world " * words + b'"}'
    head = (
        f"POST {args['path']} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", args["port"]), timeout=60) as sock:
        try:
            sock.sendall(head + body)
        except (ConnectionResetError, BrokenPipeError):
            pass  # refused before it was all sent: the answer may still be there
        data, _ = _read_all(sock, 60.0)
    code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return {"status": code, "seconds": time.monotonic() - start}


def unix(args: dict[str, Any]) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(args["path"])
            sock.sendall(bytes.fromhex(args["data"]))
            data, _ = _read_all(sock, 5.0)
    except OSError as exc:
        return {"error": type(exc).__name__}
    return {"received": data.hex()}


def cmdline(args: dict[str, Any]) -> dict[str, Any]:
    import os

    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return {"cmdlines": lines}


def http(args: dict[str, Any]) -> dict[str, Any]:
    import http.client

    answers = []
    for method, path, headers, body in args["requests"]:
        conn = http.client.HTTPConnection("127.0.0.1", args["port"], timeout=10)
        try:
            conn.request(method, path, body=body.encode() if body else None, headers=headers)
            r = conn.getresponse()
            answers.append(
                {
                    "status": r.status,
                    "location": r.getheader("location") or "",
                    "set_cookie": r.getheader("set-cookie") or "",
                    "body": r.read(2000).decode(errors="replace"),
                }
            )
        finally:
            conn.close()
    files = {}
    for path in args.get("files", []):
        try:
            with open(path, "rb") as f:
                f.read(1)
            files[path] = "read"
        except OSError as exc:
            files[path] = type(exc).__name__
    return {"answers": answers, "files": files}


def spray(args: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, list[str]] = {}

    def one(port: int) -> None:
        out = []
        for payload in args["payloads"]:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(bytes.fromhex(payload))
                    data, _ = _read_all(sock, args.get("wait", 1.0))
                    out.append(data.hex())
            except OSError as exc:
                out.append(type(exc).__name__)
        found[str(port)] = out

    threads = [threading.Thread(target=one, args=(p,)) for p in args["ports"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


if __name__ == "__main__":
    mode, raw = sys.argv[1], sys.argv[2]
    modes = {
        "send": send,
        "hold": hold,
        "serve": serve,
        "peek": peek,
        "flood": flood,
        "unix": unix,
        "cmdline": cmdline,
        "http": http,
        "spray": spray,
    }
    print(json.dumps(modes[mode](json.loads(raw))))
