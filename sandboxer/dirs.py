"""Where the broker keeps owner configuration and live state, from options, environment or defaults."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Mapping

ROOT_CONFIG = "/etc/sandboxer"
ROOT_STATE = "/var/lib/sandboxer"  # root's state: on disk, as workspaces can be large
ROOT_SOCKET = "/run/sandboxer/broker.sock"  # its service's socket


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

    Root uses /etc/sandboxer and /var/lib/sandboxer (on disk: workspaces can be large); any
    other user gets directories of their own under their XDG config and runtime (or state)
    directories, so no two users share a broker.
    """
    config = config_dir or environ.get("SANDBOXER_CONFIG") or ""
    state = state_dir or environ.get("SANDBOXER_STATE") or ""
    if not config:
        if euid == 0:
            config = ROOT_CONFIG
        else:
            config = os.path.join(
                _absolute(environ.get("XDG_CONFIG_HOME")) or os.path.join(home, ".config"), "sandboxer"
            )
    if not state:
        if euid == 0:
            state = ROOT_STATE
        else:
            base = _absolute(environ.get("XDG_RUNTIME_DIR")) or os.path.join(home, ".local", "state")
            state = os.path.join(base, "sandboxer")
    return Dirs(config=os.path.abspath(config), state=os.path.abspath(state))


def _absolute(value: str | None) -> str | None:
    # The XDG spec says relative values are invalid and must be ignored.
    return value if value and os.path.isabs(value) else None


SOCKET_FILE = "broker.sock"


def default_socket(dirs: Dirs) -> str:
    """Where the service of `dirs` listens unless told otherwise: `broker.sock` in the state dir;
    for root's default state dir, in /run (the runtime directory, as services keep sockets)."""
    return ROOT_SOCKET if dirs.state == ROOT_STATE else os.path.join(dirs.state, SOCKET_FILE)


def service_socket(dirs: Dirs, environ: Mapping[str, str]) -> str:
    """Where the service of `dirs` answers: SANDBOXER_SOCKET, else default_socket."""
    return environ.get("SANDBOXER_SOCKET") or default_socket(dirs)


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def connect(path: str) -> socket.socket | None:
    """A connection to the service at `path`, or None when none answers there. A service is
    trusted with this process's environment and terminal only when the kernel says it runs as
    root or as this account."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.connect(path)
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        conn.close()
        return None
    if uid not in (0, os.geteuid()):
        conn.close()
        raise Untrusted(f"the service on {path} runs as uid {uid}, neither root nor this account")
    return conn


class Untrusted(Exception):
    """A socket answered by another account's process: nothing is sent to it."""
