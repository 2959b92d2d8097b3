"""A sandbox's work: what it made of its workspace since create, as its own git reports it.

Work is the commits on HEAD after the one create checked out (the record's `work.base`), and the
working tree as `git add --all` would commit it (files its .gitignore ignores are not work). An
export takes out the commits (a bundle, a patch series) or the tree (a tar) and the record notes
what it took (sandboxer.commands.export); teardown removes a sandbox only when its work is
nothing, or was exported as it is now, or with --discard.

Git runs inside the sandbox only, as the sandbox user, through an ordinary exec: its hooks and
config are the sandbox's own business and act there. What it answers is untrusted: every value
is checked for its form, and used only to compare and to report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandboxer.errors import BackendError, EntryError, ExecUsage, NotFoundError, UnexportedWorkError, UsageError
from sandboxer.host.fsutil import write_all
from sandboxer.host.registry import Registry, check_id
from sandboxer.host.workspace import is_commit_id

if TYPE_CHECKING:
    from sandboxer.core.record import SandboxRecord, WorkRecord
    from sandboxer.dirs import Dirs

GIT_SECONDS = 600  # an export's git inside the sandbox
MAX_REPORT = 64 * 1024  # the state script's output, and the stderr kept of a failed git
_BRANCH = re.compile(r"[A-Za-z0-9._/+@-]{1,255}")

# Prints the workspace's state, one "key value" line each; run by sh with the base commit as $1.
# A private index (a copy of the real one, for its stat cache) leaves the sandbox's own alone.
STATE_SCRIPT = r"""set -eu
export LC_ALL=C GIT_OPTIONAL_LOCKS=0 GIT_TERMINAL_PROMPT=0
head=$(git rev-parse --verify --quiet 'HEAD^{commit}') || { echo "no commit is checked out" >&2; exit 3; }
branch=$(git symbolic-ref --quiet --short HEAD) || branch=
git_dir=$(git rev-parse --absolute-git-dir)
index=$(mktemp "${TMPDIR:-/tmp}/sandboxer-index.XXXXXX")
trap 'rm -f "$index"' EXIT
if [ -f "$git_dir/index" ]; then cp "$git_dir/index" "$index"; else rm -f "$index"; fi
GIT_INDEX_FILE=$index git add --all
tree=$(GIT_INDEX_FILE=$index git write-tree)
echo "head $head"
echo "tree $tree"
echo "head_tree $(git rev-parse --verify 'HEAD^{tree}')"
echo "branch $branch"
if commits=$(git rev-list --reverse "$1..HEAD" 2>/dev/null); then
  echo "ahead $(printf '%s' "$commits" | grep -c . || true)"
  for commit in $commits; do echo "commit $commit"; done
else
  echo "ahead unknown"
