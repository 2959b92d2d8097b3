"""Creates, execs and teardowns in parallel through one root service with a warm pool: no answer
is an internal error, no teardown leaves residue, and afterwards nothing of the sandboxes is
left (no mount below the state dir, no process, no cgroup, an empty registry).

This is the small version, part of the suite (~1 minute here); `make stress` runs the large one
(SANDBOXER_STRESS=1: 100 sandboxes live at once, three rounds; docs/soak.md). The race it
was written for: concurrent teardowns reaping the same table of the bwraps the service started
(backends/bwrap/stop.py), one in a hundred failing with an internal error (KeyError) and leaving
its workspace mount behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer.clients.service import Client
from tests.integration.conftest import PROFILE, SandboxBroker, _bwrap_broker, _cleanup, _serve
from tests.integration.stress import (
    cgroups_of,
    mounts_below,
    processes_carrying,
    run_round,
    sandbox_entries,
    settle,
)
from tests.integration.warm_pool import set_warm, wait_for_fills

EXT = "ext.bwrap"
LARGE = os.environ.get("SANDBOXER_STRESS") == "1"
# (sandboxes live at once, threads, execs in each, rounds, warm pool size). Rounds alternate: all
# created, then torn down `threads` at a time; then each thread running whole lives.
SHAPE = (100, 8, 2, int(os.environ.get("SANDBOXER_STRESS_ROUNDS", "4")), 4) if LARGE else (64, 16, 1, 1, 3)


@pytest.fixture
def served(runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A root broker whose profile keeps a warm pool, its CLI a client of a root service."""
    broker = _bwrap_broker(runtime_dir, as_user=False)
    set_warm(broker, EXT, SHAPE[4])
    _serve(broker)
    try:
        yield broker
    finally:
        if broker.service is not None:
            broker.service.stop()
        _cleanup(broker)


def test_parallel_lifecycles_leave_nothing_behind(served: SandboxBroker) -> None:
    live, parallel, execs, rounds, _ = SHAPE
    client = Client(str(served.state / "broker.sock"))
    filled = served.run("warm", PROFILE, "--json")
    assert filled.status == 0, filled.stderr
    failures: list[str] = []
    residue: list[str] = []
    ids: set[str] = set()
    for round_ in range(rounds):
        outcome = run_round(served, client, live=live, parallel=parallel, execs=execs, mixed=round_ % 2 == 1)
        failures += outcome.failures
        residue += outcome.residue
        ids |= outcome.ids
    assert served.service is not None
    log = served.service.log.read_text()
    assert failures == [], f"{len(failures)} of {live * rounds} failed:\n" + "\n".join(failures) + "\n" + log[-3000:]
    assert residue == [], "\n".join(residue)
    assert len(ids) == live * rounds  # every create made a sandbox of its own

    # The warm pool drained through the service, then nothing may be left of any sandbox.
    wait_for_fills(served)
    ids |= set(sandbox_entries(served.state))
    set_warm(served, EXT, 0)
    drained = served.run("warm", PROFILE, "--json")
    assert drained.status == 0, drained.stderr
    assert settle(lambda: sandbox_entries(served.state)) == []
    assert settle(lambda: mounts_below(served.state)) == []
    assert served.service.process is not None
    service = served.service.process.pid
    markers = ids | {str(served.state)}
    assert settle(lambda: [p for p in processes_carrying(markers) if not p.startswith(f"{service}:")]) == []
    assert settle(lambda: cgroups_of(ids)) == []
    log = served.service.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert served.service.process.poll() is None, log  # it answered the whole test
