"""Where the broker keeps owner configuration and live state, from options, environment or defaults."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Mapping

ROOT_CONFIG = "/etc/sandboxer"
ROOT_STATE = "/var/lib/sandboxer"  # root's state: on disk, as workspaces can be large
ROOT_SOCKET = "/run/sandboxer/broker.sock"  # its service's socket


class Dirs:
    """The config directory (owner YAML, approvals) and the state directory (live sandboxes, caches).

    A plain slotted class: the CLI client resolves these before anything else, and imports
    little (sandboxer/clients/cli.py).
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


def user_config(environ: Mapping[str, str], home: str) -> str:
    """The default config dir of an account other than root: `sandboxer` in its XDG config dir
    (as resolve_dirs makes it)."""
    return os.path.join(_absolute(environ.get("XDG_CONFIG_HOME")) or os.path.join(home, ".config"), "sandboxer")


def _absolute(value: str | None) -> str | None:
    # The XDG spec says relative values are invalid and must be ignored.
    return value if value and os.path.isabs(value) else None


STATE_DIR_HINT = (
    "a state dir must be this account's own directory, mode 0700 (root's may be 0711), below directories "
    "owned by root or this account that nobody else may write to (unless sticky, as /tmp); docs/security.md"
)


def state_dir_problem(path: str, *, euid: int) -> str | None:
    """Why this account may not keep its sandboxes in `path` (None: it may).

    The records in a state dir say which paths teardown and gc remove and which processes they
    signal, so the broker keeps state only where no other account could have written or could
    swap anything: `path` is a directory (not a symlink) owned by `euid`, with no permission for
    group or others (root's may keep the search bit: 0711, so a sandbox user reaches its clone by
    path); every directory above it is owned by root or `euid` and writable by nobody else unless
    sticky (as /tmp); a symlink on the way is root's or `euid`'s. A state dir that does not exist
    yet is judged by the directories above it (it is made 0700 when first needed).
    """
    path = os.path.abspath(path)
    try:
        real = os.path.join(_checked_links(os.path.dirname(path), euid), os.path.basename(path))
    except _Unsafe as exc:
        return f"state dir {path}: {exc}"
    except OSError as exc:
        return f"state dir {path}: cannot be checked ({exc.strerror})"
    try:
        seen: os.stat_result | None = os.lstat(real)
    except FileNotFoundError:
        seen = None
    except OSError as exc:
        return f"state dir {path}: cannot be checked ({exc.strerror})"
    problem = None if seen is None else _own_problem(seen, euid)
    if problem is None:
        problem = _ancestors_problem(os.path.dirname(real), euid)
    return None if problem is None else f"state dir {path}: {problem}"


def _own_problem(seen: os.stat_result, euid: int) -> str | None:
    if not stat.S_ISDIR(seen.st_mode):
        return f"is a {'symlink' if stat.S_ISLNK(seen.st_mode) else 'file'}, must be a directory"
    if seen.st_uid != euid:
        return f"owned by uid {seen.st_uid}, must be this account's (uid {euid})"
    allowed = 0o711 if euid == 0 else 0o700
    mode = stat.S_IMODE(seen.st_mode)
    if mode & 0o077 & ~allowed:
        return f"mode {mode:04o}, must be {allowed:04o} (no access for group or others)"
    return None


def _ancestors_problem(parent: str, euid: int) -> str | None:
    """Each existing directory from `parent` up to /: root's or `euid`'s, and writable by nobody
    else unless sticky."""
    while True:
        try:
            seen = os.lstat(parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"{parent} cannot be checked ({exc.strerror})"
        else:
            if seen.st_uid not in (0, euid):
                return f"the directory {parent} above it is owned by uid {seen.st_uid}, not by root or this account"
            if seen.st_mode & 0o022 and not seen.st_mode & stat.S_ISVTX:
                mode = stat.S_IMODE(seen.st_mode)
                return f"the directory {parent} above it is writable by others (mode {mode:04o}, not sticky)"
        if parent == "/":
            return None
        parent = os.path.dirname(parent)


def require_state_dir(path: str) -> None:
    """Refuse (PolicyError, 3) to keep sandboxes in `path` when state_dir_problem finds a reason."""
    problem = state_dir_problem(path, euid=os.geteuid())
    if problem is not None:
        from sandboxer.errors import PolicyError  # not at the top: the CLI client imports this module

        raise PolicyError(problem, hint=STATE_DIR_HINT)


class _Unsafe(Exception):
    """A symlink on the way to the state dir that another account owns."""


def _checked_links(path: str, euid: int) -> str:
    """`path` with its symlinks resolved, each of them root's or `euid`'s (else _Unsafe: whoever
    owns a link can point it elsewhere later); the parts from the first missing one on are kept
    as they are."""
    resolved = "/"
    parts = [part for part in path.split("/") if part]
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, part)
        try:
            seen = os.lstat(candidate)
        except FileNotFoundError:
            return os.path.normpath(os.path.join(candidate, *parts))
        if not stat.S_ISLNK(seen.st_mode):
            resolved = candidate
            continue
        if seen.st_uid not in (0, euid):
            raise _Unsafe(f"the symlink {candidate} on its way is owned by uid {seen.st_uid}")
        hops += 1
        if hops > 40:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = "/"
        parts = [p for p in target.split("/") if p] + parts
    return resolved


