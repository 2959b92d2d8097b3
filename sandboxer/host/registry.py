"""The registry of sandboxes in the state dir: one directory per sandbox, a record, a lock.

    <state>/sandboxes/            0700
      .lock                       held briefly while a sandbox directory is made or listed
      <id>/                       0700, the sandbox's own directory
        lock                      held by whoever creates or tears the sandbox down
        record.json               0600, replaced atomically
        workspace/                the Git clone bound at /workspace (as root: the mount point
                                  of workspace.img, its own sized ext4 filesystem)
        workspace.img             0600, the workspace filesystem (root brokers)
        seccomp.bpf               0600, the compiled syscall policy every exec installs (bwrap)
        git-home/                 0700, host-side git's HOME while it clones

Record states: `creating` → `ready` → `tearing-down` (then the directory is gone), or `failed`;
a warm sandbox (sandboxer.commands.warmpool) is `warming` → `warm` until a create takes it, and is
no caller's sandbox until then.
Whatever a crash leaves — no record, a `creating` record, a dead holder — `gc` can finish, and it
never touches a directory whose lock is held by a live process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator

from sandboxer.core.record import RecordShapeError, SandboxRecord
from sandboxer.core.record_reading import read_record
from sandboxer.errors import BackendError, NotFoundError, UsageError
from sandboxer.host.fsutil import atomic_write, ensure_private_dir

ID_PATTERN = re.compile(r"[0-9a-f]{24}")


def new_id() -> str:
    """An unguessable sandbox id that is a safe path component (96 random bits, hex)."""
    return os.urandom(12).hex()  # the kernel's CSPRNG, as secrets.token_hex uses (without its imports)


def check_id(sandbox_id: str) -> str:
    """Refuse anything that is not a sandbox id (never a path, never an option)."""
    if not ID_PATTERN.fullmatch(sandbox_id):
        raise NotFoundError(f"no such sandbox: ids are 24 lowercase hex digits, got {len(sandbox_id)} characters")
    return sandbox_id


class Registry:
    """The sandboxes of one state directory."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.root = os.path.join(state_dir, "sandboxes")

    def ensure(self) -> None:
        """Create the state dir and the registry directory, owner-only.

        As root, bwrap runs as the sandbox's unprivileged uid and must reach the workspace
        clone by path, so these directories are 0711: passable, never listable or writable.
        Sandbox ids are unguessable and each clone is itself 0700 and the sandbox user's.
        """
        traversable = os.geteuid() == 0
        ensure_private_dir(self.state_dir, "state dir", traversable=traversable)
        ensure_private_dir(self.root, "registry", traversable=traversable)

    def path(self, sandbox_id: str, *parts: str) -> str:
        """A path inside the sandbox's directory."""
        return os.path.join(self.root, check_id(sandbox_id), *parts)

    @contextlib.contextmanager
    def _registry_lock(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def allocate(self) -> tuple[str, int]:
        """Make a new sandbox directory and return its id and its held lock (an fd to close)."""
        self.ensure()
        with self._registry_lock():
            sandbox_id = new_id()
            directory = self.path(sandbox_id)
            os.mkdir(directory, 0o700)
            if os.geteuid() == 0:
                os.chmod(directory, 0o711)  # noqa: S103 - passable, not listable; see ensure
            lock = os.open(
                os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        return sandbox_id, lock

    def lock(self, sandbox_id: str, *, wait: bool = True) -> int | None:
        """Take the sandbox's lock; None if `wait` is false and someone else holds it."""
        try:
            fd = os.open(self.path(sandbox_id, "lock"), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFoundError(f"no such sandbox: {sandbox_id}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if os.fstat(fd).st_nlink == 0:  # whoever held it before us removed the sandbox meanwhile
            os.close(fd)
            raise NotFoundError(f"no such sandbox: {sandbox_id}")
        return fd

    def try_lock_for_gc(self, sandbox_id: str) -> int | None:
        """The lock of a sandbox directory for gc, or None when a live process holds it."""
        with self._registry_lock():
            try:
                return try_lock_file(self.path(sandbox_id, "lock"))
            except FileNotFoundError:
                return None  # the directory is already gone

    def write(self, record: SandboxRecord) -> None:
        """Replace the sandbox's record atomically."""
        data = json.dumps(record.to_json(), indent=1).encode()
        # Atomic against a crash of the broker; not fsynced: live sandboxes do not survive a reboot.
        atomic_write(self.path(record.id, "record.json"), data, mode=0o600, durable=False)

    def read(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox; NotFoundError if there is none."""

        try:
            with open(self.path(sandbox_id, "record.json"), "rb") as stream:
                data = json.loads(stream.read())
        except FileNotFoundError:
            raise NotFoundError(f"no such sandbox: {sandbox_id}") from None
        except ValueError:
            raise BackendError(f"sandbox {sandbox_id}: its record is not valid JSON") from None
        try:
            record = read_record(data)
        except RecordShapeError as exc:
            raise BackendError(f"sandbox {sandbox_id}: its record is out of shape at {exc.path}") from None
        if record.id != sandbox_id:
            raise BackendError(f"sandbox {sandbox_id}: its record names another sandbox")
        return record

    def read_caller(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox a caller may name: a warm sandbox is nobody's yet."""
        record = self.read(sandbox_id)
        if record.hidden:
            raise NotFoundError(f"no such sandbox: {sandbox_id}")
        return record

    def read_or_none(self, sandbox_id: str) -> SandboxRecord | None:
        """The record, or None when it is missing or unreadable (gc's view)."""
        try:
            return self.read(sandbox_id)
        except (NotFoundError, BackendError):
            return None

    def ids(self) -> list[str]:
        """Every sandbox directory present, sorted."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(name for name in names if ID_PATTERN.fullmatch(name))


def try_lock_file(path: str) -> int | None:
    """An exclusive lock on `path` (made 0600 if missing, never through a symlink), or None when
    another process holds it; the fd to close releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def parse_id_argument(value: str) -> str:
    """A sandbox id from the command line; anything else is 'no such sandbox'."""
    if value.startswith("-"):
        raise UsageError("a sandbox id is expected before any option")
    return check_id(value)
