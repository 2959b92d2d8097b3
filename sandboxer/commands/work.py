"""A sandbox's work: what it made of its workspace since create, as its own git reports it.

Work is the commits on HEAD after the one create checked out (the record's `work.base`), and the
working tree as `git add --all` would commit it (files its .gitignore ignores are not work). An
export takes out the commits (a bundle, a patch series) or the tree (a tar) and the record notes
what it took (sandboxer.commands.export); teardown removes a sandbox only when its work is
nothing, or was exported as it is now, or with --discard.

Git runs inside the sandbox only, as the sandbox user, through an exec of the broker's own (one
an expired lease does not stop), with the sandbox's fsmonitor and hooks turned off for it: the
sandbox's config is its own business, but it does not get to run commands in the broker's git.
What git answers is untrusted: every value is checked for its form and used only to compare
and to report; what it writes is capped (twice the workspace's size), and a message quotes its
stderr only as printable text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandboxer.backends import Backends
from sandboxer.commands.execute import execute
from sandboxer.core.exec_request import ExecRequest
from sandboxer.errors import (
    BackendError,
    EntryError,
    ExecUsage,
    NotFoundError,
    PolicyError,
    UnexportedWorkError,
    UsageError,
)
from sandboxer.execio.stdio import Program
from sandboxer.host.fsutil import write_all
from sandboxer.host.registry import Registry, check_id
from sandboxer.host.workspace import is_commit_id

if TYPE_CHECKING:
    from sandboxer.core.record import SandboxRecord, WorkRecord
    from sandboxer.dirs import Dirs

GIT_SECONDS = 600  # one git command of an export inside the sandbox
MAX_REPORT = 4096  # the state script's output
MAX_STDERR = 4096  # of a failed git, kept for its message
MIB = 1024 * 1024
_BRANCH = re.compile(r"[A-Za-z0-9._/+@-]{1,255}")
_SHOWN = re.compile(r"[^ -~]")  # what a message may not quote of the sandbox's words: anything but printable ASCII

# Prints the workspace's state, one "key value" line each; run by sh with the base commit as $1.
# A clean working tree (nothing staged, changed or untracked that `git add --all` would take; the
# options override the sandbox's config that could hide any of it) is HEAD's tree; otherwise the
# tree is written from a private index (a copy of the real one, for its stat cache), which leaves
# the sandbox's own alone. A failed git ends the script (set -e), never reads as clean.
STATE_SCRIPT = r"""set -eu
export LC_ALL=C GIT_OPTIONAL_LOCKS=0 GIT_TERMINAL_PROMPT=0
git="git -c core.fsmonitor=false -c core.hooksPath=/dev/null"
# One rev-parse: the git dir, the commit and its tree checked out, the branch ("HEAD": detached).
at=$($git rev-parse --absolute-git-dir 'HEAD^{commit}' 'HEAD^{tree}' --abbrev-ref HEAD -- 2>/dev/null) ||
  { echo "no commit is checked out" >&2; exit 3; }
{ read -r git_dir; read -r head; read -r head_tree; read -r branch; } <<EOF
$at
EOF
[ "$branch" != HEAD ] || branch=
changes=$($git status --porcelain --untracked-files=all --ignore-submodules=none)
if [ -z "$changes" ]; then
  tree=$head_tree
else
  index=$(mktemp "${TMPDIR:-/tmp}/sandboxer-index.XXXXXX")
  trap 'rm -f "$index"' EXIT
  if [ -f "$git_dir/index" ]; then cp -p "$git_dir/index" "$index"; else rm -f "$index"; fi
  GIT_INDEX_FILE=$index $git add --all
  tree=$(GIT_INDEX_FILE=$index $git write-tree)
fi
echo "head $head"
echo "tree $tree"
echo "head_tree $head_tree"
echo "branch $branch"
if [ "$head" = "$1" ]; then ahead=0  # HEAD is the base: no commit since
else ahead=$($git rev-list --count "$1..HEAD" 2>/dev/null || echo unknown)
fi
echo "ahead $ahead"
"""

# The broker's git commands inside, with the sandbox's fsmonitor and hooks off.
GIT = ("git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null")


@dataclass(frozen=True, slots=True)
class WorkState:
    """The workspace as its sandbox reports it (untrusted: every value checked for its form)."""

    head: str
    branch: str | None
    tree: str  # the working tree as `git add --all` would commit it
    head_tree: str
    ahead: int | None  # commits on HEAD since the base (None: the base is gone from its history)

    @property
    def dirty(self) -> bool:
        return self.tree != self.head_tree

    def unexported(self, work: WorkRecord) -> list[str]:
        """What of this work no export took out (empty: teardown loses nothing)."""
        lost = []
        if self.ahead != 0 and ("commits", self.head) not in work.exported:
            count = "new commits" if self.ahead is None else f"{self.ahead} new commit{'s' if self.ahead != 1 else ''}"
            lost.append(f"{count} on {self.branch or 'HEAD'} (made from {work.ref})")
        if self.dirty and ("tree", self.tree) not in work.exported:
            lost.append("changes not committed")
        return lost


def work_state(
    dirs: Dirs, sandbox_id: str, *, backends: Backends, seconds: float = GIT_SECONDS
) -> tuple[WorkState, WorkRecord]:
    """The sandbox's work as its git reports it now, with the record's account of it."""
    record, work = ready_work(dirs, sandbox_id)
    script = ["sh", "-c", STATE_SCRIPT, "sh", work.base]
    out = git_inside(dirs, record, script, backends=backends, limit=MAX_REPORT, seconds=seconds)
    return _parse_state(out.decode("utf-8", errors="replace")), work


def unexported(dirs: Dirs, sandbox_id: str, *, backends: Backends) -> list[str]:
    """What teardown would lose of a ready sandbox's work (empty: nothing). Work that cannot be
    checked is refused as lost: UnexportedWorkError names why. A sandbox whose processes are
    gone has nothing to lose any more (nothing can be exported from it)."""
    registry = Registry(dirs.state)
    record = registry.read_or_none(check_id(sandbox_id))
    if record is None or record.state != "ready" or record.hidden or record.work is None:
        return []  # nothing a caller worked in: a create under way or failed, an older record

    if backends.backend(record.backend).is_running(record) is False:
        return []  # its processes are gone: no export can take anything out of it any more
    try:
        state, work = work_state(dirs, sandbox_id, backends=backends)
    except (BackendError, UsageError) as exc:
        reason = exc.message.removeprefix("export: ")
        raise UnexportedWorkError(
            f"teardown: sandbox {sandbox_id}: its work cannot be checked ({reason}); "
            "teardown --discard removes it anyway",
            unexported=(f"its work cannot be checked ({reason})",),
        ) from None
    return state.unexported(work)


def ready_work(dirs: Dirs, sandbox_id: str) -> tuple[SandboxRecord, WorkRecord]:
    """A ready sandbox's record and its account of the workspace (NotFoundError, UsageError)."""
    record: SandboxRecord | None = Registry(dirs.state).read_or_none(check_id(sandbox_id))
    if record is None or record.hidden:
        raise NotFoundError(f"no such sandbox: {sandbox_id}")
    if record.state != "ready":
        raise UsageError(f"export: sandbox {sandbox_id} is not ready (state {record.state})")
    if record.work is None:
        raise UsageError(f"export: sandbox {sandbox_id} was made before exports existed: its base commit is unknown")
    return record, record.work


