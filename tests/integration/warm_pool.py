"""Helpers of the warm-pool tests (test_docker_warm.py, test_bwrap_warm.py): an extension's
`config.warm`, waiting for background fills, and what the registry holds."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from tests.integration.conftest import SandboxBroker


def set_warm(broker: SandboxBroker, extension: str, count: int) -> None:
    """Set (or with 0 remove) the extension's `config.warm` and approve the change."""
    path = broker.config / "extensions" / f"{extension}.yaml"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("  warm:")]
    path.write_text("\n".join(lines) + (f"\n  warm: {count}\n" if count else "\n"))
    broker.approve(extension)


def wait_for_fills(broker: SandboxBroker, timeout: float = 60) -> None:
    """Until no fill of any profile runs (each holds its profile's fill lock while it works)."""
    deadline = time.monotonic() + timeout
    for lock in (broker.state / "sandboxes").glob(".warm-*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "a fill is still running"
                    time.sleep(0.05)
        finally:
            os.close(fd)


def warm_ids(broker: SandboxBroker) -> list[str]:
    """The warm sandboxes gc reports (and keeps)."""
    report = broker.run("gc", "--json")
    assert report.status == 0, report.stderr
    assert report.json()["collected"] == [], report.stdout
    return sorted(report.json()["warm"])


def wait_warm(broker: SandboxBroker, count: int, timeout: float = 60) -> list[str]:
    """Wait until the background fill has brought the pool to `count`."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.1)
        wait_for_fills(broker, timeout)
        ids = warm_ids(broker)
        if len(ids) == count:
            return ids
        assert time.monotonic() < deadline, f"the pool has {len(ids)} warm sandboxes, not {count}"


def records(broker: SandboxBroker) -> dict[str, dict[str, Any]]:
    """Every sandbox's record, by id. A directory without one is a sandbox the service's pool is
    making or removing meanwhile; `sandbox_dirs` names those too."""
    found = {}
    for directory in sandbox_dirs(broker):
        try:
            found[directory.name] = json.loads((directory / "record.json").read_text())
        except FileNotFoundError:
            continue
    return found


def sandbox_dirs(broker: SandboxBroker) -> list[Path]:
    """Every sandbox directory in the registry, with a record or not yet (or no more)."""
    return [d for d in (broker.state / "sandboxes").iterdir() if not d.name.startswith(".")]
