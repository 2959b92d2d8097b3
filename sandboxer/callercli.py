"""The caller commands — create, inspect, list, teardown, gc (and the owner's warm) — on a lean argparse parser.

Callers run these many times per task; typer's start-up alone (about 70 ms here, with pydantic)
would be most of a create/teardown cycle. The owner commands stay on the typer CLI
(sandboxer.cli) and `exec` on sandboxer.fastexec. Errors and JSON follow the same contract.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from sandboxer.dirs import Dirs, resolve_dirs
from sandboxer.errors import NotPendingError, ResidueError, UsageError
from sandboxer.output import flatten, print_result, report_failure


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sandboxer", description="Caller commands of the sandboxer broker.")
    parser.add_argument("--config-dir", help="owner config directory (env SANDBOXER_CONFIG)")
    parser.add_argument("--state-dir", help="live state directory (env SANDBOXER_STATE)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    create = commands.add_parser("create", help="create a sandbox from an approved profile and print its id")
    create.add_argument("--profile", required=True, help="an approved profile name")
    create.add_argument("--manifest", help="a lease manifest (docs/manifest.md)")
    create.add_argument("--bootstrap", help="a runtime bootstrap file (docs/bootstrap.md)")
    create.add_argument("--ttl", type=float, help="seconds until a running service tears it down (docs/service.md)")
    inspect = commands.add_parser("inspect", help="evidence observed from a live sandbox")
    inspect.add_argument("id", metavar="ID")
    commands.add_parser("list", help="list the sandboxes of this state dir")
    teardown = commands.add_parser("teardown", help="remove everything a sandbox owns; print the receipt")
    teardown.add_argument("id", metavar="ID")
    commands.add_parser("gc", help="finish sandboxes whose broker died mid-way")
    relay = commands.add_parser("dispatch-tool", help="relay one tool request from a sandbox's spool to its endpoint")
    relay.add_argument("id", metavar="ID")
    relay.add_argument("--lease", required=True, help="the tool-request lease")
    relay.add_argument("--request-id", required=True, help="the request id (requests/<id>.json)")
    relay.add_argument("--wait-seconds", required=True, type=int, help="how long to wait for it (0-300)")
    warm = commands.add_parser(
        "warm", help="start the warm containers a Docker profile keeps (ext.docker config.warm); remove stale ones"
    )
    warm.add_argument("profile", metavar="PROFILE")
    for sub in commands.choices.values():
        sub.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _run(args: argparse.Namespace, dirs: Dirs) -> None:
    # Each command imports only its own module: teardown, list and gc stay light.
    match args.command:
        case "create":
            from sandboxer.commands.create import create

            result = create(
                dirs, args.profile, manifest_path=args.manifest, bootstrap_path=args.bootstrap, ttl=args.ttl
            )
            print_result(result, result["id"], args.json)
        case "inspect":
            from sandboxer.commands.inspect import inspect

            result = inspect(dirs, args.id)
            print_result(result, "\n".join(f"{k}: {v}" for k, v in flatten(result)), args.json)
        case "list":
            from sandboxer.commands.teardown import list_sandboxes

            result = list_sandboxes(dirs)
            rows = [("ID", "PROFILE", "BACKEND", "STATUS", "CREATED")]
            rows += [
                (e["id"], str(e["profile"]), str(e["backend"]), e["status"], str(e["created_at"]))
                for e in result["sandboxes"]
            ]
            widths = [max(len(row[i]) for row in rows) for i in range(5)]
            table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
            print_result(result, table if result["sandboxes"] else "no sandboxes", args.json)
        case "teardown":
            from sandboxer.commands.teardown import receipt_or_raise, teardown

            receipt = teardown(dirs, args.id)
            lines = [f"removed {item}" for item in receipt["removed"]]
            lines += [f"RESIDUE {item}" for item in receipt["residue"]]
            print_result(receipt, "\n".join(lines) or f"{args.id}: nothing to remove", args.json)
            receipt_or_raise(receipt)
        case "dispatch-tool":
            from sandboxer.host.dispatch import dispatch

            result = dispatch(
                dirs.state, args.id, lease_id=args.lease, request_id=args.request_id, wait_seconds=args.wait_seconds
            )
            print_result(result, f"dispatched {result['request_id']} ({result['response']})", args.json)
        case "warm":
            from sandboxer.commands.warm import fill

            result = fill(dirs, args.profile)
            text = f"{result['profile']}: " + (
                "another fill is running"
                if result["busy"]
                else f"{result['warm']} warm (started {len(result['started'])}, removed {len(result['removed'])})"
            )
            print_result(result, text, args.json)
        case "gc":
            from sandboxer.commands.teardown import gc, receipt_or_raise

            result = gc(dirs)
            lines = [f"collected {r['id']}" + (" (RESIDUE)" if r["residue"] else "") for r in result["collected"]]
            print_result(result, "\n".join(lines) or "nothing to collect", args.json)
            for receipt in result["collected"]:
                receipt_or_raise(receipt)


def main(argv: list[str]) -> int:
    """Run one caller command; every error is one line (or a JSON object) and its exit status."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    as_json, debug = "--json" in head, "--debug" in head
    try:
        args = _parser().parse_args(argv)
        dirs = resolve_dirs(
            config_dir=args.config_dir,
            state_dir=args.state_dir,
            environ=os.environ,
            euid=os.geteuid(),
            home=os.path.expanduser("~"),
        )
        _run(args, dirs)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except KeyboardInterrupt:
        sys.stderr.write("sandboxer: interrupted\n")
        return 130
    except ResidueError as exc:  # the receipt (with its residue) is already the JSON document
        sys.stderr.write(f"sandboxer: {exc}\n")
        return exc.exit_status
    except NotPendingError as exc:  # the contract's retryable answer, not an error object
        sys.stderr.write(f"sandboxer: {exc}\n")
        if as_json:
            print_result({"status": "not-pending", "retryable": True}, "", True)
        return exc.exit_status
    except Exception as exc:
        return report_failure(exc, as_json=as_json, debug=debug)
    return 0
