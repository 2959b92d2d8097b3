"""Process B's last steps (joiner.py has the sequence): from a process in the sandbox's
namespaces to the command — a new session, its stdio, cwd and rlimits, the sandbox's session
keyring, every capability dropped, no_new_privs, a Landlock domain of its own, no descriptor
but 0-2, default signals, the syscall policy last, then execve with the plan's environment.
What goes wrong is written on the report pipe (report_line) for the broker to read."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import signal
import termios

from sandboxer.backends.bwrap.entry import Entry
from sandboxer.backends.bwrap.privileges import (
    PR_SET_NO_NEW_PRIVS,
    drop_all_capabilities,
    new_session_keyring,
    own_landlock_domain,
    prctl,
)
from sandboxer.host.seccomp_install import install as install_seccomp


def report_line(fd: int, text: str) -> None:
    """One line on the report pipe: "pid N", "setup STATUS MESSAGE" or "exec STATUS MESSAGE"."""
    os.write(fd, text.encode(errors="backslashreplace") + b"\n")  # a name may not be UTF-8


def become_command(entry: Entry, report: int, stdio: tuple[int, int, int]) -> None:
    """Process B, in the sandbox's namespaces: becomes the command or exits 125/126/127 (the
    reason on `report`)."""
    try:
        os.setsid()  # no controlling terminal: TIOCSTI cannot reach the caller's
        for target, fd in enumerate(stdio):
            if fd != target:
                os.dup2(fd, target)
        if entry.tty:  # exec -t: its own terminal (never the caller's) controls its new session
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        try:
            os.chdir(entry.cwd)
        except OSError as exc:
            report_line(report, f"setup 125 --cwd {entry.cwd}: not a directory inside the sandbox ({exc.strerror})")
            os._exit(125)
        for which, limit in entry.rlimits:
            resource.setrlimit(which, (limit, limit))
        uid, gid = os.getuid(), os.getgid()
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        new_session_keyring(entry.keyring)
        drop_all_capabilities()
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        own_landlock_domain()
        os.closerange(3, report)
        os.closerange(report + 1, 0x7FFFFFFF)  # every descriptor above, however high (close_range)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if entry.seccomp is not None:
            install_seccomp(entry.seccomp)  # last: from here on only what the policy allows, execve included
    except (OSError, ValueError) as exc:  # ValueError: an rlimit above the hard one, say
        report_line(report, f"setup 125 cannot prepare the command ({getattr(exc, 'strerror', None) or exc})")
        os._exit(125)
    program = entry.executable or entry.argv[0]
    try:
        os.execvpe(program, list(entry.argv), entry.env)  # noqa: S606 - argv by design, never a shell
    except ValueError:  # a NUL in the command line or the environment: nothing execve can take
        report_line(report, "exec 126 the command line or its environment holds a NUL character")
        os._exit(126)
    except OSError as exc:
        status = 127 if exc.errno in (errno.ENOENT, errno.ENOTDIR) else 126
        what = "not found" if status == 127 else f"not executable ({exc.strerror})"
        report_line(report, f"exec {status} {program}: {_dangling(program, entry.env) if status == 127 else what}")
        os._exit(status)


def _dangling(program: str, env: dict[str, str]) -> str:
    """Why a program execvp did not find is missing: a link on its path that leads nowhere (an
    alternative the image lacks, say) is named as such, else "not found"."""
    places = [program] if "/" in program else [f"{d or '.'}/{program}" for d in env.get("PATH", "").split(":")]
    for place in places:
        try:
            if os.path.islink(place) and not os.path.exists(place):
                return f"{place} is a dangling link (to {os.readlink(place)})"
        except OSError:  # gone meanwhile: the sandbox's own processes may change it
            continue
    return "not found"
