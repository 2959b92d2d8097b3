"""Many creates, execs and teardowns at once through one root service with a warm pool, and
what must hold afterwards (test_stress.py; `make stress` runs the large version).

Each sandbox's life is create → a few execs → teardown, run by one of many threads, most
through `sandboxer.Client` and some through the CLI. The sandboxes are created all at once
(up to `live` of them live together) and torn down `parallel` at a time, the way the issue's
run met its KeyError: teardowns of sandboxes the service started, reaping side by side while
the warm pool refills on the service's own thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sandboxer.clients.service import Client
from sandboxer.errors import SandboxerError
from tests.integration.conftest import SandboxBroker

CLI_EVERY = 5  # one sandbox in this many is created, used and torn down through the CLI


@dataclass
class Outcome:
    """What the threads saw: every failure (an error of any kind is one), every receipt's
    residue, and the ids made."""

    failures: list[str] = field(default_factory=list)
    residue: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def made(self, sandbox_id: str) -> None:
        with self.lock:
            self.ids.add(sandbox_id)


def run_round(
    broker: SandboxBroker, client: Client, *, live: int, parallel: int, execs: int, mixed: bool = False
) -> Outcome:
    """`live` sandboxes created at once (`parallel` threads), `execs` execs in each, then all of
    them torn down `parallel` at a time; `mixed`: each thread runs whole lives instead (create,
    execs, teardown), so creates, execs, teardowns and the pool's fills all overlap."""
    outcome = Outcome()
    made: list[tuple[int, str]] = []
    made_lock = threading.Lock()

    def create(index: int) -> str | None:
        try:
            if index % CLI_EVERY == 0:
                result = broker.run("create", "--profile", broker.profile)
                if result.status != 0:
                    outcome.fail(f"CLI create: status {result.status}: {result.stderr.strip()}")
                    return None
                sandbox_id = result.stdout.strip()
            else:
                sandbox_id = client.create(broker.profile).id
        except Exception as exc:  # every error is a failure of the run; the test lists them
            outcome.fail(f"create: {type(exc).__name__}: {exc}")
            return None
        outcome.made(sandbox_id)
        with made_lock:
            made.append((index, sandbox_id))
        for round_ in range(execs):
            try:
                if index % CLI_EVERY == 0:
                    ran = broker.exec(sandbox_id, "/bin/sh", "-c", f"echo {index}-{round_}")
                    status, stdout = ran.status, ran.stdout.encode()
                else:
                    answer = client.sandbox(sandbox_id).exec(["/bin/sh", "-c", f"echo {index}-{round_}"])
                    status, stdout = answer.status, answer.stdout
            except Exception as exc:
                outcome.fail(f"exec in {sandbox_id}: {type(exc).__name__}: {exc}")
                continue
            if (status, stdout) != (0, f"{index}-{round_}\n".encode()):
                outcome.fail(f"exec in {sandbox_id}: status {status}, stdout {stdout!r}")
        return sandbox_id

    def teardown(index: int, sandbox_id: str) -> None:
        try:
            if index % CLI_EVERY == 0:
                result = broker.run("teardown", "--discard", "--json", sandbox_id)
                if result.status not in (0, 6):
                    outcome.fail(f"CLI teardown {sandbox_id}: status {result.status}: {result.stderr.strip()}")
                    return
                residue = json.loads(result.stdout)["residue"] if result.status == 0 else [result.stderr.strip()]
            else:
                residue = list(client.sandbox(sandbox_id).teardown(discard=True).residue)
        except SandboxerError as exc:
            outcome.fail(f"teardown {sandbox_id}: {type(exc).__name__} ({exc.status}): {exc}")
            return
        except Exception as exc:
            outcome.fail(f"teardown {sandbox_id}: {type(exc).__name__}: {exc}")
            return
        if residue:
            with outcome.lock:
                outcome.residue += [f"{sandbox_id}: {line}" for line in residue]

    def whole_life(index: int) -> None:
        sandbox_id = create(index)
        if sandbox_id is not None:
            teardown(index, sandbox_id)

    if mixed:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for life in [pool.submit(whole_life, index) for index in range(live)]:
                life.result()
        return outcome
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for made_one in [pool.submit(create, index) for index in range(live)]:
            made_one.result()
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for future in [pool.submit(teardown, index, sandbox_id) for index, sandbox_id in made]:
            future.result()
    return outcome


# ---------------------------------------------------------------------------- what is left after


def mounts_below(directory: Path) -> list[str]:
    """Mount points at or below `directory` (this mount namespace is the service's)."""
    prefix = str(directory)
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [point for point in points if point == prefix or point.startswith(prefix + "/")]


def processes_carrying(markers: set[str]) -> list[str]:
    """Processes whose command line or environment names one of `markers` (a sandbox id)."""
    found = []
    needles = [marker.encode() for marker in markers]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            seen = Path(f"/proc/{pid}/cmdline").read_bytes() + b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if any(needle in seen for needle in needles):
            program = seen.split(b"\0", 1)[0].decode(errors="replace")
            found.append(f"{pid}: {program}")
    return found


def cgroups_of(ids: set[str]) -> list[str]:
    """The sandboxes' cgroup directories (v1: memory and pids; v2: below sandboxer/)."""
    bases = [Path("/sys/fs/cgroup/memory/sandboxer"), Path("/sys/fs/cgroup/pids/sandboxer")]
    bases.append(Path("/sys/fs/cgroup/sandboxer"))
    return [str(base / sandbox_id) for base in bases for sandbox_id in ids if (base / sandbox_id).is_dir()]


def sandbox_entries(state: Path) -> list[str]:
    """The registry's sandboxes (directories, with a record or not)."""
    registry = state / "sandboxes"
    return sorted(p.name for p in registry.iterdir() if not p.name.startswith(".")) if registry.is_dir() else []


def settle(check: Callable[[], list[str]], seconds: float = 30) -> list[str]:
    """`check()` once it returns nothing, or what it last returned after `seconds` (what ends a
    moment after a teardown's answer, a process's exit, is awaited, never slept for)."""
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
