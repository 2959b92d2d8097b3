"""A first end-to-end pass: create, exec, teardown, for both broker users."""

from __future__ import annotations

from tests.integration.conftest import SandboxBroker


def test_sandbox_user_is_not_root_and_workspace_is_the_cwd(sb: SandboxBroker) -> None:
    sandbox_id = sb.create()
    result = sb.sh(sandbox_id, "id -u; id -g; pwd")
    assert result.status == 0, result.stderr
    assert result.stdout.split() == ["1000", "1000", "/workspace"]
    receipt = sb.run("teardown", sandbox_id, "--json")
    assert receipt.status == 0, receipt.stderr
    assert receipt.json()["residue"] == []
    assert not sb.sandbox_dir(sandbox_id).exists()
