"""What watching costs (issue 35): `list` with each running sandbox's work (a git command in each)
and without it, and `usage` of one sandbox, through the service, beside an exec of `true` (the
floor of anything that runs a command in a sandbox), in one run.

    .venv/bin/python benchmarks/bench_watch.py [--rounds N] [--sandboxes N] [--json]

Run as root (a bwrap broker with cgroups). Each figure is the median of `--rounds` calls of the
Python client (`sandboxer.Client`) from this one process, so the CLI's start is not in them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench_sandbox import World, serving, timed


def median_ms(call: Callable[[], object], rounds: int) -> float:
    return round(timed(call, rounds), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description="the cost of list, work and usage")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sandboxes", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, object] = {"rounds": args.rounds, "sandboxes": args.sandboxes}
    with tempfile.TemporaryDirectory(prefix="sbx-watch-") as tmp:
        Path(tmp).chmod(0o755)
        world = World(Path(tmp))
        with serving(world) as client:
            sandboxes = [client.create("bench") for _ in range(args.sandboxes)]
            one = sandboxes[0]
            one.exec(["true"])
            results["exec_true_ms"] = median_ms(lambda: one.exec(["true"]), args.rounds)
            results["usage_ms"] = median_ms(one.usage, args.rounds)
            results["work_ms"] = median_ms(one.work_state, args.rounds)
            without = median_ms(lambda: client.list(work=False), args.rounds)
            with_work = median_ms(client.list, args.rounds)
            results["list_without_work_ms"], results["list_with_work_ms"] = without, with_work
            results["list_work_per_sandbox_ms"] = round((with_work - without) / args.sandboxes, 2)
            for sandbox in sandboxes:
                sandbox.teardown()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for key, value in results.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
