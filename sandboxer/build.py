"""Building a runtime: a standalone venv of the system Python with the owner's packages in it.

    python scripts/build-runtime.py --output DIR [--source PATH]... [--requirement FILE]...
        [--package SPEC]... [--allow-dirty] [--json]

Every step runs with an empty HOME and an allowlisted environment, so no credential, no
caller configuration and no pip cache of the user's goes into the runtime. Console entry
points are rewritten to the fixed mount `/opt/sandboxer/runtime/bin/python3`, bytecode is
compiled now (the runtime is read-only when used), and build-info.json records where
everything came from: each source's revision, each requirements file's digest, each package as
asked for, and every distribution installed with its version and, where pip downloaded an
archive, its sha256. `bin/runtime-venv` makes a venv on top of the runtime inside a sandbox
(RUNTIME_VENV). The result is printed with its tree digest v1, ready to pin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from sandboxer.core.digest import tree_digest
from sandboxer.errors import BackendError, SandboxerError, UsageError
from sandboxer.output import emit_error

SYSTEM_PYTHON = "/usr/bin/python3"
MOUNT = "/opt/sandboxer/runtime"
SHEBANG = f"#!{MOUNT}/bin/python3\n".encode()
# What the build's processes may see of the environment: nothing of the caller's.
_PASSED_THROUGH = ("LANG", "LC_ALL", "TZ")


def _environment(home: str) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env |= {"PIP_NO_CACHE_DIR": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env |= {key: os.environ[key] for key in _PASSED_THROUGH if key in os.environ}
    env.setdefault("LANG", "C.UTF-8")
    return env


def _run(argv: list[str], env: dict[str, str], what: str, cwd: str | None = None) -> str:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.lower().startswith("error")] or lines[-2:]
        raise BackendError(f"build: {what} failed: {' | '.join(errors[:3])}")
    return proc.stdout


def source_revision(path: Path, env: dict[str, str], *, allow_dirty: bool) -> dict[str, Any]:
    """The Git revision of a source tree, refusing uncommitted changes unless allowed."""
    if not (path / "pyproject.toml").is_file() and not (path / "setup.py").is_file():
        raise UsageError(f"--source {path}: not a Python project (no pyproject.toml or setup.py)")
    git = ["git", "-c", f"safe.directory={path}", "-C", str(path)]
    top = subprocess.run([*git, "rev-parse", "--show-toplevel"], env=env, capture_output=True, text=True, check=False)
    if top.returncode != 0:
        raise UsageError(f"--source {path}: not inside a Git checkout (its revision must be recorded)")
    safe = ["-c", f"safe.directory={top.stdout.strip()}"]
    revision = _run(["git", *safe, "-C", str(path), "rev-parse", "HEAD"], env, f"git rev-parse in {path}").strip()
    status = _run(["git", *safe, "-C", str(path), "status", "--porcelain", "--", "."], env, f"git status in {path}")
    dirty = bool(status.strip())
    if dirty and not allow_dirty:
        raise UsageError(f"--source {path}: has uncommitted changes; commit them or pass --allow-dirty")
    return {"path": str(path), "revision": revision, "dirty": dirty}


def _rewrite_entry_points(runtime: Path) -> list[str]:
    """Point every script in bin/ that runs the venv's Python at the fixed mount instead."""
    rewritten = []
    ours = str(runtime / "bin").encode()
    for script in sorted((runtime / "bin").iterdir()):
        if script.is_symlink() or not script.is_file():
            continue
        data = script.read_bytes()
        first, _, rest = data.partition(b"\n")
        if first.startswith(b"#!" + ours + b"/python"):
            script.write_bytes(SHEBANG + rest)
            rewritten.append(script.name)
        elif first == b"#!/bin/sh" and rest.startswith(b"'''exec' ") and ours in rest.partition(b"\n")[0]:
            # pip's form for interpreter paths too long for a shebang line
            body = rest.split(b"\n' '''\n", 1)[-1]
            script.write_bytes(SHEBANG + body)
            rewritten.append(script.name)
        elif b"\0" not in data and str(runtime).encode() in data:  # activate scripts: name the mount
            script.write_bytes(data.replace(str(runtime).encode(), MOUNT.encode()))
    return rewritten


def _requirements(files: list[Path]) -> list[dict[str, str]]:
    """Each requirements file as build-info records it: its path and the sha256 of its bytes."""
    recorded = []
    for file in files:
        path = Path(os.path.abspath(file))
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"--requirement {file}: cannot be read ({exc.strerror})") from None
        recorded.append({"path": str(path), "sha256": hashlib.sha256(data).hexdigest()})
    return recorded


def _installed(report: dict[str, Any]) -> dict[str, str]:
    """The sha256 of each archive pip installed from, by normalized distribution name, from its
    installation report: the index's hash, or a local archive's own (no URL is recorded: an
    index's may carry a credential)."""
    hashes = {}
    for item in report.get("install") or []:
        name = str((item.get("metadata") or {}).get("name", "")).lower().replace("_", "-")
        download = item.get("download_info") or {}
        digest = (download.get("archive_info") or {}).get("hashes", {}).get("sha256")
        url = str(download.get("url", ""))
        if digest is None and "archive_info" in download and url.startswith("file://"):
            with open(unquote(url.removeprefix("file://")), "rb") as archive:
                digest = hashlib.file_digest(archive, "sha256").hexdigest()
        if name and digest:
            hashes[name] = str(digest)
    return hashes


