"""`ext approve` checks what a create would trip on, so an owner learns it at approval: a
profile's repository is a Git repository that has its ref and the refs it lists; an ext.docker
config's image is in the Engine. Each refusal is one line naming the file and key (2), and the
file stays unapproved."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import SandboxBroker, docker_skip_reason, profile_text


def _approval(broker: SandboxBroker, name: str) -> str:
    entries = json.loads(broker.run("ext", "list", "--json").stdout)["entries"]
    return next(entry["status"] for entry in entries if entry["name"] == name)


@pytest.mark.parametrize(
    ("repository", "workspace", "line"),
    [
        ("nowhere", "", "workspace.repository: not a Git repository"),
        ("repo", "  ref: nope\n", "workspace.ref: not in the repository"),
        (
            "repo",
            '  ref: main\n  refs: [main, "release/*", gone/x]\n',
            "workspace.refs[2]: not in the repository",
        ),
    ],
)
def test_a_profile_create_would_fail_on_is_not_approved(
    sb: SandboxBroker, repository: str, workspace: str, line: str
) -> None:
    text = profile_text("trips", sb.root / repository)
    if workspace:
        text = text.replace("  ref: main\n", workspace)
    path = sb.write_profile("trips", text)
    refused = sb.run("ext", "approve", "trips")
    assert (refused.status, refused.stderr) == (2, f"sandboxer: {path}: {line}\n")
    assert _approval(sb, "trips") == "unapproved"
    fixed = sb.write_profile("trips", profile_text("trips", sb.repo))
    assert sb.run("ext", "approve", "trips").status == 0, fixed
    assert _approval(sb, "trips") == "approved"


def test_an_image_the_engine_lacks_is_not_approved(sb_root: SandboxBroker) -> None:
    reason = docker_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    digest = sb_root.runtime_sha256()
    path = sb_root.config / "extensions" / "ext.docker.yaml"
    path.write_text(
        f'extension: ext.docker\nconfig:\n  image: "sha256:{"0" * 64}"\n  runtime:\n'
        f"    path: {sb_root.runtime}\n    sha256: {digest}\n"
    )
    refused = sb_root.run("ext", "approve", "ext.docker")
    assert (refused.status, refused.stderr) == (
        2,
        f"sandboxer: {path}: config.image: not present in the Docker Engine (images are never pulled) "
        "(hint: scripts/build-base-image, or docker load)\n",
    )
    assert _approval(sb_root, "ext.docker") == "unapproved"
