"""Where the broker keeps owner configuration and live state, from options, environment or defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping


class Dirs:
    """The config directory (owner YAML, approvals) and the state directory (live sandboxes, caches).

    A plain slotted class: the CLI client resolves these before anything else, and imports
    little (sandboxer/cliclient.py).
    """

    __slots__ = ("config", "state")

    def __init__(self, *, config: str, state: str) -> None:
        self.config = config
        self.state = state


def resolve_dirs(
    *, config_dir: str | None, state_dir: str | None, environ: Mapping[str, str], euid: int, home: str
) -> Dirs:
    """Options win over SANDBOXER_CONFIG / SANDBOXER_STATE, which win over the defaults.

    Root uses /etc/sandboxer and /run/sandboxer; any other user gets directories of their own
    under their XDG config and runtime (or state) directories, so no two users share a broker.
    """
    config = config_dir or environ.get("SANDBOXER_CONFIG") or ""
    state = state_dir or environ.get("SANDBOXER_STATE") or ""
    if not config:
        if euid == 0:
            config = "/etc/sandboxer"
        else:
            config = os.path.join(
                _absolute(environ.get("XDG_CONFIG_HOME")) or os.path.join(home, ".config"), "sandboxer"
            )
    if not state:
        if euid == 0:
            state = "/run/sandboxer"
        else:
            base = _absolute(environ.get("XDG_RUNTIME_DIR")) or os.path.join(home, ".local", "state")
            state = os.path.join(base, "sandboxer")
    return Dirs(config=os.path.abspath(config), state=os.path.abspath(state))


def _absolute(value: str | None) -> str | None:
    # The XDG spec says relative values are invalid and must be ignored.
    return value if value and os.path.isabs(value) else None


SOCKET_FILE = "broker.sock"


def service_socket(dirs: Dirs, environ: Mapping[str, str]) -> str:
    """Where the service of `dirs` answers: SANDBOXER_SOCKET, else `broker.sock` in the state dir
    (root's default: /run/sandboxer/broker.sock)."""
    return environ.get("SANDBOXER_SOCKET") or os.path.join(dirs.state, SOCKET_FILE)
