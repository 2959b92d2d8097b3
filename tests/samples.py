"""Sample owner files shared by the tests."""

from __future__ import annotations


def profile_yaml(name: str = "dev", repository: str = "/srv/repos/demo", extra: str = "") -> str:
    """A valid bwrap profile (ten lines before `extra`, which tests counting lines rely on)."""
    return (
        f"profile: {name}\nextension: ext.bwrap\nworkspace:\n  repository: {repository}\n  ref: main\n"
        f"network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n{extra}"
    )
