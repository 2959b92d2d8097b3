"""An orchestrator driving sandboxes through the Python API (docs/api.md shows this file).

    python3 examples/orchestrator.py --profile bwrap-local [--config-dir D] [--state-dir S]
    python3 examples/orchestrator.py --profile bwrap-local --socket /run/sandboxer/broker.sock

It gives a sandbox a task, runs it, streams its output, checks the live sandbox against its
plan, and tears it down; it prints a JSON summary and exits 0 when everything held. In-process
(`Broker`) or through a running service (`Client`): the one line that picks it is all that differs.
"""

from __future__ import annotations

import argparse
import json
import sys

from sandboxer import Broker, Client
from sandboxer.errors import ExecError, SandboxerError

TASK = """\
import pathlib, sys
words = sys.stdin.read().split()
pathlib.Path("/workspace/count.txt").write_text(f"{len(words)}\\n")
print(f"counted {len(words)} words")
print("a warning", file=sys.stderr)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--config-dir")
    parser.add_argument("--state-dir")
    parser.add_argument("--socket", help="use the service listening here instead of the broker in-process")
    args = parser.parse_args()
    broker = Client(args.socket) if args.socket else Broker(config_dir=args.config_dir, state_dir=args.state_dir)
    summary: dict[str, object] = {}
    try:
        with broker.create(args.profile) as sb:
            summary["id"] = sb.id
            ran = sb.exec(["python3", "-c", TASK], stdin=b"three small words", timeout=60)
            summary["task"] = {"status": ran.status, "stdout": ran.stdout.decode(), "stderr": ran.stderr.decode()}
            # Long outputs come as they are written, tagged with their stream.
            stream = sb.exec_stream(["sh", "-c", "cat /workspace/count.txt; echo done >&2"])
            summary["streamed"] = [[name, chunk.decode()] for name, chunk in stream]
            summary["streamed_status"] = stream.status
            summary["missing"] = sb.exec(["no-such-program"]).status  # 127, as the CLI's exec
            evidence = sb.inspect()
            summary["matches_plan"] = evidence.matches_plan
            summary["workspace_mib"] = evidence.limits["workspace_mib"]
            summary["listed"] = [info.status for info in broker.list() if info.id == sb.id]
        receipt = sb.teardown()  # the `with` block already tore it down: the same receipt
        summary["residue"] = list(receipt.residue)
        summary["listed_after"] = [info.id for info in broker.list() if info.id == sb.id]
        try:
            sb.exec(["true"])
        except ExecError as exc:  # the sandbox is gone: the broker cannot run it (exit status 125)
            summary["after_teardown"] = exc.status
    except SandboxerError as exc:
        print(f"orchestrator: {exc} (exit status {exc.status})", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