fi
"""


@dataclass(frozen=True, slots=True)
class WorkState:
    """The workspace as its sandbox reports it (untrusted: every value checked for its form)."""

    head: str
    branch: str | None
    tree: str  # the working tree as `git add --all` would commit it
    head_tree: str
    commits: tuple[str, ...] | None  # new since the base, oldest first (None: the base is gone)

    @property
    def dirty(self) -> bool:
        return self.tree != self.head_tree

    @property
    def ahead(self) -> int | None:
        return None if self.commits is None else len(self.commits)

    def unexported(self, work: WorkRecord) -> list[str]:
        """What of this work no export took out (empty: teardown loses nothing)."""
        lost = []
        if self.ahead != 0 and ("commits", self.head) not in work.exported:
            count = "new commits" if self.ahead is None else f"{self.ahead} new commit{'s' if self.ahead != 1 else ''}"
            lost.append(f"{count} on {self.branch or 'HEAD'} (made from {work.ref})")
        if self.dirty and ("tree", self.tree) not in work.exported:
            lost.append("changes not committed")
        return lost


def work_state(dirs: Dirs, sandbox_id: str) -> tuple[WorkState, WorkRecord]:
    """The sandbox's work as its git reports it now, with the record's account of it."""
    work = work_of(dirs, sandbox_id)
    out = git_inside(dirs, sandbox_id, ["sh", "-c", STATE_SCRIPT, "sh", work.base], limit=MAX_REPORT)
    return _parse_state(out.decode("utf-8", errors="replace")), work


def unexported(dirs: Dirs, sandbox_id: str) -> list[str]:
    """What teardown would lose of a ready sandbox's work (empty: nothing). Work that cannot be
    checked is refused as lost: UnexportedWorkError names why. A sandbox whose processes are
    gone has nothing to lose any more (nothing can be exported from it)."""
    registry = Registry(dirs.state)
    record = registry.read_or_none(check_id(sandbox_id))
    if record is None or record.state != "ready" or record.hidden or record.work is None:
        return []  # nothing a caller worked in: a create under way or failed, an older record
    from sandboxer.backends import backend_for

    if backend_for(record.backend).is_running(record) is False:
        return []  # its processes are gone: no export can take anything out of it any more
    try:
        state, work = work_state(dirs, sandbox_id)
    except (BackendError, UsageError) as exc:
        reason = exc.message.removeprefix("export: ")
        raise UnexportedWorkError(
            f"teardown: sandbox {sandbox_id}: its work cannot be checked ({reason}); "
            "teardown --discard removes it anyway"
        ) from None
    return state.unexported(work)


def work_of(dirs: Dirs, sandbox_id: str) -> WorkRecord:
    record: SandboxRecord | None = Registry(dirs.state).read_or_none(check_id(sandbox_id))
    if record is None or record.hidden:
        raise NotFoundError(f"no such sandbox: {sandbox_id}")
    if record.state != "ready":
        raise UsageError(f"export: sandbox {sandbox_id} is not ready (state {record.state})")
    if record.work is None:
        raise UsageError(f"export: sandbox {sandbox_id} was made before exports existed: its base commit is unknown")
    return record.work


def git_inside(
    dirs: Dirs, sandbox_id: str, argv: list[str], *, limit: int | None = None, into: int | None = None
) -> bytes:
    """Run `argv` in the sandbox's workspace: its stdout (at most `limit` bytes), or written to
    `into`. A status other than 0 is a BackendError with the start of its stderr."""
    from sandboxer.commands.execute import execute
    from sandboxer.host.stdio import Program

    out: list[bytes] = []
    err: list[bytes] = []
    size = [0, 0]

    def sink(stream: str, chunk: bytes) -> None:
        if stream == "stdout":
            size[0] += len(chunk)
            if into is not None:
                write_all(into, chunk)
            elif limit is not None and size[0] <= limit:
                out.append(chunk)
        elif size[1] < MAX_REPORT:
            size[1] += len(chunk)
            err.append(chunk)

    options = {"id": sandbox_id, "cwd": "/workspace", "timeout": str(GIT_SECONDS)}
    try:
        status = execute(dirs, options, argv, Program(b"", sink))
    except ExecUsage as exc:  # not running, not ready: as exec would say it
        raise UsageError(f"export: {str(exc).removeprefix('exec: ')}") from None
    except EntryError as exc:
        raise BackendError(f"export: git cannot run in sandbox {sandbox_id} ({exc.message})") from None
    if status != 0:
        first = b"".join(err).decode("utf-8", errors="replace").strip().splitlines()
        why = first[-1][:200] if first else f"status {status}"
        raise BackendError(f"export: git in sandbox {sandbox_id} failed: {why}")
    if limit is not None and size[0] > limit:
        raise BackendError(f"export: git in sandbox {sandbox_id} said more than {limit} bytes")
    return b"".join(out)


def _parse_state(text: str) -> WorkState:
    fields: dict[str, str] = {}
    commits: list[str] = []
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "commit":
            commits.append(value)
        elif key in ("head", "tree", "head_tree", "branch", "ahead") and key not in fields:
            fields[key] = value
        else:
            raise BackendError("export: the sandbox's git answered out of shape")
    ids = [fields.get("head", ""), fields.get("tree", ""), fields.get("head_tree", ""), *commits]
    branch = fields.get("branch", "")
    ahead = fields.get("ahead")
    known = ahead is not None and ahead != "unknown"
    if (
        not all(is_commit_id(value) for value in ids)
        or (branch and not _BRANCH.fullmatch(branch))
        or ahead is None
        or (known and ahead != str(len(commits)))
        or (not known and commits)
    ):
        raise BackendError("export: the sandbox's git answered out of shape")
    return WorkState(
        head=fields["head"],
        branch=branch or None,
        tree=fields["tree"],
        head_tree=fields["head_tree"],
        commits=tuple(commits) if known else None,
    )
