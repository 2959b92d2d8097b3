"""grants.yaml: the owner file that admits callers other than the owners (docs/service.md)."""

from __future__ import annotations

import pytest

from sandboxer.core.config import parse_owner_file, validate_name
from sandboxer.core.config_types import Grant, GrantsFile, from_meaning, meaning
from sandboxer.errors import ConfigError

GRANTS = """\
grants:
  - users: [alice]
    groups: [agents]
    profiles: [bwrap-local]
    max_sandboxes: 10
    max_ttl_seconds: 86400
  - groups: [ci]
    profiles: [bwrap-local, docker-local]
    max_sandboxes: 2
    max_ttl_seconds: 600
    max_exports_mib: 2048
"""


def parse(text: str) -> object:
    return parse_owner_file(text.encode(), "grants.yaml", expected_name="grants")


def test_a_grants_file_is_read_entry_by_entry() -> None:
    parsed = parse(GRANTS)
    assert isinstance(parsed, GrantsFile)
    assert parsed.grants == (
        Grant(users=("alice",), groups=("agents",), profiles=("bwrap-local",), max_sandboxes=10, max_ttl_seconds=86400),
        Grant(
            users=(),
            groups=("ci",),
            profiles=("bwrap-local", "docker-local"),
            max_sandboxes=2,
            max_ttl_seconds=600,
            max_exports_mib=2048,
        ),
    )
    assert from_meaning(meaning(parsed), parsed.file_sha256) == parsed  # the parse cache keeps all of it


def test_it_is_approved_under_its_own_name() -> None:
    assert validate_name("grants") == "grants.yaml"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("grants:\n  - profiles: [p]\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n",
         "grants.yaml:2:5: grants[0].users: an entry names at least one user or group"),
        ("grants:\n  - users: [Alice]\n    profiles: [p]\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n",
         "grants.yaml:2:13: grants[0].users[0]: must be an account name (a-z 0-9 _ -, at most 32)"),
        ("grants:\n  - users: [a]\n    profiles: []\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n",
         "grants.yaml:3:15: grants[0].profiles: must name at least one profile"),
        ("grants:\n  - users: [a]\n    profiles: [p]\n    max_sandboxes: 0\n    max_ttl_seconds: 60\n",
         "grants.yaml:4:20: grants[0].max_sandboxes: must be between 1 and 1000"),
        ("grants:\n  - users: [a]\n    profiles: [p]\n    max_sandboxes: 1\n    max_ttl_seconds: 10\n",
         "grants.yaml:5:22: grants[0].max_ttl_seconds: must be between 60 and 2592000"),
        ("grants:\n  - users: [a]\n    profiles: [p]\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n    root: true\n",
         "grants.yaml:6:5: grants[0].root: unknown key"),
        ("grants:\n  - users: [a]\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n",
         "grants.yaml:2:5: grants[0].profiles: missing required key"),
        ("grants:\n  - users: [a]\n    profiles: [p]\n    max_sandboxes: 1\n    max_ttl_seconds: 60\n"
         "    max_exports_mib: 8\n",
         "grants.yaml:6:22: grants[0].max_exports_mib: must be between 16 and 1048576"),
    ],
    ids=[
        "no-account", "bad-user", "no-profile", "zero-sandboxes", "short-ttl", "unknown-key", "no-profiles",
        "tiny-export-budget",
    ],
)  # fmt: skip
def test_a_bad_entry_is_refused_naming_file_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse(text)
    assert str(refused.value) == message


def test_no_profile_may_take_the_grants_name() -> None:
    text = "profile: grants\nextension: ext.bwrap\nworkspace: {repository: /r, ref: main}\n"
    text += "network: {default: deny, egress: []}\nsetup: {secrets: []}\n"
    with pytest.raises(ConfigError) as refused:
        parse_owner_file(text.encode(), "profiles/grants.yaml", expected_name="grants")
    assert "grants is reserved for grants.yaml" in str(refused.value)
