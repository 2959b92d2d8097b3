"""Where a root service writes an export for another account: only into a regular file (or
directory) of that account's own, on a filesystem for files — checked on the descriptor the
client passed, whatever client passed it.

The sandboxer client opens the destination itself (O_CREAT|O_EXCL|O_NOFOLLOW) and passes the
descriptor; a caller is free to run another client that passes any descriptor it could open:
its own process's /proc/self/sched (a procfs file of its own account, regular and empty, where a
write by root is taken whatever it says), or a file of another account it can write. Real
accounts, a real root service, a real sandbox.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service
from tests.integration.test_service import callers  # noqa: F401 - a fixture
from tests.integration.test_service_caller_files import granted  # noqa: F401 - a fixture
from tests.integration.test_service_cli import _cli_as

REPO = Path(__file__).parents[2]

# The sandboxer client, but each file it passes is its own open of argv[1], for writing.
PASSES_ANY = """
import os, sys
import sandboxer.clients.cli as client
target = sys.argv[1]
client._open_for = lambda use, path, made: os.open(target, os.O_WRONLY | os.O_CLOEXEC)
sys.exit(client.run(sys.argv[2:]))
"""


def _passing(account: pwd.struct_passwd, socket_path: Path, target: str, *args: str) -> tuple[int, str]:
    """A CLI of `account`'s that passes its own open of `target` for the file its command names."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--"]
    argv += [sys.executable, "-c", PASSES_ANY, target, *args]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    env["SANDBOXER_SOCKET"] = str(socket_path)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False, cwd="/")
    return done.returncode, done.stderr


def test_a_root_service_writes_an_export_only_into_a_callers_own_file(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],  # noqa: F811 - the fixture
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> None:
    broker, a, started, home = granted
    _, b = callers
    created = _cli_as(a, started.socket, "create", "--profile", broker.profile)
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    broker.created.append(sandbox_id)
    commit = "echo x > x && git add x && git commit -qm 'Add x'"
    assert _cli_as(a, started.socket, "exec", sandbox_id, "--", "sh", "-c", commit).returncode == 0

    # A procfs file of A's own process: regular, empty, A's — and the kernel's.
    refused = _passing(a, started.socket, "/proc/self/sched", "export", sandbox_id, "--tar", "/tmp/x.tar")
    assert refused == (
        2,
        "sandboxer: export: /tmp/x.tar: must be a regular file on a filesystem for files, not on procfs\n",
    )

    # B's empty file that anyone may write: still not A's.
    shared = home / "shared"
    shared.mkdir(mode=0o755)
    os.chown(shared, b.pw_uid, b.pw_gid)
    theirs = shared / "theirs.bundle"
    theirs.touch()
    os.chown(theirs, b.pw_uid, b.pw_gid)
    theirs.chmod(0o666)
    refused = _passing(a, started.socket, str(theirs), "export", sandbox_id, "--bundle", str(theirs))
    assert refused == (2, f"sandboxer: export: {theirs}: must be a regular file of the caller's own\n")
    assert theirs.read_bytes() == b""

    # The sandboxer client itself: a symlink to root's file is never followed, A's new file is A's.
    roots = broker.root / "roots-file"
    roots.write_bytes(b"root's\n")
    link = home / "link.bundle"
    link.symlink_to(roots)
    refused_link = _cli_as(a, started.socket, "export", sandbox_id, "--bundle", str(link))
    assert (refused_link.returncode, refused_link.stderr) == (
        2,
        f"sandboxer: export: {link}: cannot be created (File exists)\n",
    )
    assert roots.read_bytes() == b"root's\n"
    done = _cli_as(a, started.socket, "export", sandbox_id, "--bundle", str(home / "mine.bundle"))
    assert done.returncode == 0, done.stderr
    assert (home / "mine.bundle").stat().st_uid == a.pw_uid
