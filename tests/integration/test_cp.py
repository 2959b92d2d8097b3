"""`sandboxer cp`: files and directories into and out of a sandbox from the command line, with
the caller's own rights on the local side — in-process, and through the service (the command
then reaches it as sandboxer.Client does)."""

from __future__ import annotations

import os

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
