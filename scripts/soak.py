#!/usr/bin/env python3
"""Soak test: many sequential create -> exec -> teardown cycles through the real CLI, watching
the host for anything that grows.

    .venv/bin/python scripts/soak.py [--cycles N] [--backend bwrap|docker] [--every N]

Needs root (a root broker: loop-mounted workspaces, cgroups; Docker needs root anyway). A
throwaway broker is made in a temporary directory (runtime, repository, approved profile).
Every `--every` cycles (and before the first and after the last) it samples:

- host: MemAvailable, allocated file handles, mount table lines, attached loop devices,
  processes, cgroup directories below sandboxer/ in the memory and pids hierarchies;
- broker side: this driver's own descriptors, and (Docker) the daemon's and containerd's;
- this broker's own: sandbox directories, mounts and loop devices below its state dir, cgroup
  directories of its sandboxes, processes carrying its state dir or a sandbox id of its own,
  (Docker) containers labelled with its state dir.

It prints one JSON document and exits 1 when a cycle fails, a teardown reports residue, or a
sample grows past its tolerance (docs/soak.md states them and why). Growth is taken between the
first sample and the smaller of the last two (the larger, for MemAvailable), so that one spike
of other work on a shared host is not taken for a leak, while a leak — which only grows — is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "sandboxer"]

# metric: (largest allowed growth, why). Negative growth (shrinking) never fails.
TOLERANCE: dict[str, tuple[int, str]] = {
    "own_sandbox_dirs": (0, "every cycle's sandbox directory is gone after its teardown"),
    "own_mounts": (0, "no mount below the broker's state dir outlives its sandbox"),
    "own_loop_devices": (0, "no loop device backed by a file below the state dir outlives its sandbox"),
    "own_cgroup_dirs": (0, "no cgroup directory of a torn-down sandbox is left"),
    "own_processes": (0, "no process carries the state dir or a torn-down sandbox's id"),
    "own_containers": (0, "no container labelled with this broker's state dir is left"),
    "driver_fds": (0, "the driver opens nothing it keeps"),
    "host_mounts": (24, "the host is shared: other brokers' sandboxes come and go"),
    "host_loop_devices": (8, "as above: other root brokers' workspaces"),
    "host_cgroup_dirs": (16, "as above: other sandboxes' cgroups"),
    "host_processes": (64, "as above: other engineers' test runs"),
    "host_file_handles": (4096, "as above: file handles of every process on the host"),
    "mem_available_drop_mib": (512, "page cache and other work move MemAvailable by hundreds of MiB"),
    "dockerd_fds": (64, "the daemon's own descriptors (connections come and go)"),
    "containerd_fds": (64, "as above"),
}


def run(argv: list[str], **kwargs: Any) -> str:
    done = subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    return done.stdout


class Broker:
    """A throwaway broker with an approved profile for the chosen backend."""

    def __init__(self, root: Path, backend: str) -> None:
        self.root = root
        self.config, self.state = root / "config", root / "state"
        runtime, repo = root / "runtime", root / "repo"
        run(["/usr/bin/python3", "-m", "venv", "--copies", "--without-pip", str(runtime)])
        git = ["git", "-c", "user.name=soak", "-c", "user.email=soak@localhost", "-c", "init.defaultBranch=main"]
        run([*git, "init", "-q", str(repo)])
        (repo / "README.md").write_text("soak\n")
        run([*git, "-C", str(repo), "add", "README.md"])
        run([*git, "-C", str(repo), "commit", "-qm", "soak"])
        (self.config / "extensions").mkdir(parents=True)
        (self.config / "profiles").mkdir()
        self.config.chmod(0o700)
        digest = run(self.cli("runtime", "digest", str(runtime))).strip()
        extension = f"ext.{backend}"
        image = ""
        if backend == "docker":
            built = run([sys.executable, str(REPO / "scripts" / "build-base-image")]).strip()
            image = f'  image: "{built}"\n'
        (self.config / "extensions" / f"{extension}.yaml").write_text(
            f"extension: {extension}\nconfig:\n{image}  runtime:\n    path: {runtime}\n    sha256: {digest}\n"
        )
        (self.config / "profiles" / "soak.yaml").write_text(
            f"profile: soak\nextension: {extension}\nworkspace:\n  repository: {repo}\n  ref: main\n"
            "network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n"
        )
        run(self.cli("ext", "approve", extension))
        run(self.cli("ext", "approve", "soak"))
        self.ids: set[str] = set()

    def cli(self, *args: str) -> list[str]:
        return [*CLI, "--config-dir", str(self.config), "--state-dir", str(self.state), *args]

    def cycle(self) -> list[str]:
        """One create -> exec -> teardown; the problems it had (empty when clean)."""
        created = subprocess.run(self.cli("create", "--profile", "soak"), capture_output=True, text=True, check=False)
        if created.returncode != 0:
            return [f"create: status {created.returncode}: {created.stderr.strip()}"]
        sandbox_id = created.stdout.strip()
        self.ids.add(sandbox_id)
        problems = []
        executed = subprocess.run(
            self.cli("exec", sandbox_id, "--", "/bin/sh", "-c", "echo soak"),
            capture_output=True,
            text=True,
            check=False,
        )
        if (executed.returncode, executed.stdout) != (0, "soak\n"):
            problems.append(f"exec: status {executed.returncode}: {executed.stderr.strip()}")
        torn = subprocess.run(self.cli("teardown", sandbox_id, "--json"), capture_output=True, text=True, check=False)
        if torn.returncode != 0:
            problems.append(f"teardown: status {torn.returncode}: {torn.stdout.strip()} {torn.stderr.strip()}")
        return problems


# ------------------------------------------------------------------------------------ sampling


def _pids() -> list[str]:
    return [entry for entry in os.listdir("/proc") if entry.isdigit()]


def _read(path: str, mode: str = "r") -> Any:
    try:
        with open(path, mode) as stream:
            return stream.read()
    except OSError:
        return b"" if "b" in mode else ""


def _fd_count(pid: int | str) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _pid_of(name: str) -> int | None:
    for pid in _pids():
        if _read(f"/proc/{pid}/comm").strip() == name:
            return int(pid)
    return None


def _mount_points() -> list[str]:
    return [line.split()[4] for line in _read("/proc/self/mountinfo").splitlines()]


def _loop_backing_files() -> list[str]:
    files = []
    for device in Path("/sys/block").glob("loop*"):
        backing = _read(str(device / "loop" / "backing_file")).strip()
        if backing:
            files.append(backing)
    return files


def _cgroup_dirs() -> list[str]:
    dirs = []
    for controller in ("memory", "pids"):
        base = Path("/sys/fs/cgroup") / controller / "sandboxer"
        if base.is_dir():
            dirs += [str(p) for p in base.iterdir() if p.is_dir()]
    base = Path("/sys/fs/cgroup/sandboxer")
    if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists() and base.is_dir():
        dirs += [str(p) for p in base.iterdir() if p.is_dir()]
    return dirs


def _containers(state: Path) -> int:
    done = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=io.sandboxer.state-dir={state}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return len(done.stdout.split())


def sample(broker: Broker, backend: str, cycle: int) -> dict[str, int]:
    """Everything watched, now."""
    state = str(broker.state)
    meminfo = dict(line.split(":", 1) for line in _read("/proc/meminfo").splitlines() if ":" in line)
    mounts = _mount_points()
    loops = _loop_backing_files()
    groups = _cgroup_dirs()
    markers = [state.encode(), *(sandbox_id.encode() for sandbox_id in broker.ids)]
    processes = _pids()
    own_processes = 0
    for pid in processes:
        if int(pid) == os.getpid():
            continue
        seen = _read(f"/proc/{pid}/cmdline", "rb") + b"\0" + _read(f"/proc/{pid}/environ", "rb")
        if any(marker in seen for marker in markers):
            own_processes += 1
    registry = broker.state / "sandboxes"
    values = {
        "cycle": cycle,
        "time": round(time.time(), 1),
        "mem_available_mib": int(meminfo["MemAvailable"].split()[0]) // 1024,
        "host_file_handles": int(_read("/proc/sys/fs/file-nr").split()[0]),
        "host_mounts": len(mounts),
        "host_loop_devices": len(loops),
        "host_processes": len(processes),
        "host_cgroup_dirs": len(groups),
        "driver_fds": _fd_count("self"),
        "own_sandbox_dirs": len([p for p in registry.iterdir() if not p.name.startswith(".")])
        if registry.is_dir()
        else 0,
        "own_mounts": len([m for m in mounts if m == state or m.startswith(state + "/")]),
        "own_loop_devices": len([f for f in loops if f.startswith(state + "/")]),
        "own_cgroup_dirs": len([g for g in groups if os.path.basename(g) in broker.ids]),
        "own_processes": own_processes,
    }
    if backend == "docker":
        values["own_containers"] = _containers(broker.state)
        for daemon in ("dockerd", "containerd"):
            pid = _pid_of(daemon)
            values[f"{daemon}_fds"] = _fd_count(pid) if pid else 0
    return values


def growth(samples: list[dict[str, int]]) -> dict[str, int]:
    """Per metric: how much it grew from the first sample to the smaller of the last two."""
    first, last = samples[0], samples[-2:]
    grown = {}
    for key in TOLERANCE:
        if key == "mem_available_drop_mib":
            grown[key] = first["mem_available_mib"] - max(s["mem_available_mib"] for s in last)
        elif key in first:
            grown[key] = min(s[key] for s in last) - first[key]
    return grown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--backend", choices=("bwrap", "docker"), default="bwrap")
    parser.add_argument("--every", type=int, default=50, help="sample every N cycles (default 50)")
    args = parser.parse_args()
    # The cycles in-process unless told otherwise (SANDBOXER_NO_SERVICE=0): a root command would
    # start a service for the soak's state dir, which is one process the leak checks would count.
    os.environ.setdefault("SANDBOXER_NO_SERVICE", "1")
    if os.geteuid() != 0:
        print(json.dumps({"error": "the soak runs a root broker: run it as root"}))
        return 2
    failures: list[str] = []
    durations: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sandboxer-soak-", dir="/tmp") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        broker = Broker(root, args.backend)
        first = broker.cycle()  # warm caches (parse cache, digest cache, image) before the baseline
        failures += [f"cycle 0: {problem}" for problem in first]
        samples = [sample(broker, args.backend, 0)]
        started = time.monotonic()
        for cycle in range(1, args.cycles + 1):
            began = time.monotonic()
            problems = broker.cycle()
            durations.append(time.monotonic() - began)
            failures += [f"cycle {cycle}: {problem}" for problem in problems]
            if len(failures) > 20:
                failures.append("stopped after 20 failures")
                break
            if cycle % args.every == 0 or cycle == args.cycles:
                samples.append(sample(broker, args.backend, cycle))
        elapsed = time.monotonic() - started
        subprocess.run(broker.cli("gc"), capture_output=True, check=False)
    if len(samples) < 2:
        samples.append(samples[0])
    grown = growth(samples)
    for key, value in grown.items():
        limit, _why = TOLERANCE[key]
        if value > limit:
            failures.append(f"{key} grew by {value} (tolerance {limit})")
    for key in ("own_sandbox_dirs", "own_mounts", "own_loop_devices", "own_cgroup_dirs", "own_processes"):
        if any(s[key] for s in samples):
            failures.append(f"{key}: non-zero between cycles ({[s[key] for s in samples]})")
    report = {
        "command": " ".join(["scripts/soak.py", *sys.argv[1:]]),
        "backend": args.backend,
        "cycles": len(durations),
        "seconds": round(elapsed, 1),
        "cycle_ms": {
            "median": round(statistics.median(durations) * 1000, 1) if durations else None,
            "p95": round(sorted(durations)[int(len(durations) * 0.95) - 1] * 1000, 1) if durations else None,
            "max": round(max(durations) * 1000, 1) if durations else None,
        },
        "growth": grown,
        "tolerance": {key: limit for key, (limit, _why) in TOLERANCE.items() if key in grown},
        "samples": samples,
        "failures": failures,
        "ok": not failures,
    }
    print(json.dumps(report, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
