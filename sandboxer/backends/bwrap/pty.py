"""`exec -t` on bwrap: a terminal from the sandbox's own devpts, so the command can name it.

bwrap gives each sandbox a devpts instance of its own at /dev/pts. A terminal opened from the
host's devpts would be a device the sandbox cannot see: `tty` says "not a tty", `ttyname()`
fails, and programs that reopen their terminal by name (`script`, `tmux`, `ssh` and `gpg`
prompts through /dev/tty's name) break. So the broker opens the sandbox's own multiplexer,
`/dev/pts/ptmx` as the sandbox's holder sees its root, and the command's end is the peer of that
master (TIOCGPTPEER: no name is looked up for it): `/dev/pts/0` inside.

The path is resolved through the holder's root, which the sandbox's processes share; whatever
they did to it, the master is used only when it is the `ptmx` device (5:2) of the devpts that
the kernel lists mounted at /dev/pts in the holder's mount table (its st_dev); anything else is
closed and the exec refused. The new pty is then given to the sandbox user (its host uid and
gid): devpts makes it the opener's, the broker's, which has no id inside, and a command that
opens its terminal again by name would be refused its own terminal.
"""

from __future__ import annotations

import fcntl
import os
import stat

from sandboxer.errors import ExecUsage
from sandboxer.execio.terminal import TerminalOpener, set_size
from sandboxer.host import procs

TIOCGPTPEER = 0x5441  # <asm-generic/ioctls.h>: open the peer of a master (Linux 4.13)
TIOCSPTLCK = 0x40045431  # _IOW("T", 0x31, int): lock or unlock the peer (unlockpt)
PTMX = (5, 2)  # major, minor of /dev/ptmx and every devpts instance's ptmx


def devpts_device(pid: int) -> int:
    """st_dev of the devpts mounted at /dev/pts in process `pid`'s mount table; ExecUsage when
    there is none."""
    try:
        with open(f"/proc/{pid}/mountinfo") as table:
            lines = table.read().splitlines()
    except OSError as exc:
        raise ExecUsage(f"exec: -t: the sandbox's mounts cannot be read ({exc.strerror})") from None
    found = None
    for line in lines:
        fields = line.split()
        # ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        after = fields.index("-") if "-" in fields else -1
        if after > 4 and fields[4] == "/dev/pts" and fields[after + 1] == "devpts":
            major, minor = fields[2].split(":")
            found = os.makedev(int(major), int(minor))  # the last mount there is the one seen
    if found is None:
        raise ExecUsage("exec: -t: the sandbox has no devpts at /dev/pts")
    return found


def opener(holder_pid: int, holder_start: int, owner: tuple[int, int]) -> TerminalOpener:
    """open_terminal for the sandbox whose holder is `holder_pid` (started at `holder_start`),
    the terminal owned by `owner` (the sandbox user's host uid and gid)."""

    def open_sandbox_terminal(size: tuple[int, int] | None) -> tuple[int, int]:
        return sandbox_terminal(holder_pid, holder_start, owner, size)

    return open_sandbox_terminal


def sandbox_terminal(
    holder_pid: int, holder_start: int, owner: tuple[int, int], size: tuple[int, int] | None
) -> tuple[int, int]:
    """A new terminal of the sandbox's devpts (master, the command's end), both close-on-exec, at
    `size`; ExecUsage when it cannot be had."""
    device = devpts_device(holder_pid)
    try:
        root = os.open(f"/proc/{holder_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ExecUsage(f"exec: -t: the sandbox's root cannot be opened ({exc.strerror})") from None
    try:
        if not procs.alive(holder_pid, holder_start):  # the pid was not reused meanwhile
            raise ExecUsage("exec: -t: the sandbox is not running")
        master = os.open("dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=root)
    except OSError as exc:
        raise ExecUsage(f"exec: -t: the sandbox's /dev/pts/ptmx cannot be opened ({exc.strerror})") from None
    finally:
        os.close(root)
    try:
        seen = os.fstat(master)
        if not stat.S_ISCHR(seen.st_mode) or (os.major(seen.st_rdev), os.minor(seen.st_rdev)) != PTMX:
            raise ExecUsage("exec: -t: the sandbox's /dev/pts/ptmx is not a terminal multiplexer")
        if seen.st_dev != device:
            raise ExecUsage("exec: -t: the sandbox's /dev/pts/ptmx is not its devpts's")
        fcntl.ioctl(master, TIOCSPTLCK, b"\0\0\0\0")  # unlockpt
        end = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        os.close(master)
        raise ExecUsage(f"exec: -t: the sandbox's terminal cannot be opened ({exc.strerror})") from None
    except BaseException:
        os.close(master)
        raise
    try:
        if (os.fstat(end).st_uid, os.fstat(end).st_gid) != owner:
            os.fchown(end, *owner)
    except OSError as exc:
        os.close(master)
        os.close(end)
        raise ExecUsage(f"exec: -t: the sandbox's terminal cannot be given to its user ({exc.strerror})") from None
    if size is not None:
        set_size(master, size)
    return master, end
