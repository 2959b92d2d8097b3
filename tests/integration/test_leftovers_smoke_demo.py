"""`make demo` (scripts/demo.py) and the smoke it runs, for real: each check printed once, and
the demo's broker state kept out of the default directories (/var/lib/sandboxer as root).

The demo runs twice on a cache dir of its own (SANDBOXER_DEMO_CACHE): the first run builds the
example runtime, the second finds it cached and digests it through `sandboxer runtime digest`
(the step that used the default state dir). SANDBOXER_CONFIG and SANDBOXER_STATE point at
directories that must never appear: any sandboxer command of the demo left to its defaults
would make them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

REPO = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, str(REPO / "scripts" / "demo.py")]
SMOKE = [sys.executable, str(REPO / "scripts" / "smoke-bwrap-runtime.py")]
CHECKS = [
    "runtime-pin", "create", "imports", "entry-points-help", "runtime-read-only", "private-state",
    "sources-absent", "git-clean", "loopback-only", "teardown-clean",
]  # fmt: skip
CHECK_LINE = re.compile(r"^(?:smoke:\s*)?(PASS|FAIL)\s+([a-z-]+)(?::\s.*)?$")  # any spacing


@dataclass
class DemoRun:
    status: int
    stdout: str
    stderr: str


@dataclass
class Demo:
    root: Path
    cache: Path
    poison: Path
    home: Path
    runs: list[DemoRun]


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    root = Path(tempfile.mkdtemp(prefix="sbx-leftovers-demo-", dir="/tmp"))
    root.chmod(0o755)  # as root, the sandbox's uid must reach the runtime built here
    cache, poison, home = root / "cache", root / "poison", root / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "SANDBOXER_DEMO_CACHE": str(cache),
        "SANDBOXER_CONFIG": str(poison / "config"),
        "SANDBOXER_STATE": str(poison / "state"),
    }
    runs = []
    for _ in range(2):
        proc = subprocess.run(DEMO, env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
        runs.append(DemoRun(proc.returncode, proc.stdout, proc.stderr))
    yield Demo(root, cache, poison, home, runs)
    shutil.rmtree(root, ignore_errors=True)


def _summary(run: DemoRun) -> dict[str, str]:
    """The demo's summary lines, by their first word."""
    lines = [line.split(None, 1) for line in run.stdout.splitlines() if line and not line.startswith(" ")]
    return {words[0]: words[1] for words in lines if len(words) == 2}


def _check_lines(text: str) -> list[tuple[str, str]]:
    """(PASS or FAIL, name) of every check line in `text`."""
    return [(m.group(1), m.group(2)) for line in text.splitlines() if (m := CHECK_LINE.match(line))]


def _evidence(demo: Demo) -> dict[str, object]:
    evidence: dict[str, object] = json.loads((demo.cache / "smoke-evidence.json").read_text())
    return evidence


def test_demo_builds_then_reuses_its_runtime_and_exits_as_its_smoke(demo: Demo) -> None:
    first, second = demo.runs
    assert "result" in _summary(first), first.stderr
    assert _summary(first)["runtime"].startswith(f"{demo.cache / 'runtime'} (rebuilt)")
    assert _summary(second)["runtime"].startswith(f"{demo.cache / 'runtime'} (cached)"), second.stderr
    evidence = _evidence(demo)
    assert _summary(second)["evidence"] == str(demo.cache / "smoke-evidence.json")
    assert second.status == (0 if evidence["passed"] else 1), second.stderr


def test_demo_prints_each_check_once(demo: Demo) -> None:
    evidence = _evidence(demo)
    checks = evidence["checks"]
    assert isinstance(checks, list)
    names = [check["name"] for check in checks]
    assert names == CHECKS[: len(names)]
    assert len(names) >= 2  # runtime-pin and create run whatever happens
    for run in demo.runs:
        everything = run.stdout + run.stderr
        assert [name for _, name in _check_lines(everything)] == names, everything
        # Nor does the summary list them again (it did, as "ok:runtime-pin  ok:create ...").
        assert not re.search(r"(?:ok|FAILED):[a-z]", everything), everything
    result = _summary(demo.runs[1])["result"]
    assert result.endswith(f"({len(names)} checks ran, each named above)")
    failed = evidence["failed"]
    assert isinstance(failed, list)
    assert result.startswith(f"FAILED: {', '.join(failed)} (" if failed else "every check passed (")


def test_demo_keeps_out_of_the_default_directories(demo: Demo) -> None:
    assert all("result" in _summary(run) for run in demo.runs)
    # SANDBOXER_CONFIG and SANDBOXER_STATE would have been every default-dir command's dirs.
    assert not demo.poison.exists()
    # Nor the account's own defaults (an unprivileged user's, below this HOME).
    assert list(demo.home.iterdir()) == []
    # Nor root's real state dir: the digest cache of this (new) runtime path was never written.
    runtime = str(demo.cache / "runtime")
    assert not Path(
        "/var/lib/sandboxer/digest-cache", xxhash.xxh3_64_hexdigest(os.fsencode(runtime)) + ".cache"
    ).exists()
    # Its own dirs are named, and gone.
    for run in demo.runs:
        broker = _summary(run)["broker"]
        assert broker.startswith("config and state dirs in ")
        where = Path(broker.removeprefix("config and state dirs in ").split(":")[0])
        assert where.is_absolute()
        assert not where.exists()
        assert not str(where).startswith(("/var/lib/sandboxer", "/etc/sandboxer"))


@pytest.mark.parametrize("as_json", [False, True])
def test_smoke_prints_each_check_once(demo: Demo, as_json: bool) -> None:
    runtime = demo.cache / "runtime"
    sha256 = json.loads((demo.cache / "runtime.stamp").read_text())["sha256"]
    argv = [*SMOKE, "--runtime-path", str(runtime), "--runtime-sha256", sha256, *(["--json"] if as_json else [])]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(demo.home), "LANG": "C.UTF-8", "SANDBOXER_NO_SERVICE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    progress, other = (proc.stderr, proc.stdout) if as_json else (proc.stdout, proc.stderr)
    seen = _check_lines(progress)
    assert _check_lines(other) == []
    names = [name for _, name in seen]
    assert names == CHECKS[: len(names)]
    assert len(names) >= 2, proc.stderr
    assert len(set(names)) == len(names)
    if as_json:
        evidence = json.loads(proc.stdout)
        assert [(c["name"], c["passed"]) for c in evidence["checks"]] == [(n, s == "PASS") for s, n in seen]
    failed = [name for status, name in seen if status == "FAIL"]
    assert proc.returncode == (1 if failed else 0)
    assert proc.stderr.endswith(f"smoke: failed: {', '.join(failed)}\n" if failed else "")
