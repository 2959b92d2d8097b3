"""scripts/build-runtime.py and scripts/smoke-bwrap-runtime.py, run for real on the examples."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import _cleanup, make_broker
from tests.samples import tiny_wheel

REPO = Path(__file__).resolve().parents[2]
BUILD = [sys.executable, str(REPO / "scripts" / "build-runtime.py")]
SMOKE = [sys.executable, str(REPO / "scripts" / "smoke-bwrap-runtime.py")]
MOUNT_SHEBANG = b"#!/opt/sandboxer/runtime/bin/python3\n"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The CLI in-process (root's would start the system service for /var/lib/sandboxer on demand).
    base = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    base["SANDBOXER_NO_SERVICE"] = "1"
    return subprocess.run(argv, capture_output=True, text=True, env=env or base, timeout=600, check=False)


def commit_tree(path: Path) -> str:
    subprocess.run([*GIT, "init", "-q", str(path)], check=True)
    subprocess.run([*GIT, "-C", str(path), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(path), "commit", "-qm", "sources"], check=True)
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    """A world-searchable scratch dir: as root, the sandbox uid must reach runtimes built here."""
    root = Path(tempfile.mkdtemp(prefix="sbx-build-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def sources(workdir: Path) -> tuple[list[Path], str]:
    """The two example packages, committed in a repository of their own."""
    tree = workdir / "sources"
    shutil.copytree(REPO / "examples", tree, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    revision = commit_tree(tree)
    return [tree / "demo-connector", tree / "demo-harness"], revision


@pytest.fixture(scope="session")
def built(workdir: Path, sources: tuple[list[Path], str]) -> tuple[Path, dict[str, str], str]:
    """The example runtime, built once through the script with a hostile caller environment."""
    paths, _ = sources
    hostile_home = workdir / "hostile-home"
    (hostile_home / ".config" / "pip").mkdir(parents=True)
    (hostile_home / ".config" / "pip" / "pip.conf").write_text("[global]\nindex-url = http://127.0.0.1:9/simple\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(hostile_home),
        "PIP_INDEX_URL": "http://127.0.0.1:9/canary-index-4e1f",
        "SANDBOXER_BUILD_CANARY": "canary-4e1f",
        "LANG": "C.UTF-8",
    }
    output = workdir / "runtime"
    result = run([*BUILD, "--output", str(output), "--json", *(a for p in paths for a in ("--source", str(p)))], env)
    assert result.returncode == 0, result.stderr
    return output, json.loads(result.stdout), result.stderr


def test_build_prints_path_and_the_same_digest_as_the_broker(built: tuple[Path, dict[str, str], str]) -> None:
    output, printed, progress = built
    assert printed["path"] == str(output)
    digest = run([sys.executable, "-m", "sandboxer", "runtime", "digest", "--full", str(output)])
    assert digest.returncode == 0, digest.stderr
    assert printed["sha256"] == digest.stdout.strip()
    assert "installing" in progress
    assert "computing the tree digest" in progress


def test_entry_points_run_the_runtime_at_its_fixed_mount(built: tuple[Path, dict[str, str], str]) -> None:
    output, _, _ = built
    for name in ("demo-harness", "pip", "pip3"):
        assert (output / "bin" / name).read_bytes().startswith(MOUNT_SHEBANG), name
    for script in (output / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            assert str(output).encode() not in script.read_bytes(), script.name
    assert not (output / "bin" / "python3").is_symlink()


def test_bytecode_is_compiled_for_the_mount_path(built: tuple[Path, dict[str, str], str]) -> None:
    output, _, _ = built
    package = next(output.glob("lib/python3*/site-packages/demo_harness"))
    compiled = list((package / "__pycache__").glob("cli.*.pyc"))
    assert compiled
    assert b"/opt/sandboxer/runtime/lib" in compiled[0].read_bytes()


def test_build_info_records_sources_versions_and_python(
    built: tuple[Path, dict[str, str], str], sources: tuple[list[Path], str]
) -> None:
    output, _, _ = built
    paths, revision = sources
    info = json.loads((output / "build-info.json").read_text())
    assert [s["path"] for s in info["sources"]] == [str(p) for p in paths]
    assert {s["revision"] for s in info["sources"]} == {revision}
    assert not any(s["dirty"] for s in info["sources"])
    assert info["allow_dirty"] is False
    versions = {d["name"]: d["version"] for d in info["distributions"]}
    assert versions["demo-harness"] == "0.1.0"
    assert versions["demo-connector"] == "0.1.0"
    python = subprocess.run(
        ["/usr/bin/python3", "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert info["python"] == {"executable": "/usr/bin/python3", "version": python}
    assert info["built_at"].endswith("Z")


def test_build_takes_nothing_from_the_callers_environment(built: tuple[Path, dict[str, str], str]) -> None:
    output, _, _ = built
    # The hostile PIP_INDEX_URL and user pip.conf would have broken the install had they been used.
    for path in output.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 4 * 2**20:
            data = path.read_bytes()
            assert b"canary-4e1f" not in data, path
            assert b"hostile-home" not in data, path


def test_dirty_source_is_refused_unless_allowed_and_then_recorded(
    workdir: Path, sources: tuple[list[Path], str]
) -> None:
    paths, _ = sources
    dirty_tree = workdir / "dirty"
    shutil.copytree(paths[0].parent, dirty_tree)
    (dirty_tree / "demo-connector" / "src" / "demo_connector" / "__init__.py").write_text("X = 1\n")
    output = workdir / "dirty-runtime"
    refused = run([*BUILD, "--output", str(output), "--source", str(dirty_tree / "demo-connector")])
    assert refused.returncode == 2
    assert "has uncommitted changes" in refused.stderr
    assert "--allow-dirty" in refused.stderr
    assert not output.exists()
    allowed = run([*BUILD, "--output", str(output), "--source", str(dirty_tree / "demo-connector"), "--allow-dirty"])
    assert allowed.returncode == 0, allowed.stderr
    info = json.loads((output / "build-info.json").read_text())
    assert info["allow_dirty"] is True
    assert info["sources"][0]["dirty"] is True


def test_non_empty_output_and_non_git_source_are_refused(workdir: Path, sources: tuple[list[Path], str]) -> None:
    paths, _ = sources
    occupied = workdir / "occupied"
    occupied.mkdir()
    (occupied / "keep").write_text("x")
    refused = run([*BUILD, "--output", str(occupied), "--source", str(paths[0])])
    assert refused.returncode == 2
    assert "exists and is not an empty directory" in refused.stderr
    assert (occupied / "keep").read_text() == "x"
    loose = workdir / "loose"
    shutil.copytree(paths[0], loose)
    not_git = run([*BUILD, "--output", str(workdir / "loose-runtime"), "--source", str(loose)])
    assert not_git.returncode == 2
    assert "not inside a Git checkout" in not_git.stderr


def test_package_with_one_pypi_dependency(workdir: Path) -> None:
    probe = run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir / "dl"), "six"])
    if probe.returncode != 0:
        pytest.skip(f"PyPI is unreachable from here (pip download six failed): {probe.stderr.strip()[-200:]}")
    package = workdir / "with-dep"
    (package / "src" / "with_dep").mkdir(parents=True)
    (package / "src" / "with_dep" / "__init__.py").write_text("import six\n")
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "with-dep"\nversion = "1.0"\ndependencies = ["six"]\n'
    )
    commit_tree(package)
    output = workdir / "with-dep-runtime"
    result = run([*BUILD, "--output", str(output), "--source", str(package), "--json"])
    assert result.returncode == 0, result.stderr
    versions = {d["name"]: d["version"] for d in json.loads((output / "build-info.json").read_text())["distributions"]}
    assert versions["with-dep"] == "1.0"
    assert versions["six"]


def test_requirements_and_packages_are_installed_and_recorded(workdir: Path) -> None:
    """A requirements file and a local wheel, with no source: both installed, the file by its
    digest, the wheel's distribution by its archive's; bin/runtime-venv is there."""
    wheel = tiny_wheel(workdir)
    requirements = workdir / "requirements.txt"
    requirements.write_text(f"{wheel}\n")
    output = workdir / "packages-runtime"
    result = run([*BUILD, "--output", str(output), "--requirement", str(requirements), "--package", str(wheel)])
    assert result.returncode == 0, result.stderr
    info = json.loads((output / "build-info.json").read_text())
    assert info["requirements"] == [
        {"path": str(requirements), "sha256": hashlib.sha256(requirements.read_bytes()).hexdigest()}
    ]
    assert info["packages"] == [str(wheel)]
    (found,) = [d for d in info["distributions"] if d["name"] == "tinywheel"]
    assert found == {"name": "tinywheel", "version": "1.0", "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert (output / "bin" / "runtime-venv").read_bytes().startswith(MOUNT_SHEBANG)


def test_a_missing_requirements_file_or_an_option_as_a_package_is_refused_leaving_nothing(workdir: Path) -> None:
    output = workdir / "refused-runtime"
    missing = run([*BUILD, "--output", str(output), "--requirement", str(workdir / "absent.txt")])
    assert missing.returncode == 2
    assert f"--requirement {workdir / 'absent.txt'}: cannot be read (No such file or directory)" in missing.stderr
    option = run([*BUILD, "--output", str(output), "--package=--index-url=https://user:secret@example.test/"])
    assert option.returncode == 2
    assert "--package" in option.stderr
    assert "secret" not in option.stderr  # an index's credential is never repeated
    nothing = run([*BUILD, "--output", str(output)])
    assert nothing.returncode == 2
    assert "at least one is needed" in nothing.stderr
    assert not output.exists() or not any(output.iterdir())


def smoke(runtime: Path, sha256: str) -> tuple[int, dict[str, object]]:
    result = run([*SMOKE, "--runtime-path", str(runtime), "--runtime-sha256", sha256, "--json"])
    return result.returncode, json.loads(result.stdout)


def test_smoke_passes_on_a_good_runtime(built: tuple[Path, dict[str, str], str]) -> None:
    output, printed, _ = built
    status, evidence = smoke(output, printed["sha256"])
    assert status == 0, evidence
    names = [c["name"] for c in evidence["checks"]]  # type: ignore[attr-defined]
    assert names == [
        "runtime-pin",
        "create",
        "imports",
        "entry-points-help",
        "runtime-read-only",
        "private-state",
        "sources-absent",
        "git-clean",
        "loopback-only",
        "teardown-clean",
    ]
    assert evidence["passed"] is True
    imports = evidence["checks"][2]["detail"]  # type: ignore[index]
    assert imports["demo-harness:demo_harness"] == "ok"
    assert imports["demo-connector:demo_connector"] == "ok"
    assert "demo-harness" in evidence["checks"][3]["detail"]  # type: ignore[index]


def test_smoke_fails_naming_the_pin_on_one_changed_byte(workdir: Path, built: tuple[Path, dict[str, str], str]) -> None:
    output, printed, _ = built
    changed = workdir / "changed-runtime"
    shutil.copytree(output, changed, symlinks=True)
    target = next(changed.glob("lib/python3*/site-packages/demo_connector/__init__.py"))
    data = bytearray(target.read_bytes())
    data[0] ^= 0x01
    target.write_bytes(bytes(data))
    status, evidence = smoke(changed, printed["sha256"])
    assert status == 1
    assert evidence["failed"] == ["runtime-pin"]
    assert "does not match the pinned config.runtime.sha256" in evidence["checks"][0]["detail"]  # type: ignore[index]


def test_smoke_fails_naming_the_check_on_a_broken_entry_point(
    workdir: Path, built: tuple[Path, dict[str, str], str]
) -> None:
    output, _, _ = built
    broken = workdir / "broken-runtime"
    shutil.copytree(output, broken, symlinks=True)
    (broken / "bin" / "demo-harness").write_bytes(MOUNT_SHEBANG + b"raise SystemExit(3)\n")
    sha256 = run([sys.executable, "-m", "sandboxer", "runtime", "digest", str(broken)]).stdout.strip()
    status, evidence = smoke(broken, sha256)
    assert status == 1
    assert evidence["failed"] == ["entry-points-help"]
    assert evidence["checks"][3]["detail"]["demo-harness"] == 3  # type: ignore[index]


def test_example_harness_runs_in_a_sandbox_on_the_built_runtime(built: tuple[Path, dict[str, str], str]) -> None:

    output, _, _ = built
    broker = make_broker(output, as_user=False)
    try:
        sandbox_id = broker.create()
        first = broker.exec(sandbox_id, "demo-harness", "state", "kept between execs")
        assert first.status == 0, first.stderr
        note = json.loads(first.stdout)
        assert note["path"] == "/run/sandboxer/state/data/demo-harness/note"
        assert note["read_back"] == "kept between execs"
        second = broker.exec(sandbox_id, "cat", note["path"])
        assert second.stdout == "kept between execs"
        interfaces = broker.exec(sandbox_id, "demo-harness", "interfaces")
        assert json.loads(interfaces.stdout) == ["lo"]
        connector = broker.exec(sandbox_id, "demo-harness", "connector")
        assert json.loads(connector.stdout)["connector"] == "demo-connector"
    finally:
        _cleanup(broker)
