"""What a root broker mounts for a sandbox so that its mount table names no host path.

A mount's root field in /proc/self/mountinfo is the path of the mounted directory within its
filesystem, whatever bind or descriptor it was mounted through: a runtime bound from the host's
root filesystem shows its host path (`/srv/sandboxer/runtimes/demo`) inside the sandbox. So, as
root, the sandbox sees filesystems of its own instead:

- the runtime: a read-only erofs image of the pinned tree, made once per digest in the state
  dir (`runtimes/<sha256>.erofs`, its content digested again from the image itself before it is
  kept), loop-mounted read-only at `<sandbox dir>/runtime` for each sandbox. Inside, the mount
  shows root `/` and a loop device; the owner changing the runtime directory later changes
  nothing under a running sandbox.
- Docker's generated /etc files: a small tmpfs at `<sandbox dir>/etc` (bwrap's are memfds).

Teardown and gc unmount both (`unstage`, from each backend's stop); the loop device goes with
the mount (autoclear). An unprivileged broker cannot mount: its sandboxes still show the runtime
directory's path (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
import shutil
import struct
import subprocess
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.core.digest import RuntimeArtifactError, tree_digest
from sandboxer.core.plan import RUNTIME_TARGET, Plan
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError, PolicyError
from sandboxer.host import fsutil
from sandboxer.host.observe import parse_mountinfo

if TYPE_CHECKING:
    from sandboxer.host.observe import MountSeen

IMAGES = "runtimes"  # below the state dir: <sha256>.erofs, root's, 0600
RUNTIME_POINT = "runtime"  # below the sandbox dir: the runtime image's mount
ETC_POINT = "etc"  # below the sandbox dir: Docker's generated /etc files
ETC_FS_OPTIONS = "size=1m,nr_inodes=64,mode=0755"
_TOOLS = "/usr/sbin:/usr/bin:/sbin:/bin"

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE = 0x4C82, 0x4C0A
_LO_FLAGS_READ_ONLY, _LO_FLAGS_AUTOCLEAR = 1, 4


def runtime_image(state_dir: str, runtime_path: str, sha256: str) -> str:
    """The erofs image of the runtime pinned at `sha256`, made from `runtime_path` unless the
    state dir has it already. Refused (PolicyError) when what the image holds does not have the
    pinned digest: the runtime changed between the create's check and the image."""
    directory = os.path.join(state_dir, IMAGES)
    image = os.path.join(directory, f"{sha256}.erofs")
    if os.path.isfile(image):
        return image
    fsutil.ensure_private_dir(directory, "runtime images directory")
    with fsutil.locked(os.path.join(directory, ".lock")):
        if not os.path.isfile(image):
            _remove_leftovers(directory)
            _make_image(directory, image, runtime_path, sha256)
    return image