def _install_runtime_venv(runtime: Path) -> None:
    """bin/runtime-venv (runtime_files/runtime_venv.py), on the runtime's own Python."""
    text = resources.files("sandboxer.runtime_files").joinpath("runtime_venv.py").read_bytes()
    script = runtime / "bin" / "runtime-venv"
    script.write_bytes(SHEBANG + text)
    script.chmod(0o755)


def build_runtime(
    *,
    output: Path,
    sources: list[Path],
    allow_dirty: bool,
    progress: Callable[[str], None],
    requirements: list[Path] | None = None,
    packages: list[str] | None = None,
) -> dict[str, Any]:
    """Build the runtime at `output` and return what build-info.json and the caller need."""
    output = Path(os.path.abspath(output))
    requirements, packages = requirements or [], packages or []
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UsageError(f"--output {output}: exists and is not an empty directory")
    if not sources and not requirements and not packages:
        raise UsageError("--source, --requirement, --package: at least one is needed")
    for index, spec in enumerate(packages, 1):
        if not spec.strip() or spec.startswith("-"):  # never repeated: an option may carry a credential
            raise UsageError(f"--package (#{index}): must be a requirement (NAME, NAME==VERSION, a wheel's path)")
    old_umask = os.umask(0o022)
    with tempfile.TemporaryDirectory(prefix="sandboxer-build-home-") as home:
        env = _environment(home)
        try:
            progress("checking sources")
            recorded = [source_revision(Path(os.path.abspath(s)), env, allow_dirty=allow_dirty) for s in sources]
            files = _requirements(requirements)
            progress(f"creating the venv: {SYSTEM_PYTHON} -m venv --copies")
            output.parent.mkdir(parents=True, exist_ok=True)
            _run([SYSTEM_PYTHON, "-m", "venv", "--copies", str(output)], env, "venv")
            python = str(output / "bin" / "python3")
            progress(
                f"installing {len(sources)} source(s), {len(files)} requirements file(s) and {len(packages)} "
                "package(s) with their dependencies (non-editable)"
            )
            report = os.path.join(home, "report.json")
            pip = [python, "-m", "pip", "install", "--no-input", "--no-cache-dir", "--report", report]
            wanted = [*(s["path"] for s in recorded), *(arg for f in files for arg in ("-r", f["path"])), *packages]
            _run([*pip, *wanted], env, "pip install")
            with open(report) as stream:
                hashes = _installed(json.load(stream))
            _install_runtime_venv(output)
            progress("rewriting console entry points to the fixed mount")
            rewritten = _rewrite_entry_points(output)
            progress("compiling bytecode")
            stripped = ["-s", str(output), "-p", MOUNT]
            mode = ["--invalidation-mode", "unchecked-hash"]  # pinned by digest: sources cannot change
            _run(
                [python, "-m", "compileall", "-q", "-f", "-j", "0", *mode, *stripped, str(output / "lib")],
                env,
                "compileall",
            )
            listing = _run([python, "-m", "pip", "list", "--format", "json"], env, "pip list")
            version = _run([python, "-c", "import platform; print(platform.python_version())"], env, "python").strip()
        except BaseException:
            _remove(output)
            raise
        finally:
            os.umask(old_umask)
    info = {
        "format": 1,
        "built_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": {"executable": SYSTEM_PYTHON, "version": version},
        "sources": recorded,
        "requirements": files,
        "packages": packages,
        "allow_dirty": allow_dirty,
        "distributions": sorted(
            (_distribution(d, hashes) for d in json.loads(listing)), key=lambda d: d["name"].lower()
        ),
        "entry_points_rewritten": rewritten,
        "mount": MOUNT,
    }
    (output / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    (output / "build-info.json").chmod(0o644)
    progress("computing the tree digest v1")
    info["sha256"] = tree_digest(str(output)).sha256
    info["path"] = str(output)
    return info


def _distribution(listed: dict[str, str], hashes: dict[str, str]) -> dict[str, str]:
    """One installed distribution: name, version, and the sha256 of the archive it came from."""
    found = {"name": listed["name"], "version": listed["version"]}
    digest = hashes.get(listed["name"].lower().replace("_", "-"))
    if digest:
        found["sha256"] = digest
    return found


def _remove(path: Path) -> None:

    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of scripts/build-runtime.py."""
    parser = argparse.ArgumentParser(prog="build-runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path, help="a new or empty directory")
    parser.add_argument("--source", action="append", default=[], type=Path, help="a Python project (repeatable)")
    parser.add_argument(
        "--requirement", action="append", default=[], type=Path, help="a pip requirements file (repeatable)"
    )
    parser.add_argument(
        "--package", action="append", default=[], help="a requirement: NAME, NAME==VERSION, a wheel (repeatable)"
    )
    parser.add_argument("--allow-dirty", action="store_true", help="accept sources with uncommitted changes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def progress(message: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - started:5.1f}s] {message}\n")
        sys.stderr.flush()

    try:
        info = build_runtime(
            output=args.output,
            sources=args.source,
            allow_dirty=args.allow_dirty,
            progress=progress,
            requirements=args.requirement,
            packages=args.package,
        )
    except SandboxerError as exc:
        emit_error(kind=exc.kind, message=str(exc), as_json=args.json)
        return exc.exit_status
    if args.json:
        sys.stdout.write(json.dumps({"path": info["path"], "sha256": info["sha256"]}) + "\n")
    else:
        sys.stdout.write(f"{info['path']}\n{info['sha256']}\n")
    return 0
