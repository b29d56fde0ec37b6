"""One gRPC call with Python's grpcio (C-core), the way a real router's client
library makes it, printing what that library reports: the status code and
details, as JSON.

    python3 grpcio_call.py <host:port> <unary|stream> <method path> <request hex>
"""
import json
import sys

import grpc


def main() -> None:
    target, kind, path, request_hex = sys.argv[1:5]
    request = bytes.fromhex(request_hex)
    identity = lambda b: b  # noqa: E731 - raw bytes both ways
    with grpc.insecure_channel(target) as channel:
        if kind == "unary":
            call = channel.unary_unary(path, request_serializer=identity, response_deserializer=identity)
            run = lambda: [call(request, timeout=20)]  # noqa: E731
        else:
            call = channel.unary_stream(path, request_serializer=identity, response_deserializer=identity)
            run = lambda: list(call(request, timeout=20))  # noqa: E731
        try:
            messages = run()
            print(json.dumps({"code": "OK", "details": "", "messages": len(messages)}))
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details() or ""}))


if __name__ == "__main__":
    main()