def cap_of(record: SandboxRecord) -> int:
    """The most an export of this sandbox may write: twice its workspace's size (a tree's tar,
    a bundle of its history, cannot be more; a tree that repeats a large file many times can)."""
    mib = record.workspace_fs.mib if record.workspace_fs is not None else 4096
    return (2 * mib + 64) * MIB


def git_inside(
    dirs: Dirs,
    record: SandboxRecord,
    argv: list[str],
    *,
    backends: Backends,
    limit: int | None = None,
    into: int | None = None,
    room: Callable[[int], None] | None = None,
    seconds: float = GIT_SECONDS,
) -> bytes:
    """Run the broker's `argv` in the sandbox's workspace: its stdout (at most `limit` bytes), or
    written to `into` (at most cap_of the sandbox; past it, or when `into` cannot take more, the
    command is killed). `room(n)` is asked before each n bytes are written to `into`: its
    PolicyError (the caller's export budget is full) kills the command and is raised. Any other
    failure is a BackendError saying why."""

    out: list[bytes] = []
    err: list[bytes] = []
    size = [0, 0]
    cap = limit if into is None and limit is not None else cap_of(record)
    stopped: list[str] = []  # why the broker stopped the command
    refused: list[PolicyError] = []

    def sink(stream: str, chunk: bytes) -> None:
        if stopped:
            return
        if stream != "stdout":
            if size[1] < MAX_STDERR:
                size[1] += len(chunk)
                err.append(chunk)
            return
        size[0] += len(chunk)
        if size[0] > cap:
            stopped.append(f"it wrote more than {cap // MIB or 1} MiB" if into is not None else "it said too much")
        elif into is None:
            out.append(chunk)
        else:
            try:
                if room is not None:
                    room(len(chunk))
                write_all(into, chunk)
            except PolicyError as exc:
                refused.append(exc)
                stopped.append(exc.message)
            except OSError as exc:
                stopped.append(f"the broker's copy cannot be written ({exc.strerror})")

    try:
        request = ExecRequest(sandbox_id=record.id, argv=tuple(argv), timeout=float(seconds))  # in /workspace
        status = execute(
            dirs, request, Program(b"", sink, lambda: bool(stopped)), backends=backends, caller_env={}, for_broker=True
        )
    except ExecUsage as exc:  # not running, not ready: as exec would say it
        raise UsageError(f"export: {str(exc).removeprefix('exec: ')}") from None
    except EntryError as exc:
        raise BackendError(f"export: git cannot run in sandbox {record.id} ({exc.message})") from None
    if refused:
        raise refused[0]
    if stopped:
        raise BackendError(f"export: git in sandbox {record.id} was stopped: {stopped[0]}")
    if status != 0:
        said = b"".join(err).decode("utf-8", errors="replace").strip().splitlines()
        why = _SHOWN.sub("?", said[-1])[:200] if said else f"status {status}"
        raise BackendError(f"export: git in sandbox {record.id} failed: {why}")
    return b"".join(out)


def _parse_state(text: str) -> WorkState:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key not in ("head", "tree", "head_tree", "branch", "ahead") or key in fields:
            raise BackendError("export: the sandbox's git answered out of shape")
        fields[key] = value
    ids = [fields.get("head", ""), fields.get("tree", ""), fields.get("head_tree", "")]
    branch, ahead = fields.get("branch", ""), fields.get("ahead", "")
    if (
        not all(is_commit_id(value) for value in ids)
        or (branch and not _BRANCH.fullmatch(branch))
        or not (ahead == "unknown" or (ahead.isdigit() and ahead.isascii() and len(ahead) < 10))
    ):
        raise BackendError("export: the sandbox's git answered out of shape")
    return WorkState(
        head=fields["head"],
        branch=branch or None,
        tree=fields["tree"],
        head_tree=fields["head_tree"],
        ahead=None if ahead == "unknown" else int(ahead),
    )
