"""create --ref and --branch: a caller checks out a ref the profile's workspace.refs allows, on a
fresh task branch of its own naming; anything else is refused before anything is made. On
every backend, as root and as an unprivileged broker."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import GIT
from tests.integration.conftest import UNPRIVILEGED_UID, SandboxBroker, backend_profile_text

PROFILE = "refs"


def _branch(repo: Path, name: str, files: dict[str, bytes]) -> None:
    """A branch `name` of `repo` off main, with one commit of `files`."""
    git = [*GIT, "-C", str(repo)]
    subprocess.run([*git, "checkout", "-q", "-b", name, "main"], check=True)
    for file, content in files.items():
        (repo / file).write_bytes(content)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", f"on {name}"], check=True)
    subprocess.run([*git, "checkout", "-q", "main"], check=True)


def _with_refs(broker: SandboxBroker) -> None:
    _branch(broker.repo, "release/1", {"RELEASE": b"1\n"})
    _branch(broker.repo, "feature/x", {"FEATURE": b"x\n"})
    if broker.as_user:
        for path in [broker.repo, *broker.repo.rglob("*")]:
            os.lchown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    text = backend_profile_text(broker, PROFILE, broker.repo)
    text = text.replace("  ref: main\n", '  ref: main\n  refs: [main, "release/*"]\n')
    broker.write_profile(PROFILE, text)
    broker.approve(PROFILE)


def test_a_caller_checks_out_an_allowed_ref_on_its_own_branch(sbx: SandboxBroker) -> None:
    _with_refs(sbx)
    made = sbx.run("create", "--profile", PROFILE, "--ref", "release/1", "--branch", "task-1")
    assert made.status == 0, made.stderr
    sandbox_id = made.stdout.strip()
    sbx.created.append(sandbox_id)
    inside = sbx.sh(sandbox_id, "git rev-parse --abbrev-ref HEAD; cat RELEASE; git log -1 --format=%s")
    assert inside.stdout == "task-1\n1\non release/1\n", inside.stderr
    assert sbx.sh(sandbox_id, "echo w > w && git add w && git commit -qm w").status == 0
    exported = sbx.run("export", sandbox_id, "--bundle", str(sbx.root / "task.bundle"), "--json")
    assert exported.status == 0, exported.stderr
    summary = json.loads(exported.stdout)
    assert (summary["ref"], summary["branch"], summary["ahead"]) == ("release/1", "task-1", 1)
    assert sbx.run("teardown", sandbox_id).status == 0


def test_refs_the_profile_does_not_allow_are_refused_and_nothing_is_made(sbx: SandboxBroker) -> None:
    _with_refs(sbx)
    cases = [
        (["--ref", "feature/x"], 3, f"sandboxer: --ref: profile {PROFILE} does not allow feature/x"),
        (["--ref", "release/..x"], 2, "sandboxer: --ref: must be a Git branch, tag or commit name"),
        (["--branch", "-x"], 2, "sandboxer: --branch: must be a Git branch, tag or commit name"),
        (["--ref", "release/none"], 2, "--ref: not found in the repository"),
        (["--branch", "feature/x"], 2, "--branch: feature/x is a branch of the repository already"),
    ]
    for options, status, line in cases:
        refused = sbx.run("create", "--profile", PROFILE, *options)
        assert refused.status == status, (options, refused)
        assert line in refused.stderr, (options, refused.stderr)
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert json.loads(sbx.run("list", "--json").stdout)["sandboxes"] == []
    registry = sbx.state / "sandboxes"
    assert [p for p in registry.iterdir() if not p.name.startswith(".")] == []


def test_work_on_a_detached_head_or_on_no_commit_is_named_as_such(sbx: SandboxBroker) -> None:
    """The state the broker asks the sandbox's git for: a detached HEAD has no branch (export
    says null, teardown says "on HEAD"); a HEAD with no commit cannot be checked at all."""
    sandbox_id = sbx.create()
    assert sbx.sh(sandbox_id, "git checkout -q --detach && echo w > w && git add w && git commit -qm w").status == 0
    exported = sbx.run("export", sandbox_id, "--bundle", str(sbx.root / "detached.bundle"), "--json")
    assert exported.status == 0, exported.stderr
    summary = json.loads(exported.stdout)
    assert (summary["branch"], summary["ahead"], summary["dirty"]) == (None, 1, False)
    assert sbx.sh(sandbox_id, "echo v > v && git add v && git commit -qm v").status == 0
    refused = sbx.run("teardown", sandbox_id)
    assert refused.status == 2, refused
    assert "2 new commits on HEAD (made from main)" in refused.stderr, refused.stderr
    assert sbx.sh(sandbox_id, "git checkout -q --orphan nothing-yet").status == 0
    unborn = sbx.run("teardown", sandbox_id)
    assert unborn.status == 2, unborn
    assert "its work cannot be checked" in unborn.stderr, unborn.stderr
    assert "no commit is checked out" in unborn.stderr, unborn.stderr
    assert sbx.run("teardown", sandbox_id, "--discard").status == 0
