#!/usr/bin/python3
"""A reference tool endpoint for `sandboxer dispatch-tool` (docs/tool-requests.md).

It listens on a Unix socket (created owner-only), reads one newline-terminated JSON request per
connection until the dispatcher's write-side EOF, and answers with one JSON line that echoes the
request's version, run, lease, consumer and request ids and carries a payload. Tests use its
modes to misbehave on purpose.

    endpoint.py --socket PATH [--log FILE] [--mode echo|decline|wrong-ids|garbage|close|slow]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

IDS = ("version", "run_id", "lease_id", "consumer", "request_id")


def answer(request: dict[str, object], mode: str, count: int) -> bytes:
    """The response line for one request in this mode."""
    if mode == "garbage":
        return b"this is not json\n"
    ids = {key: request.get(key) for key in IDS}
    if mode == "wrong-ids":
        ids["request_id"] = f"{ids['request_id']}-other"
    payload: dict[str, object] = {"received": request.get("payload"), "count": count}
    if mode == "decline":
        payload = {"declined": True, "reason": "optional upload declined; use the artifact link"}
    return json.dumps({**ids, "payload": payload}).encode() + b"\n"


def serve(path: str, log: str | None, mode: str) -> None:
    os.umask(0o077)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(8)
        print("ready", flush=True)
        count = 0
        while True:
            connection, _ = server.accept()
            with connection:
                data = b""
                while chunk := connection.recv(65536):
                    data += chunk
                count += 1
                if log is not None:
                    with open(log, "ab") as stream:
                        stream.write(data if data.endswith(b"\n") else data + b"\n")
                if mode == "close":
                    continue  # answer nothing: a transport failure for the dispatcher
                if mode == "slow":
                    time.sleep(60)
                try:
                    request = json.loads(data)
                except ValueError:
                    continue
                connection.sendall(answer(request, mode, count))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--log")
    parser.add_argument("--mode", default="echo", choices=("echo", "decline", "wrong-ids", "garbage", "close", "slow"))
    args = parser.parse_args()
    try:
        serve(args.socket, args.log, args.mode)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