def _remove_leftovers(directory: str) -> None:
    """What a broker killed while it made an image left (the lock is held: nobody makes one now):
    its partial image, and its check mount, unmounted first."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(".partial-"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        elif name.startswith(".check-"):
            with contextlib.suppress(OSError):
                if os.path.ismount(path):
                    fsutil.unmount(path, detach=True)
                os.rmdir(path)


def _make_image(directory: str, image: str, runtime_path: str, sha256: str) -> None:

    tool = shutil.which("mkfs.erofs", path=_TOOLS)
    if tool is None:
        raise BackendError("mkfs.erofs is not installed", hint="apt-get install -y erofs-utils")
    partial = os.path.join(directory, f".partial-{secrets.token_hex(8)}.erofs")  # in root's 0700 dir
    check = tempfile.mkdtemp(prefix=".check-", dir=directory)
    try:
        done = subprocess.run(
            [tool, "--quiet", "--preserve-mtime", partial, runtime_path],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={"PATH": _TOOLS, "LANG": "C"},
            check=False,
            timeout=600,
        )
        if done.returncode != 0:
            last = done.stderr.decode(errors="replace").strip().splitlines()
            raise BackendError(f"runtime image: mkfs.erofs failed ({last[-1] if last else done.returncode})")
        os.chmod(partial, 0o600)
        mount_image(partial, check)
        try:
            seen = tree_digest(check).sha256
        except RuntimeArtifactError as exc:
            seen = f"unreadable ({exc})"
        finally:
            fsutil.unmount(check)
        if seen != sha256:
            raise PolicyError(
                f"runtime {runtime_path}: changed while its image was made (tree digest {seen}, pinned {sha256})"
            )
        os.rename(partial, image)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        with contextlib.suppress(OSError):
            os.rmdir(check)


def mount_image(image: str, point: str) -> None:
    """Mount the erofs `image` read-only (nosuid, nodev) at `point` through a fresh loop device,
    which the kernel frees when the mount goes (autoclear). The loop ioctls and mount(2) are
    called here: mount(8) would cost a process per create."""
    backing = os.open(image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for _ in range(16):  # another process may take the free device first
            device = _free_loop_device()
            loop = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
            try:
                try:
                    _configure(loop, backing)
                except OSError as exc:
                    if exc.errno == 16:  # EBUSY: taken meanwhile
                        continue
                    raise BackendError(f"runtime image: loop device {device} ({exc.strerror})") from None
                _mount(device, point)
                return
            finally:
                os.close(loop)  # the mount holds the device now; without it, autoclear frees it
        raise BackendError("runtime image: no free loop device")
    finally:
        os.close(backing)


def _free_loop_device() -> str:
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendError(f"runtime image: /dev/loop-control ({exc.strerror})") from None
    try:
        return f"/dev/loop{fcntl.ioctl(control, _LOOP_CTL_GET_FREE)}"
    except OSError as exc:
        raise BackendError(f"runtime image: no free loop device ({exc.strerror})") from None
    finally:
        os.close(control)


def _configure(loop: int, backing: int) -> None:
    # struct loop_config: fd, block_size, struct loop_info64 (232 bytes; lo_flags at offset 52),
    # 64 reserved bytes.
    info = bytearray(232)
    struct.pack_into("I", info, 52, _LO_FLAGS_READ_ONLY | _LO_FLAGS_AUTOCLEAR)
    config = struct.pack("II", backing, 0) + bytes(info) + bytes(64)
    fcntl.ioctl(loop, _LOOP_CONFIGURE, config)


def _mount(device: str, point: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    if libc.mount(device.encode(), point.encode(), b"erofs", flags, None) != 0:
        code = ctypes.get_errno()
        raise BackendError(f"runtime image: mount at {point} failed ({os.strerror(code)})")


def stage_runtime(plan: Plan, state_dir: str, sandbox_dir: str) -> str:
    """Mount the plan's runtime image at `<sandbox dir>/runtime` (made empty, 0755); its path."""
    image = runtime_image(state_dir, plan.runtime_path, plan.runtime_sha256)
    point = os.path.join(sandbox_dir, RUNTIME_POINT)
    os.mkdir(point, 0o755)
    try:
        mount_image(image, point)
    except FileNotFoundError:  # the owner removed the image meanwhile: it is made again
        mount_image(runtime_image(state_dir, plan.runtime_path, plan.runtime_sha256), point)
    return point


def staged_plan(plan: Plan, point: str) -> Plan:
    """The plan with its runtime bound from the staged mount at `point`."""
    mounts = tuple(replace(m, source=point) if m.target == RUNTIME_TARGET else m for m in plan.mounts)
    return replace(plan, mounts=mounts)


def mount_etc(sandbox_dir: str) -> str:
    """A tmpfs of its own at `<sandbox dir>/etc` (no exec, setuid or devices) for Docker's
    generated /etc files; its path."""
    point = os.path.join(sandbox_dir, ETC_POINT)
    os.makedirs(point, mode=0o755, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if libc.mount(b"tmpfs", point.encode(), b"tmpfs", flags, ETC_FS_OPTIONS.encode()) != 0:
        code = ctypes.get_errno()
        raise BackendError(f"generated /etc files: tmpfs at {point} failed ({os.strerror(code)})")
    return point


def unstage(sandbox_dir: str) -> Removal:
    """Unmount a sandbox's runtime image and /etc tmpfs (once nothing of it runs). Lazily: a
    mount namespace that still holds one keeps it until it ends."""
    removed, residue = [], []
    points = set(fsutil.mount_points())
    for name, what in ((RUNTIME_POINT, "runtime image"), (ETC_POINT, "/etc tmpfs")):
        point = os.path.join(sandbox_dir, name)
        while point in points:  # mounted twice over (a retried start): each goes
            try:
                fsutil.unmount(point, detach=True)
            except OSError as exc:
                residue.append(f"{what} {point}: umount failed ({exc.strerror})")
                break
            removed.append(f"{what} {point}")
            points = set(fsutil.mount_points())
    return Removal.of(removed, residue)


def runtime_mismatches(sandbox_dir: str, inside: list[MountSeen]) -> list[str]:
    """Whether the sandbox's runtime is its staged image: the mount at the runtime's target
    inside must show the filesystem and root of the mount at `<sandbox dir>/runtime` here (an
    engine in another mount namespace would bind the empty point beneath it instead)."""

    with open("/proc/self/mountinfo") as stream:
        host = {m.target: m for m in parse_mountinfo(stream.read())}  # the last at a point is on top
    ours = host.get(os.path.join(sandbox_dir, RUNTIME_POINT))
    theirs = {m.target: m for m in inside}.get(RUNTIME_TARGET)
    if ours is None or theirs is None or (ours.device, ours.root) != (theirs.device, theirs.root):
        return [f"mount {RUNTIME_TARGET}: not the runtime's staged image"]
    return []
