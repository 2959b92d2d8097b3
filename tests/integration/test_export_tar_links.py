"""A tree's tar from a sandbox is judged before delivery as GNU tar and Python's tarfile would
unpack it: links that each stay inside alone but lead outside together (`a/b -> ..`, then
`c -> a/b/..`) are refused.

The verifier (sandboxer.commands.export._verify_tar, on sandboxer.core.tarcheck) is an oracle
checked here against the real thing: random archives of directories, files, symbolic and hard
links, with targets made of `.`, `..`, names and absolute paths; whenever it accepts one, real
GNU tar (default options) and tarfile.extractall(filter='data') unpack it into fresh directories
deep inside a scratch directory, and nothing outside them may be made, changed or resolved to.
The unpacking runs in bwrap with every path but the scratch directory read-only, so an escape
the verifier missed cannot touch the host (its write fails, and that failure fails the test).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandboxer.commands.export import _verify_tar
from sandboxer.errors import BackendError
from tests.integration.conftest import SandboxBroker

DEPTH = 12  # directories between the scratch directory and the trees: an escape stays in sight
ABSOLUTE = "/@"  # an absolute target's stand-in: the scratch directory, put in when the tar is made
KINDS = ("directory", "file", "symlink", "hardlink")

Member = tuple[str, str, str]  # kind, name, target

names = st.sampled_from(["a", "b", "c", "a/b", "b/a", "a/b/c"])
absolute = st.sampled_from(["/", "/etc", ABSOLUTE, f"{ABSOLUTE}/victim", f"{ABSOLUTE}/d0/.."])


def relative(among: list[str]) -> st.SearchStrategy[str]:
    """Down a path (often another member's), up some levels, down again: "a/b/..", "../c",
    "b/../..", ".", "c" ..."""
    return st.builds(
        lambda down, up, again: "/".join(part for part in (down, *[".."] * up, again) if part) or ".",
        st.sampled_from(["", ".", *among]),
        st.integers(0, 2),
        st.sampled_from(["", "a", "c"]),
    )


@st.composite
def trees(draw: st.DrawFn) -> list[Member]:
    """Shaped like a tree's tar: each name once, directories before what they hold, links
    mostly, relative targets through the other members. Most of what the verifier must judge
    (and accept) is here."""
    chosen = sorted(draw(st.lists(names, max_size=6, unique=True)), key=lambda name: name.count("/"))
    kinds = st.sampled_from(["directory", "file", "symlink", "symlink", "symlink"])
    above = {name.rsplit("/", depth)[0] for name in chosen for depth in range(1, name.count("/") + 1)}
    return [
        ("directory" if name in above else draw(kinds), name, draw(relative([n for n in chosen if n != name])))
        for name in chosen
    ]


# Anything: hard links, absolute targets, a name again, in any order.
wild = st.lists(st.tuples(st.sampled_from(KINDS), names, st.one_of(relative([]), absolute, names)), max_size=7)
archives = st.one_of(trees(), trees(), trees(), wild)


def _archive(path: Path, items: list[Member], scratch: Path) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for kind, name, target in items:
            info = tarfile.TarInfo(name)
            info.mode = 0o755 if kind == "directory" else 0o644
            data = b""
            if kind == "directory":
                info.type = tarfile.DIRTYPE
            elif kind == "file":
                data = b"x\n"
            else:
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = target.replace(ABSOLUTE, str(scratch), 1) if target.startswith(ABSOLUTE) else target
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data else None)


def _listing(top: Path, skip: tuple[Path, ...]) -> dict[str, tuple[int, int, str]]:
    """Every path below `top` (links not followed) but those below `skip`: its kind, size, target."""
    seen: dict[str, tuple[int, int, str]] = {}
    for directory, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if Path(directory, d) not in skip]
        for entry in (*dirs, *files):
            path = Path(directory, entry)
            info = path.lstat()
            seen[str(path)] = (info.st_mode, info.st_size, os.readlink(path) if path.is_symlink() else "")
    return seen


# Unpacks each archive it is given as GNU tar and tarfile (filter='data') would, and says how.
UNPACKER = """
import json, subprocess, sys, tarfile
for line in sys.stdin:
    archive, gnu, python = line.rstrip("\\n").split("\\t")
    tar = subprocess.run(["tar", "-x", "-f", archive, "-C", gnu], capture_output=True, text=True, check=False)
    try:
        if not hasattr(tarfile, "data_filter"):
            raise LookupError("no data filter here")
        with tarfile.open(archive) as opened:
            opened.extractall(python, filter="data")
        filtered = "unpacked"
    except Exception as exc:
        filtered = type(exc).__name__
    print(json.dumps({"tar": tar.stderr, "tarfile": filtered}), flush=True)
"""


class Unpacker:
    """UNPACKER in bwrap, where nothing but `base` is writable: an escape the verifier missed
    cannot touch the host (its write fails, and the test sees that failure)."""

    def __init__(self, python: str, base: Path) -> None:
        self.base = base
        argv = ["bwrap", "--ro-bind", "/", "/", "--bind", str(base), str(base), "--dev", "/dev", "--proc", "/proc"]
        argv += ["--unshare-pid", "--die-with-parent", "--", python, "-c", UNPACKER]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def unpack(self, archive: Path, gnu: Path, python: Path) -> dict[str, str]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(f"{archive}\t{gnu}\t{python}\n")
        self.process.stdin.flush()
        answer: dict[str, str] = json.loads(self.process.stdout.readline())
        return answer

    def stop(self) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.process.stdout.close()


def _python_with_data_filter() -> str | None:
    """An interpreter whose tarfile has filter='data' (3.12, or a 3.11 with it backported): the
    project's own is 3.11.2, without it."""
    for candidate in (sys.executable, "python3.13", "python3.12", "python3"):
        found = shutil.which(candidate)
        if found is None:
            continue
        probe = "import sys, tarfile; tarfile.data_filter; print(sys.executable)"
        done = subprocess.run([found, "-c", probe], capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def _inside(path: Path, top: Path) -> bool:
    real = os.path.realpath(path)
    return real == str(top) or real.startswith(f"{top}/")


@pytest.fixture(scope="module")
def unpacker() -> Iterator[Unpacker]:
    for tool in ("tar", "bwrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    python = _python_with_data_filter()
    if python is None:  # GNU tar alone then
        sys.stderr.write("no Python here has tarfile's filter='data' (3.12 or later): only GNU tar unpacks\n")
        python = sys.executable
    base = Path(tempfile.mkdtemp(prefix="sandboxer-tarlinks-")).resolve()
    started = Unpacker(python, base)
    try:
        yield started
    finally:
        started.stop()
        shutil.rmtree(base)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=archives)
@example(items=[("symlink", "a/b", ".."), ("symlink", "c", "a/b/..")])  # the chain of issue 31
@example(items=[("symlink", "a", "."), ("symlink", "b", "a/..")])
@example(items=[("directory", "a", ""), ("symlink", "a/b", ".."), ("symlink", "a/b/c", "..")])
def test_whatever_the_verifier_accepts_unpacks_inside_its_directory(unpacker: Unpacker, items: list[Member]) -> None:
    scratch = Path(tempfile.mkdtemp(dir=unpacker.base))
    try:
        deep = scratch.joinpath(*(f"d{n}" for n in range(DEPTH)))
        gnu, python = deep / "gnu", deep / "python"
        for tree in (gnu, python):
            tree.mkdir(parents=True)
        (scratch / "victim").write_text("outside\n")
        archive = scratch / "tree.tar"
        _archive(archive, items, scratch)
        try:
            _verify_tar(str(archive))
        except BackendError:
            return  # refused: nothing is unpacked
        before = _listing(scratch, (gnu, python))
        unpacked = unpacker.unpack(archive, gnu, python)
        assert "Read-only file system" not in unpacked["tar"], unpacked  # a write outside the scratch dir
        assert _listing(scratch, (gnu, python)) == before
        for tree in (gnu, python):
            for directory, dirs, files in os.walk(tree):
                for entry in (*dirs, *files):
                    path = Path(directory, entry)
                    assert _inside(path, tree), (str(path.relative_to(tree)), os.path.realpath(path), unpacked)
    finally:
        shutil.rmtree(scratch)


def test_export_tar_refuses_a_chain_of_links_that_leads_outside(sb: SandboxBroker) -> None:
    """Each link stays inside alone; through a/b, c leads to the parent of the tree. Refused with
    one line naming the member and the rule; nothing is written."""
    sandbox_id = sb.create()
    made = sb.sh(sandbox_id, "mkdir a && ln -s .. a/b && ln -s a/b/.. c && git add a c")
    assert made.status == 0, made.stderr
    tree = sb.root / "home" / "tree.tar"  # the broker's user's
    refused = sb.run("export", sandbox_id, "--tar", str(tree))
    assert (refused.status, refused.stderr) == (
        5,
        "sandboxer: export: the sandbox's tar holds 'c', a link that leads outside the tree"
        " through the links it names\n",
    )
    assert not tree.exists()
    assert sb.sh(sandbox_id, "rm c && git rm -q --cached c").status == 0
    assert sb.run("export", sandbox_id, "--tar", str(tree)).status == 0  # a/b alone stays inside
    with tarfile.open(tree) as archive:
        assert archive.getmember("a/b").linkname == ".."
