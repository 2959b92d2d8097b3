"""Benchmark of the runtime tree digest v1 against a plain single-threaded reference walk.

Builds a realistic runtime (`/usr/bin/python3 -m venv --copies` plus the project's own runtime
dependencies), then measures, in one process run and interleaved round by round:

    reference   os.walk + lstat + hashlib.file_digest(sha256), records sorted -- the same format
    full        sandboxer.core.runtime.digest_runtime(path, state_dir=S, full=True)
    warm        sandboxer.core.runtime.digest_runtime(path, state_dir=S) with a warm stat cache
    cli warm    python -m sandboxer --state-dir S runtime digest PATH, in-process (SANDBOXER_NO_SERVICE=1)
    cli full    the same with --full
    service warm  the same command through the service of S (`sandboxer serve`, started here)

Every measurement must produce the same sha256; the run fails (exit 1) otherwise. Targets
(full <= 1.0x, warm and service warm <= 0.2x the reference time) are reported as PASS/MISS, never
as a failure.

    .venv/bin/python benchmarks/bench_digest.py [--work DIR] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandboxer.core.digest import RuntimeArtifactError
from sandboxer.core.runtime import digest_runtime

REPO = Path(__file__).resolve().parent.parent
HOST_PYTHON = "/usr/bin/python3"
RACY_SECONDS = 2.1  # the stat cache refuses files whose mtime/ctime is within 2 s of the walk
TARGETS = {"full": 1.0, "warm": 0.2, "service_warm": 0.2}  # at most this many times the reference time


class BenchError(Exception):
    """The benchmark could not run: the build failed or the runtime breaks the artifact rules."""


@dataclass
class Measurement:
    name: str
    what: str
    times: list[float] = field(default_factory=list)
    digests: set[str] = field(default_factory=set)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass(frozen=True)
class Tree:
    files: int
    entries: int
    bytes: int
    sha256: str
    newest_ns: int


# --- the runtime -----------------------------------------------------------------------------


def runtime_dependencies() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as stream:
        dependencies: list[str] = tomllib.load(stream)["project"]["dependencies"]
    return dependencies


def build_runtime(runtime: Path, dependencies: list[str], *, log: Callable[[str], None]) -> bool:
    """Create (or reuse) the venv at `runtime`; return True when it was built now."""
    stamp = runtime.with_name(runtime.name + ".stamp")
    want = json.dumps({"python": HOST_PYTHON, "dependencies": dependencies}, sort_keys=True)
    if runtime.is_dir() and stamp.is_file() and stamp.read_text() == want:
        log(f"reusing {runtime}")
        return False
    shutil.rmtree(runtime, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    log(f"building {runtime}: venv --copies + {len(dependencies)} dependencies")
    steps = [
        [HOST_PYTHON, "-m", "venv", "--copies", str(runtime)],
        [
            str(runtime / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            *dependencies,
        ],
    ]
    for argv in steps:
        # umask 022: the artifact rules refuse world-writable files, whatever the caller's umask is.
        done = subprocess.run(argv, capture_output=True, text=True, umask=0o022, check=False)
        if done.returncode != 0:
            # pip warns about the absent /opt/pypi-more index on this machine; show only real failures.
            noise = "/opt/pypi-more"
            output = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if noise not in line)
            raise BenchError(f"{' '.join(argv[:4])} ... failed (exit {done.returncode}):\n{output}")
    stamp.write_text(want)
    return True


# --- the reference: a straightforward single-threaded implementation of tree digest v1 --------


def reference_digest(root: str) -> Tree:
    broot = os.fsencode(root)
    st = os.lstat(broot)
    records = [(b".", b"D\0.\0%04o\n" % (st.st_mode & 0o7777))]
    files = total = 0
    newest = max(st.st_mtime_ns, st.st_ctime_ns)
    for directory, dirnames, filenames in os.walk(broot):
        prefix = os.path.relpath(directory, broot) + b"/" if directory != broot else b""
        for name in dirnames + filenames:
            relpath = prefix + name
            full = os.path.join(directory, name)
            st = os.lstat(full)
            newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
            perm = st.st_mode & 0o7777
            if stat.S_ISDIR(st.st_mode):
                records.append((relpath, b"D\0%s\0%04o\n" % (relpath, perm)))
            elif stat.S_ISREG(st.st_mode):
                with open(full, "rb") as stream:
                    content = hashlib.file_digest(stream, "sha256").hexdigest()
                files += 1
                total += st.st_size
                records.append((relpath, b"F\0%s\0%04o\0%s\n" % (relpath, perm, content.encode())))
            elif stat.S_ISLNK(st.st_mode):
                records.append((relpath, b"L\0%s\0%s\n" % (relpath, os.readlink(full))))
            else:
                raise BenchError(f"special file in the runtime: {full!r}")
    records.sort(key=lambda record: record[0])
    hasher = hashlib.sha256()
    for _, record in records:
        hasher.update(record)
    return Tree(files=files, entries=len(records), bytes=total, sha256=hasher.hexdigest(), newest_ns=newest)


# --- the measurements ------------------------------------------------------------------------


def cli(state: str, runtime: str, *extra: str, service: bool = False) -> tuple[float, str]:
    """The CLI's digest: in-process, or through the service answering for `state`."""
    argv = [sys.executable, "-m", "sandboxer", "--state-dir", state, "runtime", "digest", runtime, *extra]
    env = {key: value for key, value in os.environ.items() if not key.startswith("SANDBOXER_")}
    if not service:
        env["SANDBOXER_NO_SERVICE"] = "1"
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return elapsed, done.stdout


