"""`Client.exec(["true"])` through the services of two revisions of this repository, in the same
rounds: whether a change made the service's exec faster, on a machine whose speed drifts.

    .venv/bin/python benchmarks/compare_execs.py BEFORE [AFTER] [--rounds N]

BEFORE and AFTER are git revisions (AFTER: the working tree when not given). Each is exported
(`git archive`), installed as users install it (bench_sandbox.install_as_users_do) and served on
a state dir of its own, with a sandbox of the bench profile; both services run at once, and
their execs alternate round by round, each going first every other round. Give the same
revision twice to see the noise of the measurement itself (an A/A run). Prints the medians and
the 10th and 90th percentiles, in milliseconds; `--json` prints them as one document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_sandbox import REPO, World, install_as_users_do, serving


def exported(revision: str | None, into: Path) -> Path:
    """A tree of `revision` (None: the working tree itself)."""
    if revision is None:
        return REPO
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description="Client.exec through two revisions' services, alternating")
    parser.add_argument("before")
    parser.add_argument("after", nargs="?")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    revisions = {"before": args.before, "after": args.after}
    with tempfile.TemporaryDirectory(prefix="sbx-compare-") as tmp, contextlib.ExitStack() as stack:
        Path(tmp).chmod(0o755)  # as root the sandbox's uid must reach the runtime and the state dir
        sandboxes = {}
        for name, revision in revisions.items():
            root = Path(tmp) / name
            root.mkdir()
            root.chmod(0o755)
            source = exported(revision, Path(tmp) / f"{name}-source")
            world = World(root, install_as_users_do(root, source))
            client = stack.enter_context(serving(world))
            sandboxes[name] = stack.enter_context(client.create("bench"))
        for sandbox in sandboxes.values():
            for _ in range(20):  # both services warm: their spawners started, their caches filled
                sandbox.exec(["true"])
        samples: dict[str, list[float]] = {name: [] for name in sandboxes}
        order = list(sandboxes)
        for index in range(args.rounds):
            for name in order if index % 2 else reversed(order):
                start = time.perf_counter()
                sandboxes[name].exec(["true"])
                samples[name].append((time.perf_counter() - start) * 1000)
    results = {
        name: {
            "revision": revisions[name] or "working tree",
            "median_ms": round(statistics.median(values), 3),
            "p10_ms": round(statistics.quantiles(values, n=10)[0], 3),
            "p90_ms": round(statistics.quantiles(values, n=10)[-1], 3),
        }
        for name, values in samples.items()
    }
    if args.json:
        print(json.dumps({"rounds": args.rounds, **results}, indent=2))
    else:
        for name, result in results.items():
            print(
                f"{name:6} {result['revision']:>16}  median {result['median_ms']:.2f} ms"
                f"  p10 {result['p10_ms']:.2f}  p90 {result['p90_ms']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
