"""Shared machinery of the escape suite (tests/integration/test_escape_*.py); it holds no tests.

Every probe is a real command run inside a real sandbox through `sandboxer exec`, on bwrap as
root, bwrap as an unprivileged broker and Docker. A probe prints what the kernel answered — an
errno name such as `EPERM`, or `ok` when the attempt went through — and the test compares that
with the exact refusal the sandbox must produce. `ok` is never an expected answer of an attack.

Probes that only ask the kernel something (one syscall, one open) share one sandbox per backend
and module (`box_fixture`): a sandbox costs about a second to make and these probes cannot change
it. Probes that change a sandbox (fill it, exhaust it, plant something for teardown) take their
own from the `sbx` fixture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result
from tests.integration.conftest import (
    SandboxBroker,
    _bwrap_broker,
    _cleanup,
    _require_tools,
    add_docker,
    backend_profile_text,
    make_broker,
)

VARIANTS = ("bwrap-root", "bwrap-user", "docker")
SYSTEM_PYTHON = "/usr/bin/python3"
RUNTIME_PYTHON = "/opt/sandboxer/runtime/bin/python3"

# Prepended to every Python probe. `syscall` returns "ok" or the errno's name; arguments are
# passed as unsigned 64-bit registers (bytes as pointers), exactly what a C caller would pass.
PRELUDE = r"""
import ctypes, errno, os, socket, stat, sys
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
def _arg(value):
    return ctypes.c_ulong(value & 0xFFFFFFFFFFFFFFFF) if isinstance(value, int) else value
def name(number):
    return errno.errorcode.get(number, str(number))
def syscall(nr, *args):
    ctypes.set_errno(0)
    result = _libc.syscall(ctypes.c_long(nr), *[_arg(a) for a in args])
    return "ok" if result >= 0 else name(ctypes.get_errno())
def attempt(call, *args):
    try:
        call(*args)
    except OSError as exc:
        return name(exc.errno)
    return "ok"
def try_open(path, flags=os.O_RDONLY):
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return name(exc.errno)
    os.close(fd)
    return "ok"
def try_socket(family, kind, proto=0):
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        return name(exc.errno)
    sock.close()
    return "ok"
"""


@dataclass
class Box:
    """One live sandbox of one variant, and the broker that made it."""

    broker: SandboxBroker
    variant: str
    sandbox_id: str

    @property
    def backend(self) -> str:
        """`bwrap` or `docker`."""
        return self.broker.backend

    def py(
        self, code: str, *args: str, stdin: bytes | None = None, options: tuple[str, ...] = (), python: str = ""
    ) -> Result:
        """Run PRELUDE + `code` with the sandbox's system Python (argv after the code: `args`)."""
        interpreter = python or SYSTEM_PYTHON
        return self.broker.exec(self.sandbox_id, interpreter, "-c", PRELUDE + code, *args, stdin=stdin, options=options)

    def sh(self, script: str, *args: str, stdin: bytes | None = None) -> Result:
        """Run a shell script (`$1`… are `args`)."""
        return self.broker.exec(self.sandbox_id, "/bin/sh", "-c", script, "sh", *args, stdin=stdin)

    def record(self) -> dict[str, Any]:
        """The sandbox's registry record, read on the host."""
        data: dict[str, Any] = json.loads((self.broker.sandbox_dir(self.sandbox_id) / "record.json").read_text())
        return data

    def expect(self, *, bwrap: str, docker: str) -> str:
        """The answer this backend must give (where the two backends refuse by different means)."""
        return docker if self.backend == "docker" else bwrap


def variant_of(broker: SandboxBroker) -> str:
    """The `sbx` variant a broker was made for."""
    if broker.backend == "docker":
        return "docker"
    return "bwrap-user" if broker.as_user else "bwrap-root"


def start_broker(request: pytest.FixtureRequest, runtime_dir: Path, variant: str) -> SandboxBroker:
    """A ready broker of one variant, made exactly as the `sbx` fixture makes it."""
    _require_tools()
    if variant == "docker":
        image = request.getfixturevalue("base_image")
        broker = make_broker(runtime_dir, as_user=False)
        add_docker(broker, image)
        return broker
    return _bwrap_broker(runtime_dir, as_user=variant == "bwrap-user")


def box_fixture() -> Callable[..., Iterator[Box]]:
    """A module-scoped fixture: one sandbox per variant, shared by the module's read-only probes.

    Use as `box = box_fixture()` at module level.
    """

    @pytest.fixture(scope="module", params=VARIANTS)
    def box(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[Box]:
        broker = start_broker(request, runtime_dir, request.param)
        try:
            yield Box(broker=broker, variant=request.param, sandbox_id=broker.create())
        finally:
            _cleanup(broker)

    return box


def own_box(sbx: SandboxBroker, profile: str | None = None) -> Box:
    """A sandbox of the test's own, from the `sbx` fixture's broker."""
    return Box(broker=sbx, variant=variant_of(sbx), sandbox_id=sbx.create(profile))


def answer(result: Result) -> str:
    """What a probe printed, after checking that it ran to the end (exit 0, nothing on stderr
    but its own words)."""
    assert result.status == 0, f"the probe did not finish: status {result.status}\n{result.stderr}"
    return result.stdout.strip()


def limited_profile(broker: SandboxBroker, name: str, limits: str) -> str:
    """Write and approve a profile with `limits:` (YAML lines indented by two), return its name."""
    broker.write_profile(name, backend_profile_text(broker, name, broker.repo, f"limits:\n{limits}"))
    approved = broker.run("ext", "approve", name)
    assert approved.status == 0, approved.stderr
    return name


def host_processes(predicate: Callable[[bytes, bytes], bool]) -> list[int]:
    """Host pids whose (cmdline, environ) satisfy `predicate` (root reads every process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as stream:
                cmdline = stream.read()
            try:
                with open(f"/proc/{entry}/environ", "rb") as stream:
                    environ = stream.read()
            except OSError:
                environ = b""
        except OSError:
            continue
        if predicate(cmdline, environ):
            found.append(int(entry))
    return found


def host_pids_with_argv(argv: list[str]) -> list[int]:
    """Host pids whose argv is exactly `argv`."""
    wanted = b"\0".join(a.encode() for a in argv) + b"\0"
    return host_processes(lambda cmdline, _env: cmdline == wanted)


def mount_points() -> list[str]:
    """The host's mount points (as the test process sees them), octal escapes decoded."""
    with open("/proc/self/mountinfo") as stream:
        lines = stream.read().splitlines()
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in lines]


def loop_backing_files() -> list[str]:
    """The backing file of every attached loop device."""
    files = []
    block = Path("/sys/block")
    for device in sorted(block.glob("loop*")):
        backing = device / "loop" / "backing_file"
        try:
            files.append(backing.read_text().strip())
        except OSError:
            continue
    return files


def run_cli(broker: SandboxBroker, *args: str, **popen: Any) -> subprocess.CompletedProcess[bytes]:
    """The CLI run with the given Popen keywords (stdin, stdout, …), output as bytes."""
    kwargs: dict[str, Any] = {"env": broker.env(), "timeout": 120}
    kwargs.update(popen)
    return subprocess.run(broker.argv(*args), check=False, **kwargs)