@dataclass(frozen=True)
class Setup:
    runtime: str
    state: str
    tree: Tree
    untimed: frozenset[str]  # digests of the untimed checks; they must agree too
    built: bool
    build_seconds: float


def prepare(work: Path, state: str, *, log: Callable[[str], None]) -> Setup:
    """Build the runtime, check the artifact rules, and warm the stat cache; nothing here is timed."""

    dependencies = runtime_dependencies()
    start = time.perf_counter()
    built = build_runtime(work / "runtime", dependencies, log=log)
    build_seconds = time.perf_counter() - start
    runtime = os.path.realpath(work / "runtime")  # a canonical path, as digest_runtime demands

    try:
        first = digest_runtime(runtime, state_dir=None, full=True)
    except RuntimeArtifactError as exc:
        raise BenchError(f"the built runtime breaks the artifact rules: {exc}") from exc
    tree = reference_digest(runtime)  # also leaves every file in the page cache

    # Files changed within the racy window are never cached: let the newest one age first.
    wait = (tree.newest_ns + int(RACY_SECONDS * 1e9) - time.time_ns()) / 1e9
    if wait > 0:
        log(f"waiting {wait:.1f} s for the newest file to leave the racy window")
        time.sleep(wait)
    warmup = digest_runtime(runtime, state_dir=state)
    if warmup.reused != 0 or warmup.bytes_read != warmup.bytes:
        raise BenchError(f"a fresh state dir already had a cache: {warmup}")
    warm = digest_runtime(runtime, state_dir=state)
    if warm.reused != warm.files:
        raise BenchError(f"warm run reused {warm.reused} of {warm.files} files; the stat cache did not hold")
    _, out = cli(state, runtime, "--json")
    document = json.loads(out)
    if document["reused"] != document["files"]:
        raise BenchError(f"warm CLI run reused {document['reused']} of {document['files']} files")
    return Setup(
        runtime=runtime,
        state=state,
        tree=tree,
        untimed=frozenset({first.sha256, warmup.sha256, warm.sha256, document["sha256"]}),
        built=built,
        build_seconds=build_seconds,
    )


def measure(setup: Setup, repeat: int) -> dict[str, Measurement]:

    runtime, state = setup.runtime, setup.state
    results = {
        "reference": Measurement("reference", "os.walk + lstat + hashlib.file_digest, one thread"),
        "full": Measurement("full", "digest_runtime(full=True)"),
        "warm": Measurement("warm", "digest_runtime(), warm stat cache"),
        "cli_warm": Measurement("cli_warm", "python -m sandboxer runtime digest PATH"),
        "cli_full": Measurement("cli_full", "python -m sandboxer runtime digest PATH --full"),
        "service_warm": Measurement("service_warm", "the same, through the service (warm stat cache)"),
    }

    def timed(name: str, action: Callable[[], str]) -> None:
        start = time.perf_counter()
        digest = action()
        results[name].times.append(time.perf_counter() - start)
        results[name].digests.add(digest)

    reused: list[int] = []

    def warm_digest() -> str:
        result = digest_runtime(runtime, state_dir=state)
        reused.append(result.files - result.reused)
        return result.sha256

    # Interleaved rounds, so drift (clock frequency, page cache, a noisy neighbour) hits all alike.
    for _ in range(repeat):
        timed("reference", lambda: reference_digest(runtime).sha256)
        timed("full", lambda: digest_runtime(runtime, state_dir=state, full=True).sha256)
        timed("warm", warm_digest)
    with serving(state):
        for _ in range(repeat):
            for name, extra, service in (("cli_warm", (), False), ("cli_full", ("--full",), False)):
                elapsed, out = cli(state, runtime, *extra, service=service)
                results[name].times.append(elapsed)
                results[name].digests.add(out.strip())
            elapsed, out = cli(state, runtime, service=True)
            results["service_warm"].times.append(elapsed)
            results["service_warm"].digests.add(out.strip())
    if any(reused):
        raise BenchError(f"timed warm runs re-read {reused} files; the stat cache did not hold")
    return results


