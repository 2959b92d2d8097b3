"""`sandboxer cp`: files and directories into and out of a sandbox from the command line, with
the caller's own rights on the local side — in-process, and through the service (the command
then reaches it as sandboxer.Client does)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.conftest import UNPRIVILEGED_UID, SandboxBroker


@pytest.mark.parametrize("through_service", [False, True], ids=["in-process", "service"])
def test_cp_copies_in_and_out(sbx: SandboxBroker, through_service: bool) -> None:
    sbx.through_service = through_service
    sandbox_id = sbx.create()
    local = sbx.root / "home" / "tree"
    (local / "sub").mkdir(parents=True)
    (local / "a.txt").write_bytes(b"alpha\n")
    (local / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)
    if sbx.as_user:
        for path in [local, *local.rglob("*")]:
            os.lchown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    put = sbx.run("cp", str(local), f"{sandbox_id}:/workspace/tree")
    assert (put.status, put.stdout, put.stderr) == (0, "", "")
    shown = sbx.sh(
        sandbox_id, "cat /workspace/tree/a.txt; wc -c < /workspace/tree/sub/b.bin; stat -c %U /workspace/tree"
    )
    assert shown.stdout.split() == ["alpha", "25600", "sandbox"], shown.stderr
    back = sbx.root / "home" / "back"
    got = sbx.run("cp", f"{sandbox_id}:/workspace/tree", str(back))
    assert got.status == 0, got.stderr
    assert (back / "a.txt").read_bytes() == b"alpha\n"
    assert (back / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 100
    assert back.stat().st_uid == (UNPRIVILEGED_UID if sbx.as_user else 0)  # written by the caller's own process

    again = sbx.run("cp", f"{sandbox_id}:/workspace/tree", str(back))
    assert again.status == 2
    assert "exists" in again.stderr
    for args in ([str(local), str(back)], [f"{sandbox_id}:/a", f"{sandbox_id}:/b"], [str(local), f"{sandbox_id}:rel"]):
        refused = sbx.run("cp", *args)
        assert refused.status == 2, (args, refused)
        assert refused.stderr == (
            "sandboxer: cp: exactly one of SRC and DST must be ID:/path (a sandbox id, a colon, an absolute path)\n"
        )
    unknown = sbx.run("cp", str(local), f"{'0' * 24}:/workspace/x")
    assert (unknown.status, unknown.stderr) == (4, f"sandboxer: no such sandbox: {'0' * 24}\n")


@pytest.mark.parametrize("through_service", [False, True], ids=["in-process", "service"])
def test_cp_takes_bare_names_in_the_working_directory(sbx: SandboxBroker, through_service: bool) -> None:
    """`cp f ID:/workspace/f` and `cp ID:/workspace/f g`: a local name with no directory part is
    the caller's working directory's (its dirname is "")."""
    sbx.through_service = through_service
    sandbox_id = sbx.create()
    cwd = sbx.root / "home" / "cwd"
    (cwd / "d").mkdir(parents=True)
    (cwd / "f").write_bytes(b"file\n")
    (cwd / "d" / "in.txt").write_bytes(b"in dir\n")
    if sbx.as_user:
        for path in [cwd, *cwd.rglob("*")]:
            os.lchown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)

    def cp(source: str, destination: str) -> tuple[int, str]:
        argv = sbx.argv("cp", source, destination)
        done = subprocess.run(argv, cwd=cwd, capture_output=True, env=sbx.env(), check=False, timeout=120)
        return done.returncode, done.stdout.decode() + done.stderr.decode()

    assert cp("f", f"{sandbox_id}:/workspace/f") == (0, "")
    assert cp("d", f"{sandbox_id}:/workspace/d") == (0, "")
    assert cp(f"{sandbox_id}:/workspace/f", "g") == (0, "")
    assert cp(f"{sandbox_id}:/workspace/d", "e") == (0, "")
    assert (cwd / "g").read_bytes() == b"file\n"
    assert (cwd / "e" / "in.txt").read_bytes() == b"in dir\n"
    assert (cwd / "g").stat().st_uid == (UNPRIVILEGED_UID if sbx.as_user else 0)
