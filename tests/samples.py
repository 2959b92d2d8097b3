"""Sample owner files shared by the tests."""

from __future__ import annotations


def profile_yaml(name: str = "dev", repository: str = "/srv/repos/demo", extra: str = "") -> str:
    """A valid bwrap profile (ten lines before `extra`, which tests counting lines rely on)."""
    return (
        f"profile: {name}\nextension: ext.bwrap\nworkspace:\n  repository: {repository}\n  ref: main\n"
        f"network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n{extra}"
    )


# The names of the environment the contract builds from nothing, sorted (no consumer given).
CONTRACT_ENV_NAMES = [
    "HOME",
    "LANG",
    "LOGNAME",
    "PATH",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE",
    "SANDBOXER_NETWORK",
    "SANDBOXER_PROFILE",
    "SANDBOXER_SANDBOX_ID",
    "TMPDIR",
    "USER",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_STATE_HOME",
]
