"""demo-harness: the console entry point of the example harness.

demo-harness --help
demo-harness connector            print what the connector would connect to
demo-harness state [TEXT]         write TEXT to $XDG_STATE_HOME/demo-harness/note, read it back
demo-harness interfaces           print the network interfaces this process sees
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from demo_connector import describe


def _state(text: str) -> int:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    directory = os.path.join(base, "demo-harness")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, "note")
    with open(path, "w") as stream:
        stream.write(text)
    with open(path) as stream:
        print(json.dumps({"path": path, "read_back": stream.read()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the harness."""
    parser = argparse.ArgumentParser(prog="demo-harness", description="Example agent harness for sandboxer runtimes.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("connector", help="print what the connector would connect to")
    state = commands.add_parser("state", help="write to the XDG state dir and read it back")
    state.add_argument("text", nargs="?", default="hello from demo-harness")
    commands.add_parser("interfaces", help="print the network interfaces this process sees")
    args = parser.parse_args(argv)
    if args.command == "connector":
        print(json.dumps(describe()))
        return 0
    if args.command == "state":
        return _state(args.text)
    if args.command == "interfaces":
        print(json.dumps(sorted(name for _, name in socket.if_nameindex())))
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
