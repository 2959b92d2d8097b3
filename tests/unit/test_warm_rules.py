"""Which creates may take a warm container, and what makes one stale (no Docker needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sandboxer.backends.docker import warm as docker_warm
from sandboxer.commands import warm


def request(
    *, count: int = 2, assignment: Any = None, delivery: Any = None, ref: str = "main", branch: str | None = None
) -> Any:
    # The extension's count alone says whether a profile keeps any (ext.bwrap and ext.docker
    # accept config.warm alike: tests/unit/test_config.py).
    return SimpleNamespace(
        extension=SimpleNamespace(warm=count),
        profile=SimpleNamespace(workspace=SimpleNamespace(ref="main")),
        checkout=SimpleNamespace(ref=ref, branch=branch),
        assignment=assignment,
        delivery=delivery,
    )


def test_a_plain_create_may_take_one_of_the_extensions_warm_sandboxes() -> None:
    assert warm.wanted(request()) == 2
    assert warm.wanted(request(count=0)) == 0


@pytest.mark.parametrize(
    "other",
    [
        {"assignment": object()},  # a lease manifest adds mounts and variables of its own
        {"delivery": (SimpleNamespace(suspend_control=True), b"")},  # a suspend dir is one more mount
        {"ref": "release/1"},  # create --ref: another workspace than the one cloned ahead
        {"branch": "task"},  # create --branch: the same
    ],
    ids=["manifest", "suspend-control", "ref", "branch"],
)
def test_creates_whose_plan_or_workspace_differs_never_take_one(other: dict[str, Any]) -> None:
    assert warm.wanted(request(**other)) == 0


def test_a_bootstrap_without_suspend_control_still_takes_one() -> None:
    assert warm.wanted(request(delivery=(SimpleNamespace(suspend_control=False), b"x"))) == 2


def test_without_a_since_the_exec_history_counts_as_unknown_and_so_as_used() -> None:
    assert docker_warm._execs_since("0" * 64, None) is True
    assert docker_warm._execs_since("0" * 64, "1700000000") is True