@contextlib.contextmanager
def serving(state: str) -> Iterator[None]:
    """`sandboxer serve` for the state dir, answering on its socket, until the block ends."""
    socket_path = Path(state) / "broker.sock"
    argv = [sys.executable, "-m", "sandboxer", "--state-dir", state, "serve"]
    service = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                raise BenchError("the service did not start")
            time.sleep(0.05)
        yield
    finally:
        service.terminate()
        service.wait(timeout=30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="sandboxer-bench-"))
    try:
        work = Path(os.path.realpath(args.work)) if args.work else scratch
        work.mkdir(parents=True, exist_ok=True)
        setup = prepare(work, str(scratch / "state"), log=log)  # the broker creates the state dir 0700
        results = measure(setup, args.repeat)
        return report(results, setup, repeat=args.repeat)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report(results: dict[str, Measurement], setup: Setup, *, repeat: int) -> dict[str, Any]:
    tree = setup.tree
    reference = results["reference"].median
    digests = sorted(setup.untimed.union(*(m.digests for m in results.values())))
    rows = {}
    for name, m in results.items():
        rows[name] = {
            "what": m.what,
            "median_s": m.median,
            "times_s": m.times,
            "mb_per_s": tree.bytes / 1e6 / m.median,
            "files_per_s": tree.files / m.median,
            "vs_reference": m.median / reference,
            "sha256": sorted(m.digests),
        }
    targets = {
        name: {"ratio": rows[name]["vs_reference"], "limit": limit, "pass": rows[name]["vs_reference"] <= limit}
        for name, limit in TARGETS.items()
    }
    return {
        "benchmark": "runtime-digest",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "runtime": {
            "path": setup.runtime,
            "built_now": setup.built,
            "build_s": setup.build_seconds,
            "files": tree.files,
            "entries": tree.entries,
            "bytes": tree.bytes,
        },
        "repeat": repeat,
        "sha256": digests[0] if len(digests) == 1 else None,
        "agree": len(digests) == 1,
        "digests": digests,
        "results": rows,
        "targets": targets,
    }


def print_table(document: dict[str, Any]) -> None:
    tree = document["runtime"]
    print()
    print(
        f"runtime digest: {tree['files']} files, {tree['entries']} entries, {tree['bytes'] / 1e6:.1f} MB; "
        f"median of {document['repeat']}; {document['machine']['cpus']} CPUs, Python {document['machine']['python']}"
    )
    header = ("measurement", "median", "MB/s", "files/s", "x ref")
    rows = [header]
    for name, row in document["results"].items():
        rows.append(
            (
                name,
                f"{row['median_s'] * 1000:.1f} ms",
                f"{row['mb_per_s']:,.0f}",
                f"{row['files_per_s']:,.0f}",
                f"{row['vs_reference']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))]
        print("  ".join(cells))
    print()
    for name, target in document["targets"].items():
        verdict = "PASS" if target["pass"] else "MISS"
        print(f"{verdict}  {name} = {target['ratio']:.2f}x reference (target <= {target['limit']:.1f}x)")
    if document["agree"]:
        print(f"sha256 {document['sha256']} (all measurements agree)")
    else:
        print("FAIL  the measurements disagree on the digest: " + ", ".join(document["digests"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", metavar="DIR", help="build or reuse the runtime in DIR/runtime (kept)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per measurement (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        document = run(args)
    except BenchError as exc:
        print(f"bench_digest: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print_table(document)
    if not document["agree"]:
        if args.json:
            print("bench_digest: the measurements disagree on the digest", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