SOCKET_FILE = "broker.sock"


def default_socket(dirs: Dirs) -> str:
    """Where the service of `dirs` listens unless told otherwise: `broker.sock` in the state dir;
    for root's default state dir, in /run (the runtime directory, as services keep sockets)."""
    return ROOT_SOCKET if dirs.state == ROOT_STATE else os.path.join(dirs.state, SOCKET_FILE)


def service_socket(dirs: Dirs, environ: Mapping[str, str]) -> str:
    """Where the service of `dirs` answers: SANDBOXER_SOCKET, else default_socket."""
    return environ.get("SANDBOXER_SOCKET") or default_socket(dirs)


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def connect(path: str, *, root_only: bool = False) -> socket.socket | None:
    """A connection to the service at `path`, or None when none answers there. A service is
    trusted with this process's environment and terminal only when the kernel says it runs as
    root or as this account (`root_only`: as root); else Untrusted, and nothing is sent."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    try:
        check_peer(conn, path, root_only=root_only)
    except BaseException:
        conn.close()
        raise
    return conn


def check_peer(conn: socket.socket, path: str, *, root_only: bool = False) -> None:
    """Untrusted unless the kernel says the process answering on the connected `conn` (at
    `path`, for the message) runs as root or as this account (`root_only`: as root). Every
    client of the service checks each connection with this before it sends a byte: the CLI
    client (connect) and sandboxer.Client (clients/transport.py)."""
    try:
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError as exc:
        raise Untrusted(f"the kernel does not say who answers on {path} ({exc.strerror})") from None
    if root_only and uid != 0:
        raise Untrusted(f"the service on {path} runs as uid {uid}, not root")
    if uid not in (0, os.geteuid()):
        raise Untrusted(f"the service on {path} runs as uid {uid}, neither root nor this account")


class Untrusted(Exception):
    """A socket answered by another account's process: nothing is sent to it."""


def own_configuration(*, config_dir: str | None, state_dir: str | None, environ: Mapping[str, str], home: str) -> bool:
    """Whether a non-root account has a broker of its own to talk to: it names a socket, a config
    dir or a state dir (options or SANDBOXER_SOCKET / SANDBOXER_CONFIG / SANDBOXER_STATE), or its
    config dir exists at its default place (XDG_CONFIG_HOME or ~/.config, `sandboxer`). An
    account without is a caller of the system service (ROOT_SOCKET) when one answers there."""
    if config_dir or state_dir:
        return True
    if any(environ.get(name) for name in ("SANDBOXER_SOCKET", "SANDBOXER_CONFIG", "SANDBOXER_STATE")):
        return True
    return os.path.isdir(user_config(environ, home))


def no_service(config: str) -> str:
    """What an account with no configuration of its own is told when neither the system service
    nor a service of its own answers (docs/service.md, "Finding the service")."""
    return (
        f"no service answers on {ROOT_SOCKET} (the system service) and this account has no broker "
        f"of its own ({config} does not exist): ask the owner of this host whether the sandboxer "
        "service runs and grants you; to run a broker of your own, make that directory first"
    )


def answering(path: str, *, root_only: bool = False) -> bool:
    """Whether a service the check_peer rule trusts (`root_only`: root's) answers on `path`."""
    try:
        conn = connect(path, root_only=root_only)
    except Untrusted:
        return False
    if conn is None:
        return False
    conn.close()
    return True


def find_service(dirs: Dirs, environ: Mapping[str, str]) -> str:
    """The socket a program's client uses for `dirs` (docs/service.md, "Finding the service"),
    starting nothing: service_socket's, but for an account other than root with no configuration
    of its own (dirs that differ from its defaults count as named), the system service's when
    root's answers there or no service of its own does. (The sandboxer command decides the same
    in clients/cli.py with the connection it keeps.)"""
    euid, home = os.geteuid(), os.path.expanduser("~")
    own = service_socket(dirs, environ)
    if euid == 0:
        return own
    default = resolve_dirs(config_dir=None, state_dir=None, environ=environ, euid=euid, home=home)
    config = dirs.config if dirs.config != default.config else None
    state = dirs.state if dirs.state != default.state else None
    if own_configuration(config_dir=config, state_dir=state, environ=environ, home=home):
        return own
    if answering(ROOT_SOCKET, root_only=True) or not answering(own):
        return ROOT_SOCKET
    return own
