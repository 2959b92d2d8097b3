"""`make demo`: build the example runtime, prove it with the smoke, and summarize.

The runtime is built from examples/ (an agent harness and the connector it imports) into a
cache dir and rebuilt only when those sources or the system Python change: /var/cache/sandboxer
as root, $XDG_CACHE_HOME/sandboxer (or ~/.cache/sandboxer) otherwise. The smoke then runs the
real broker against it, and its JSON evidence is kept next to the runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = (REPO / "examples" / "demo-connector", REPO / "examples" / "demo-harness")


def cache_dir() -> Path:
    """Where the demo keeps its runtime and evidence; reachable by the sandbox uid as root."""
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


def runtime_digest(runtime: Path) -> str:
    argv = [sys.executable, "-m", "sandboxer", "runtime", "digest", str(runtime)]
    # In-process: as root, the command would start the system service on demand for one digest.
    env = {**os.environ, "SANDBOXER_NO_SERVICE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout.strip()


def ensure_runtime(cache: Path) -> tuple[Path, str, bool]:
    """The cached runtime, rebuilt when its sources changed; returns (path, digest, rebuilt)."""
    runtime, stamp = cache / "runtime", cache / "runtime.stamp"
    fingerprint = sources_fingerprint()
    if stamp.exists() and runtime.is_dir():
        recorded = json.loads(stamp.read_text())
        if recorded.get("fingerprint") == fingerprint and runtime_digest(runtime) == recorded.get("sha256"):
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
    runtime, sha256, rebuilt = ensure_runtime(cache)
    evidence_path = cache / "smoke-evidence.json"
    smoke = [sys.executable, str(REPO / "scripts" / "smoke-bwrap-runtime.py"), "--json"]
    smoke += ["--runtime-path", str(runtime), "--runtime-sha256", sha256]
    proc = subprocess.run(smoke, stdout=subprocess.PIPE, text=True, check=False)
    evidence_path.write_text(proc.stdout)
    evidence = json.loads(proc.stdout)
    info = json.loads((runtime / "build-info.json").read_text())
    print()
    print(f"runtime     {runtime} ({'rebuilt' if rebuilt else 'cached'}), Python {info['python']['version']}")
    print(f"tree digest {sha256}")
    dists = ", ".join(f"{d['name']} {d['version']}" for d in info["distributions"])
    print(f"contains    {dists}")
    print("smoke       " + "  ".join(f"{'ok' if c['passed'] else 'FAILED'}:{c['name']}" for c in evidence["checks"]))
    print(f"evidence    {evidence_path}")
    print(f"result      {'every check passed' if evidence['passed'] else 'FAILED: ' + ', '.join(evidence['failed'])}")
    print(
        "next        `make tour` walks through approval, create, exec, inspect and teardown, then a lease"
        " manifest, dispatch-tool and a runtime bootstrap, step by step"
    )
    return 0 if evidence["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
