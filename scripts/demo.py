"""`make demo`: build the example runtime, prove it with the smoke, and summarize.

The runtime is built from examples/ (an agent harness and the connector it imports) into a
cache dir and rebuilt only when those sources or the system Python change: /var/cache/sandboxer
as root, $XDG_CACHE_HOME/sandboxer (or ~/.cache/sandboxer) otherwise, or $SANDBOXER_DEMO_CACHE.
The smoke then runs the real broker against it, and its JSON evidence is kept next to the runtime.

The demo never uses the broker's default directories (/etc/sandboxer and /var/lib/sandboxer as
root): its own commands name a config and a state dir in a temporary directory that it removes
at the end, and the smoke makes and removes its own. What it keeps, it names in its summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = (REPO / "examples" / "demo-connector", REPO / "examples" / "demo-harness")


def cache_dir() -> Path:
    """Where the demo keeps its runtime and evidence; reachable by the sandbox uid as root."""
    if os.environ.get("SANDBOXER_DEMO_CACHE"):
        return Path(os.environ["SANDBOXER_DEMO_CACHE"]).resolve()
    if os.geteuid() == 0:
        return Path("/var/cache/sandboxer/demo")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandboxer" / "demo"


def sources_fingerprint() -> str:
    """A hash of every source file and of the system Python: what a rebuild depends on."""
    digest = hashlib.sha256(Path("/usr/bin/python3").resolve().name.encode())
    digest.update(subprocess.run(["/usr/bin/python3", "-V"], capture_output=True, check=True).stdout)
    for source in SOURCES:
        for path in sorted(source.rglob("*")):
            generated = {"__pycache__", "build"} & set(path.parts) or any(p.endswith(".egg-info") for p in path.parts)
            if path.is_file() and not generated:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@contextmanager
def broker_dirs() -> Iterator[tuple[Path, Path]]:
    """The config and state dir of the demo's own sandboxer commands: new, owner-only, in a
    temporary directory removed when the block ends — never the system's (/etc/sandboxer,
    /var/lib/sandboxer) nor the account's default ones."""
    with tempfile.TemporaryDirectory(prefix="sandboxer-demo-") as tmp:
        config, state = Path(tmp) / "config", Path(tmp) / "state"
        config.mkdir(mode=0o700)
        state.mkdir(mode=0o700)
        yield config, state


def sandboxer_argv(dirs: tuple[Path, Path], *args: str) -> list[str]:
    """A sandboxer command line on the demo's own directories."""
    config, state = dirs
    return [sys.executable, "-m", "sandboxer", "--config-dir", str(config), "--state-dir", str(state), *args]


def runtime_digest(runtime: Path, dirs: tuple[Path, Path]) -> str:
    argv = sandboxer_argv(dirs, "runtime", "digest", str(runtime))
    # In-process: the command would otherwise start a service for the demo's state dir on
    # demand, which would outlive the directory until its idle exit.
    env = {**os.environ, "SANDBOXER_NO_SERVICE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout.strip()


def ensure_runtime(cache: Path, dirs: tuple[Path, Path]) -> tuple[Path, str, bool]:
    """The cached runtime, rebuilt when its sources changed; returns (path, digest, rebuilt)."""
    runtime, stamp = cache / "runtime", cache / "runtime.stamp"
    fingerprint = sources_fingerprint()
    if stamp.exists() and runtime.is_dir():
        recorded = json.loads(stamp.read_text())
        if recorded.get("fingerprint") == fingerprint and runtime_digest(runtime, dirs) == recorded.get("sha256"):
            return runtime, recorded["sha256"], False
    shutil.rmtree(runtime, ignore_errors=True)
    print(f"building the example runtime into {runtime} (first run, or its sources changed)", flush=True)
    argv = [sys.executable, str(REPO / "scripts" / "build-runtime.py"), "--output", str(runtime), "--json"]
    argv += [arg for source in SOURCES for arg in ("--source", str(source))]
    argv.append("--allow-dirty")  # a working tree may be mid-edit; build-info.json records it
    built = json.loads(subprocess.run(argv, capture_output=False, stdout=subprocess.PIPE, text=True, check=True).stdout)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "sha256": built["sha256"]}) + "\n")
    return runtime, built["sha256"], True


def main() -> int:
    """Build (if needed), smoke, summarize."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    for directory in [cache, *cache.parents][:3]:
        if os.geteuid() == 0 and str(directory).startswith("/var/cache/sandboxer"):
            directory.chmod(0o755)  # the sandbox's own uid must reach the runtime
    with broker_dirs() as dirs:
        runtime, sha256, rebuilt = ensure_runtime(cache, dirs)
        where = dirs[0].parent
    evidence_path = cache / "smoke-evidence.json"
    smoke = [sys.executable, str(REPO / "scripts" / "smoke-bwrap-runtime.py"), "--json"]
    smoke += ["--runtime-path", str(runtime), "--runtime-sha256", sha256]
    # Its evidence on stdout; each check, once, as it ends, on stderr (this terminal).
    proc = subprocess.run(smoke, stdout=subprocess.PIPE, text=True, check=False)
    evidence_path.write_text(proc.stdout)
    evidence = json.loads(proc.stdout)
    info = json.loads((runtime / "build-info.json").read_text())
    print()
    print(f"runtime     {runtime} ({'rebuilt' if rebuilt else 'cached'}), Python {info['python']['version']}")
    print(f"tree digest {sha256}")
    dists = ", ".join(f"{d['name']} {d['version']}" for d in info["distributions"])
    print(f"contains    {dists}")
    print(f"evidence    {evidence_path}")
    print(f"broker      config and state dirs in {where}: removed (the smoke's own too)")
    ran = f"{len(evidence['checks'])} checks ran, each named above"
    failed = ", ".join(evidence["failed"]) or "no check ran"
    print(f"result      {'every check passed' if evidence['passed'] else 'FAILED: ' + failed} ({ran})")
    print(
        "next        `make tour` walks through approval, create, exec, inspect and teardown, then a lease"
        " manifest, dispatch-tool and a runtime bootstrap, step by step"
    )
    return 0 if evidence["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
