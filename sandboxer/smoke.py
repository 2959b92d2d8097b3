"""Proving a runtime: an isolated broker, the real CLI, and one named check per promise.

    python scripts/smoke-bwrap-runtime.py --runtime-path DIR --runtime-sha256 HEX [--json]

Makes an owner config and a state dir in a temporary directory, a throwaway Git repository as
the workspace source, approves the runtime pin and a profile, creates a sandbox, and checks,
each by name: the pin, that every installed distribution imports, that every console entry
point's --help exits 0, that the runtime is read-only, that private state is 0700, outside
/workspace and survives between execs, that the runtime's source checkouts are invisible, that
the Git tree stays clean, that only `lo` exists, and that teardown leaves nothing. Each check is
printed once, as it ends (`PASS  name`, or `FAIL  name: why`), on stdout; with --json on stderr,
stdout then being the evidence as one JSON object. Exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROFILE = "smoke"

# Run inside the sandbox by the runtime's own Python: every distribution installed in the
# runtime, and every top-level module or package its RECORD says it installed, imported.
# (RECORD, not top_level.txt: Debian's setuptools wheel lists a "debian" it does not ship.)
# Each module is imported by an interpreter of its own: in one, what one module imports first
# changes whether another imports (pip's distutils before setuptools' is an AssertionError), and
# the order would be the runtime directory's listing order (a name order on its erofs image).
_IMPORTS = r"""
import importlib.metadata as md, json, subprocess, sys
IMPORT = "import importlib, sys; importlib.import_module(sys.argv[1])"
results = {}
for dist in md.distributions():
    if not str(dist.locate_file("")).startswith(sys.prefix):
        continue
    names = set()
    for path in dist.files or []:
        parts = path.parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".egg-info", ".data")):
            continue
        if len(parts) == 1 and parts[0].endswith(".py"):
            names.add(parts[0][:-3])
        elif len(parts) == 2 and parts[1] == "__init__.py":
            names.add(parts[0])
    for name in sorted(names):
        done = subprocess.run([sys.executable, "-I", "-c", IMPORT, name], capture_output=True, text=True)
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        results[f"{dist.metadata['Name']}:{name}"] = "ok" if done.returncode == 0 else last.partition(":")[0]
print(json.dumps(results))
"""
_ENTRY_POINTS = r"""
import importlib.metadata as md, json, sys
names = sorted({ep.name for ep in md.entry_points(group="console_scripts")})
print(json.dumps(names))
"""
_STATE = r"""
set -e
for v in HOME XDG_CONFIG_HOME XDG_CACHE_HOME XDG_STATE_HOME TMPDIR; do
  eval d=\$$v
  case "$d" in /workspace|/workspace/*) echo "$v inside the workspace"; exit 1;; esac
  echo "$v $d $(stat -c '%a %u' "$d")"
done
"""


class Smoke:
    """One smoke run: a private broker and the evidence it gathers."""

    def __init__(self, root: Path, runtime: str, sha256: str, progress: Callable[[dict[str, Any]], None]) -> None:
        self.root = root
        self.config, self.state, self.repo = root / "config", root / "state", root / "repo"
        self.runtime, self.sha256 = runtime, sha256
        self.progress = progress
        self.checks: list[dict[str, Any]] = []
        self.sandbox_id: str | None = None

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The real CLI of this broker."""
        argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(self.config), "--state-dir", str(self.state)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.root), "LANG": "C.UTF-8"}
        return subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run ARGV in the sandbox."""
        return self.cli("exec", str(self.sandbox_id), "--", *argv)

    def check(self, name: str, passed: bool, detail: Any) -> bool:
        """Record one named check and report it, once, as it ends."""
        self.checks.append({"name": name, "passed": passed, "detail": detail})
        self.progress(self.checks[-1])
        return passed

    def prepare(self) -> None:
        """Owner config, state dir and a one-commit repository, all inside the temporary root."""
        (self.config / "extensions").mkdir(parents=True)
        (self.config / "profiles").mkdir()
        self.config.chmod(0o700)
        git = ["git", "-c", "user.name=smoke", "-c", "user.email=smoke@localhost", "-c", "init.defaultBranch=main"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.root)}
        subprocess.run([*git, "init", "-q", str(self.repo)], check=True, env=env)
        (self.repo / "README.md").write_text("smoke workspace\n")
        subprocess.run([*git, "-C", str(self.repo), "add", "README.md"], check=True, env=env)
        subprocess.run([*git, "-C", str(self.repo), "commit", "-qm", "smoke"], check=True, env=env)
        (self.config / "extensions" / "ext.bwrap.yaml").write_text(
            f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {self.runtime}\n    sha256: {self.sha256}\n"
        )
        (self.config / "profiles" / f"{PROFILE}.yaml").write_text(
            f"profile: {PROFILE}\nextension: ext.bwrap\nworkspace:\n  repository: {self.repo}\n  ref: main\n"
            "network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n"
        )

    def run(self) -> None:
        """Every check in order; a sandbox is needed for most of them."""
        self.prepare()
        pin = self.cli("ext", "approve", "ext.bwrap")
        if not self.check("runtime-pin", pin.returncode == 0, pin.stderr.strip() or "runtime matches its pin"):
            return
        approved = self.cli("ext", "approve", PROFILE)
        created = self.cli("create", "--profile", PROFILE, "--json") if approved.returncode == 0 else approved
        if not self.check("create", created.returncode == 0, created.stderr.strip() or "sandbox created"):
            return
        self.sandbox_id = json.loads(created.stdout)["id"]
        try:
            self.inside_checks()
        finally:
            self.teardown_check()

    def inside_checks(self) -> None:
        """The checks made through exec."""
        imports = self.exec("python3", "-I", "-c", _IMPORTS)
        results = json.loads(imports.stdout) if imports.returncode == 0 else {"error": imports.stderr.strip()}
        self.check("imports", bool(results) and all(v == "ok" for v in results.values()), results)

        listed = self.exec("python3", "-I", "-c", _ENTRY_POINTS)
        names = json.loads(listed.stdout) if listed.returncode == 0 else []
        helps = {name: self.exec(name, "--help").returncode for name in names}
        self.check("entry-points-help", bool(helps) and not any(helps.values()), helps)

        write = self.exec("touch", "/opt/sandboxer/runtime/.smoke-write")
        self.check(
            "runtime-read-only",
            write.returncode != 0 and "Read-only file system" in write.stderr,
            write.stderr.strip().splitlines()[-1:] or "write succeeded",
        )

        state = self.exec("sh", "-c", _STATE)
        modes_ok = state.returncode == 0 and all(
            line.split()[2:] == ["700", "1000"] for line in state.stdout.splitlines() if line
        )
        first = self.exec("sh", "-c", "echo persisted > $HOME/smoke-note")
        second = self.exec("sh", "-c", "cat $HOME/smoke-note")
        self.check(
            "private-state",
            modes_ok and first.returncode == 0 and second.stdout.strip() == "persisted",
            {"dirs": state.stdout.splitlines(), "second_exec_read": second.stdout.strip()},
        )

        sources = self._source_paths()
        seen = {path: self.exec("test", "-e", path).returncode == 0 for path in [*sources, self.runtime]}
        self.check(
            "sources-absent", not any(seen.values()), {path: "visible" if v else "absent" for path, v in seen.items()}
        )

        status = self.exec("git", "-C", "/workspace", "status", "--porcelain")
        self.check(
            "git-clean",
            status.returncode == 0 and status.stdout == "",
            status.stdout or status.stderr.strip() or "clean",
        )

        interfaces = self.exec("sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        names_seen = interfaces.stdout.split()
        self.check("loopback-only", interfaces.returncode == 0 and names_seen == ["lo"], names_seen)

    def _source_paths(self) -> list[str]:
        try:
            info = json.loads((Path(self.runtime) / "build-info.json").read_text())
            return [str(source["path"]) for source in info.get("sources", [])]
        except (OSError, ValueError, TypeError, KeyError):
            return []

    def teardown_check(self) -> None:
        """Teardown's receipt has no residue and nothing of the sandbox remains on the host."""
        sandbox_id = str(self.sandbox_id)
        receipt = self.cli("teardown", sandbox_id, "--json")
        residue = (
            json.loads(receipt.stdout).get("residue", ["unreadable receipt"]) if receipt.stdout else ["no receipt"]
        )
        left_dir = (self.state / "sandboxes" / sandbox_id).exists()
        left_procs = [pid for pid in os.listdir("/proc") if pid.isdigit() and self._mentions(pid, sandbox_id)]
        self.check(
            "teardown-clean",
            receipt.returncode == 0 and not residue and not left_dir and not left_procs,
            {"residue": residue, "directory_left": left_dir, "processes_left": left_procs},
        )

    @staticmethod
    def _mentions(pid: str, text: str) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as stream:
                return text.encode() in stream.read()
        except OSError:
            return False


def smoke(runtime: str, sha256: str, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run the smoke and return its evidence; `progress` gets each check as it ends."""
    with tempfile.TemporaryDirectory(prefix="sandboxer-smoke-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # as root, the sandbox's uid must reach the state dir
        run = Smoke(root, runtime, sha256, progress)
        run.run()
    failed = [c["name"] for c in run.checks if not c["passed"]]
    return {
        "runtime_path": runtime,
        "runtime_sha256": sha256,
        "passed": not failed and len(run.checks) > 0,
        "failed": failed,
        "checks": run.checks,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of scripts/smoke-bwrap-runtime.py."""
    parser = argparse.ArgumentParser(prog="smoke-bwrap-runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-path", required=True)
    parser.add_argument("--runtime-sha256", required=True)
    parser.add_argument("--json", action="store_true", help="print the evidence as one JSON object")
    args = parser.parse_args(argv)

    # Each check is printed once, as it ends: on stdout, or with --json (stdout is then the
    # evidence) on stderr. A failed one says why in one line; the evidence has the whole detail.
    def progress(check: dict[str, Any]) -> None:
        line = f"{'PASS' if check['passed'] else 'FAIL'}  {check['name']}"
        if not check["passed"]:
            detail = check["detail"]
            line += ": " + " ".join((detail if isinstance(detail, str) else json.dumps(detail)).split())
        stream = sys.stderr if args.json else sys.stdout
        stream.write(f"smoke: {line}\n" if args.json else f"{line}\n")
        stream.flush()

    evidence = smoke(args.runtime_path, args.runtime_sha256, progress)
    if args.json:
        sys.stdout.write(json.dumps(evidence, indent=2) + "\n")
    if not evidence["passed"]:
        sys.stderr.write(f"smoke: failed: {', '.join(evidence['failed']) or 'no check ran'}\n")
        return 1
    return 0
