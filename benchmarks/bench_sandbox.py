"""Benchmark of bwrap sandboxes against plain bwrap and Docker on the same machine, in one run.

    .venv/bin/python benchmarks/bench_sandbox.py [--rounds N] [--json]

Measures, as medians of whole-process runs, each CLI figure twice: in-process
(SANDBOXER_NO_SERVICE=1: the command table imported by every command) and through the service
(`sandboxer serve` for the state dir; the command is a small client of it):
- exec round trip of `true` in a live sandbox vs `docker exec` of `true` in a running container
  (targets: in-process <= 1.0x, through the service <= 0.3x), beside a bare bwrap start, the
  CLI's own start-up, and its interpreter's start with and without the two modules every
  standard-library client of the service imports (json, socket);
- the full cycle create -> exec true -> teardown vs `docker run --rm --network none IMAGE true`
  (in-process <= 1.0x, through the service <= 0.5x);
- `Client.exec(["true"])` from a warm Python process (target <= 0.1x `docker exec`), and 200
  concurrent execs over 20 sandboxes through the service;
- alternating in the same rounds, which a drifting machine cannot tilt: `Client.exec`, `docker
  exec`, the CLI's exec through the service, and that standard-library client's floor;
- host-side memory of one idle sandbox, all its host processes (target <= 8 MiB);
- 20 sandboxes created concurrently, each exec'd, then torn down (all succeed, no residue);
- the Docker backend's exec and cycles, through the service (targets <= 1.2x `docker exec` and
  `docker run --rm`).
Docker comparisons need a running Docker daemon and `scripts/build-base-image`; without them
they are reported as unavailable. A missed target is printed, not an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from sandboxer import Client

REPO = Path(__file__).resolve().parent.parent
SANDBOXER = [sys.executable, "-m", "sandboxer"]  # replaced by install_as_users_do() in main()


def install_as_users_do(root: Path, source: Path = REPO) -> list[str]:
    """The CLI as `pip install .` leaves it, not the development venv's editable install (the tree
    being edited, and its .pth files): a venv with the package copied in (from `source`, a tree of
    this repository), its `sandboxer` console script, and a path entry for this venv's
    dependencies."""
    venv = root / "installed"
    run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)])
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)])
    dependencies = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "dependencies.pth").write_text(dependencies + "\n")
    # pip --target wrote the console script for the interpreter that ran pip: point it at this
    # venv's, exactly as `pip install .` inside the venv would have written it.
    script = site / "bin" / "sandboxer"
    lines = script.read_text().splitlines(keepends=True)
    launcher = venv / "bin" / "sandboxer"
    launcher.write_text(f"#!{venv / 'bin' / 'python'}\n" + "".join(lines[1:]))
    launcher.chmod(0o755)
    return [str(launcher)]


def installed_python() -> str:
    """The interpreter of the installed CLI (install_as_users_do), as its console script runs it."""
    return str(Path(SANDBOXER[0]).parent / "python")


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median wall time of `fn` in milliseconds."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def run(argv: list[str], **kwargs: Any) -> str:
    proc = subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    return proc.stdout


def cli_env(*, through_service: bool) -> dict[str, str]:
    """The CLI's environment: in-process, or through the service."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SANDBOXER_")}
    if not through_service:
        env["SANDBOXER_NO_SERVICE"] = "1"
    return env


class World:
    """A throwaway broker with an approved bwrap profile; its CLI runs in-process until
    `through_service` is set (a service then answers on the state dir's socket)."""

    def __init__(self, root: Path, sandboxer: list[str] | None = None) -> None:
        self.root = root
        self.sandboxer = sandboxer  # the CLI it runs (default: SANDBOXER)
        self.through_service = False
        self.config, self.state = root / "config", root / "state"
        runtime, repo = root / "runtime", root / "repo"
        run(["/usr/bin/python3", "-m", "venv", "--copies", "--without-pip", str(runtime)])
        git = ["git", "-c", "user.name=b", "-c", "user.email=b@localhost", "-c", "init.defaultBranch=main"]
        run([*git, "init", "-q", str(repo)])
        (repo / "f").write_text("x\n")
        run([*git, "-C", str(repo), "add", "f"])
        run([*git, "-C", str(repo), "commit", "-qm", "i"])
        (self.config / "extensions").mkdir(parents=True)
        (self.config / "profiles").mkdir()
        self.config.chmod(0o700)
        owner = cli_env(through_service=False)  # set-up in-process: no service for the world yet
        digest = run(self.cli("runtime", "digest", str(runtime)), env=owner).strip()
        (self.config / "extensions" / "ext.bwrap.yaml").write_text(
            f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {digest}\n"
        )
        (self.config / "profiles" / "bench.yaml").write_text(
            f"profile: bench\nextension: ext.bwrap\nworkspace:\n  repository: {repo}\n  ref: main\n"
            "network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n"
        )
        run(self.cli("ext", "approve", "ext.bwrap"), env=owner)
        run(self.cli("ext", "approve", "bench"), env=owner)

    def cli(self, *args: str) -> list[str]:
        cli = self.sandboxer or SANDBOXER
        return [*cli, "--config-dir", str(self.config), "--state-dir", str(self.state), *args]

    def run(self, *args: str) -> str:
        return run(self.cli(*args), env=cli_env(through_service=self.through_service))

    def create(self, profile: str = "bench") -> str:
        return self.run("create", "--profile", profile).strip()

    def add_docker(self, image: str) -> None:
        """An approved ext.docker config on the same runtime, and a Docker profile."""
        bwrap_config = (self.config / "extensions" / "ext.bwrap.yaml").read_text()
        docker_config = bwrap_config.replace(
            "extension: ext.bwrap\nconfig:\n", f'extension: ext.docker\nconfig:\n  image: "{image}"\n'
        )
        (self.config / "extensions" / "ext.docker.yaml").write_text(docker_config)
        profile = (self.config / "profiles" / "bench.yaml").read_text()
        profile = profile.replace("profile: bench", "profile: bench-docker").replace("ext.bwrap", "ext.docker")
        (self.config / "profiles" / "bench-docker.yaml").write_text(profile)
        owner = cli_env(through_service=False)
        run(self.cli("ext", "approve", "ext.docker"), env=owner)
        run(self.cli("ext", "approve", "bench-docker"), env=owner)

    def exec_true(self, sandbox_id: str) -> None:
        self.run("exec", sandbox_id, "--", "true")

    def teardown(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.run("teardown", sandbox_id, "--json"))
        return result

    def cycle(self) -> None:
        self.exec_true(created := self.create())
        receipt = self.teardown(created)
        assert not receipt["residue"], receipt


def sandbox_memory(world: World, sandbox_id: str) -> dict[str, float]:
    record = json.loads((world.state / "sandboxes" / sandbox_id / "record.json").read_text())
    pids = {record["bwrap_pid"], record["init_pid"], record["holder_pid"]}
    rss = uss = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except psutil.NoSuchProcess:
            continue
        rss += info.rss
        uss += info.uss
    return {"processes": len(pids), "rss_mib": rss / 2**20, "uss_mib": uss / 2**20}


@contextlib.contextmanager
def serving(world: World) -> Iterator[Client]:
    """`sandboxer serve` on the world's state dir while the block runs, its CLI a client of it,
    and a `Client` of it."""

    path = world.state / "broker.sock"
    served = subprocess.Popen([*world.cli("serve")], stderr=subprocess.DEVNULL, env=cli_env(through_service=False))
    try:
        deadline = time.monotonic() + 20
        while not path.exists():
            assert served.poll() is None, "the service did not start"
            assert time.monotonic() < deadline, "the service did not answer"
            time.sleep(0.05)
        world.through_service = True
        yield Client(str(path))
    finally:
        world.through_service = False
        served.terminate()
        served.wait(timeout=30)


def service(world: World, rounds: int, docker: tuple[str, str] | None) -> dict[str, Any]:
    """The broker as a service (`sandboxer serve` on the state dir's socket): the CLI through it
    (exec, the cycle, the cycle with a warm sandbox, --help), `Client.exec(["true"])` from this
    warm process — and, given Docker's (image, running container), once more alternating with
    `docker exec` in the same rounds, and the warm cycle alternating with `docker run` — and 200
    concurrent execs over 20 sandboxes (each a thread with its own connection)."""
    results: dict[str, Any] = {}
    with serving(world) as client:
        results["service_cli_help_ms"] = timed(lambda: world.run("--help"), rounds)
        sandbox_id = world.create()
        world.exec_true(sandbox_id)
        results["service_exec_true_ms"] = timed(lambda: world.exec_true(sandbox_id), rounds)
        world.teardown(sandbox_id)
        results["service_cycle_ms"] = timed(world.cycle, max(5, rounds // 2))
        image = docker[0] if docker is not None else None
        warm = warm_cycles(world, "ext.bwrap", "bench", max(5, rounds // 2), image)
        results.update({f"service_{key}": value for key, value in warm.items()})
        with client.create("bench") as sandbox:
            sandbox.exec(["true"])
            results["client_exec_true_ms"] = timed(lambda: sandbox.exec(["true"]), rounds)
            if docker is not None:
                results.update(alternating_execs(world, sandbox.id, lambda: sandbox.exec(["true"]), docker[1], rounds))
        results["service_200_execs"] = concurrent_execs(client)
    return results


def alternating_execs(
    world: World, sandbox_id: str, client_exec: Callable[[], object], container: str, rounds: int
) -> dict[str, float]:
    """In the same rounds, one after another: `Client.exec(["true"])`, `docker exec`, the CLI's
    exec through the service, and a standard-library client's floor (the CLI's interpreter
    importing json and socket) — medians a drifting machine cannot tilt against each other."""
    python = installed_python()
    through_service = cli_env(through_service=True)
    measured: dict[str, Callable[[], object]] = {
        "client_exec_interleaved_ms": client_exec,
        "docker_exec_interleaved_ms": lambda: run(["docker", "exec", container, "true"]),
        "service_exec_interleaved_ms": lambda: run(world.cli("exec", sandbox_id, "--", "true"), env=through_service),
        "client_floor_interleaved_ms": lambda: run([python, "-c", "import json, socket"]),
    }
    samples: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(rounds):
        for name, fn in measured.items():
            samples[name].append(timed(fn, 1))
    return {name: statistics.median(values) for name, values in samples.items()}


def concurrent_execs(client: Client) -> dict[str, Any]:
    """200 concurrent `Client.exec(["true"])` over 20 sandboxes, each a thread with its own
    connection: whether all succeed, and their latencies."""
    sandboxes = [client.create("bench") for _ in range(20)]
    try:

        def one(index: int) -> tuple[int, float]:
            start = time.perf_counter()
            status = sandboxes[index % 20].exec(["true"]).status
            return status, (time.perf_counter() - start) * 1000

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=200) as pool:
            done = list(pool.map(one, range(200)))
        latencies = sorted(ms for _, ms in done)
        return {
            "seconds": round(time.perf_counter() - started, 2),
            "all_succeeded": all(status == 0 for status, _ in done),
            "p50_ms": round(latencies[99], 1),
            "p99_ms": round(latencies[197], 1),
        }
    finally:
        for sandbox in sandboxes:
            sandbox.teardown()


def docker_references(world: World, rounds: int, results: dict[str, Any], docker: tuple[str, str] | None) -> None:
    """`docker exec` and `docker run --rm` in the same run, the ratios against them, and the
    Docker backend's own figures."""
    if docker is None:
        results["docker"] = "unavailable"
        return
    image, container = docker
    try:
        results["docker_exec_true_ms"] = timed(lambda: run(["docker", "exec", container, "true"]), rounds)
        results["docker_run_true_ms"] = timed(
            lambda: run(["docker", "run", "--rm", "--network", "none", image, "/usr/bin/true"]),
            max(5, rounds // 2),
        )
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False)
    results["exec_vs_docker_exec"] = results["exec_true_ms"] / results["docker_exec_true_ms"]
    results["client_exec_vs_docker_exec"] = results["client_exec_true_ms"] / results["docker_exec_true_ms"]
    results["client_exec_vs_docker_exec_interleaved"] = (
        results["client_exec_interleaved_ms"] / results["docker_exec_interleaved_ms"]
    )
    results["cycle_vs_docker_run"] = results["cycle_ms"] / results["docker_run_true_ms"]
    results["service_exec_vs_docker_exec"] = results["service_exec_true_ms"] / results["docker_exec_true_ms"]
    # No target: the share of `docker exec` a standard-library client spends before it sends anything.
    results["client_floor_vs_docker_exec"] = results["client_floor_ms"] / results["docker_exec_true_ms"]
    alternating = results["docker_exec_interleaved_ms"]
    results["service_exec_vs_docker_exec_interleaved"] = results["service_exec_interleaved_ms"] / alternating
    results["client_floor_vs_docker_exec_interleaved"] = results["client_floor_interleaved_ms"] / alternating
    results["service_cycle_vs_docker_run"] = results["service_cycle_ms"] / results["docker_run_true_ms"]
    results.update(docker_backend(world, image, rounds, results))


def docker_setup() -> tuple[str, str] | None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, check=False).returncode != 0:
        return None
    image = run([sys.executable, str(REPO / "scripts" / "build-base-image")]).strip()
    container = run([docker, "run", "-d", "--rm", "--network", "none", image, "/usr/bin/sleep", "infinity"]).strip()
    return image, container


def docker_backend(world: World, image: str, rounds: int, raw: dict[str, Any]) -> dict[str, Any]:
    """The Docker backend's exec and full cycle through the service (as its CLI runs by default),
    beside the raw docker commands measured before."""
    world.add_docker(image)
    with serving(world):
        results: dict[str, Any] = {}
        docker_id = world.create("bench-docker")
        world.exec_true(docker_id)
        results["docker_backend_exec_ms"] = timed(lambda: world.exec_true(docker_id), rounds)
        record = json.loads((world.state / "sandboxes" / docker_id / "record.json").read_text())
        same = ["docker", "exec", record["container_id"], "true"]  # the very container our exec enters
        results["docker_exec_same_container_ms"] = timed(lambda: run(same), rounds)
        world.teardown(docker_id)

        def docker_same_work() -> None:
            """What our cycle asks of the Engine, with the docker CLI: create, start, exec, remove."""
            created = run(["docker", "create", "--network", "none", image, "/usr/bin/sleep", "infinity"]).strip()
            run(["docker", "start", created])
            run(["docker", "exec", created, "true"])
            run(["docker", "rm", "-f", created])

        results["docker_same_work_ms"] = timed(docker_same_work, max(5, rounds // 2))

        def docker_cycle() -> None:
            world.exec_true(created := world.create("bench-docker"))
            receipt = world.teardown(created)
            assert not receipt["residue"], receipt

        results["docker_backend_cycle_ms"] = timed(docker_cycle, max(5, rounds // 2))
        results.update(docker_warm(world, image, max(5, rounds // 2)))
        results["docker_backend_exec_vs_docker_exec"] = results["docker_backend_exec_ms"] / raw["docker_exec_true_ms"]
        results["docker_backend_cycle_vs_docker_run"] = results["docker_backend_cycle_ms"] / raw["docker_run_true_ms"]
        results["docker_backend_exec_vs_same_container"] = (
            results["docker_backend_exec_ms"] / results["docker_exec_same_container_ms"]
        )
        results["docker_backend_cycle_vs_same_work"] = (
            results["docker_backend_cycle_ms"] / results["docker_same_work_ms"]
        )
        return results


def warm_cycles(world: World, extension: str, profile: str, rounds: int, image: str | None) -> dict[str, Any]:
    """The cycle when the profile keeps a warm sandbox (the extension's `config.warm: 1`), as the
    world's CLI runs it (in-process, or through the service).

    Latency: before each timed cycle (and before each `docker run` it is compared with in the
    same rounds, given an `image`) the background fill is waited out, so neither is measured
    against a sandbox starting in the background. Back to back: cycles with no wait, where the
    fill a teardown starts competes with the next create (which takes the warm sandbox only if
    the fill is done).
    """
    ext = world.config / "extensions" / f"{extension}.yaml"
    cold_text = ext.read_text()
    ext.write_text(cold_text + "  warm: 1\n")
    world.run("ext", "approve", extension)
    world.run("warm", profile)
    taken: list[bool] = []

    def settled() -> None:
        for _ in range(600):
            report = json.loads(world.run("gc", "--json"))
            if report["warm"] and not report["busy"]:
                time.sleep(0.1)  # and a fill process has exited
                return
            time.sleep(0.02)
        raise RuntimeError("the warm sandbox was never replaced")

    def cycle() -> float:
        warm_ids = set(json.loads(world.run("gc", "--json"))["warm"])
        start = time.perf_counter()
        created = world.create(profile)
        world.exec_true(created)
        receipt = world.teardown(created)
        elapsed = (time.perf_counter() - start) * 1000
        assert not receipt["residue"], receipt
        taken.append(created in warm_ids)
        return elapsed

    def docker_run() -> float:
        start = time.perf_counter()
        run(["docker", "run", "--rm", "--network", "none", str(image), "/usr/bin/true"])
        return (time.perf_counter() - start) * 1000

    ours, theirs = [], []
    for _ in range(rounds):
        settled()
        ours.append(cycle())
        if image is not None:
            settled()
            theirs.append(docker_run())
    settled()
    back_to_back = [cycle() for _ in range(rounds)]
    settled()
    ext.write_text(cold_text)
    world.run("ext", "approve", extension)
    world.run("warm", profile)  # warm: 0 again: the warm sandbox goes
    results: dict[str, Any] = {
        "warm_cycle_ms": statistics.median(ours),
        "warm_back_to_back_cycle_ms": statistics.median(back_to_back),
        "warm_taken": f"{sum(taken[:rounds])}/{rounds} settled, {sum(taken[rounds:])}/{rounds} back to back",
    }
    if theirs:
        results["docker_run_interleaved_ms"] = statistics.median(theirs)
        results["warm_cycle_vs_docker_run"] = results["warm_cycle_ms"] / results["docker_run_interleaved_ms"]
    return results


def docker_warm(world: World, image: str, rounds: int) -> dict[str, Any]:
    """The Docker backend's cycle with a warm container (through the service, as its other figures)."""
    measured = warm_cycles(world, "ext.docker", "bench-docker", rounds, image)
    return {(key if key.startswith("docker_") else f"docker_{key}"): value for key, value in measured.items()}


def command_as_is(rounds: int, source: Path) -> dict[str, Any]:
    """`sandboxer exec ID -- true` as the account running this gets it with nothing set (no
    SANDBOXER_* variable, no service running beforehand: as root, the command starts its state
    dir's service on demand at the first command since issue 31, and ran in-process before),
    alternating round by round with `docker exec`; the CLI installed from the tree `source`."""
    global SANDBOXER  # noqa: PLW0603 - the world runs the installed CLI
    with tempfile.TemporaryDirectory(prefix="sbx-bench-") as tmp:
        Path(tmp).chmod(0o755)
        SANDBOXER = install_as_users_do(Path(tmp), source)
        world = World(Path(tmp))
        docker = docker_setup()
        as_is = {key: value for key, value in os.environ.items() if not key.startswith("SANDBOXER_")}
        try:
            sandbox_id = run(world.cli("create", "--profile", "bench"), env=as_is).strip()
            commands = {"as_is_exec_true_ms": world.cli("exec", sandbox_id, "--", "true")}
            if docker is not None:
                commands["docker_exec_true_ms"] = ["docker", "exec", docker[1], "true"]
            samples: dict[str, list[float]] = {key: [] for key in commands}
            for _ in range(rounds):
                for key, argv in commands.items():
                    start = time.perf_counter()
                    run(argv, env=as_is)
                    samples[key].append((time.perf_counter() - start) * 1000)
            run(world.cli("teardown", "--discard", sandbox_id), env=as_is)
        finally:
            if docker is not None:
                subprocess.run(["docker", "rm", "-f", docker[1]], capture_output=True, check=False)
            started = [  # the service the command started on demand, if it did
                process
                for process in psutil.process_iter(["cmdline"])
                if {"serve", str(world.state)} <= set(process.info["cmdline"] or [])
            ]
            for process in started:
                process.terminate()
        results: dict[str, Any] = {key: statistics.median(values) for key, values in samples.items() if values}
        results["service_started"] = bool(started)
        if "docker_exec_true_ms" in results:
            results["as_is_vs_docker_exec"] = results["as_is_exec_true_ms"] / results["docker_exec_true_ms"]
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description="bwrap sandboxes vs plain bwrap and Docker")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--as-is",
        metavar="TREE",
        type=Path,
        help="only `sandboxer exec` with nothing set (root: no service beforehand) vs docker exec, "
        "the CLI installed from TREE (a checkout of this repository)",
    )
    args = parser.parse_args()
    rounds = args.rounds
    if args.as_is is not None:
        print(json.dumps({"rounds": rounds, "tree": str(args.as_is), **command_as_is(rounds, args.as_is)}, indent=2))
        return 0
    results: dict[str, Any] = {"rounds": rounds, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="sbx-bench-") as tmp:
        Path(tmp).chmod(0o755)  # as root the sandbox's uid must reach the runtime and the state dir
        global SANDBOXER  # noqa: PLW0603 - every measurement below runs the installed CLI
        SANDBOXER = install_as_users_do(Path(tmp))
        world = World(Path(tmp))
        bwrap = ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib64", "/lib64"]
        bwrap += ["--symlink", "usr/lib", "/lib", "--symlink", "usr/bin", "/bin", "--", "/usr/bin/true"]
        results["bwrap_true_ms"] = timed(lambda: run(bwrap), rounds)
        # The installed CLI's interpreter, started as its console script starts it, and the least
        # a standard-library client of the service pays before it does anything: its start with
        # the two modules no such client can do without (a Unix socket, a JSON header).
        python = installed_python()
        results["python_start_ms"] = timed(lambda: run([python, "-c", "pass"]), rounds)
        results["client_floor_ms"] = timed(lambda: run([python, "-c", "import json, socket"]), rounds)
        results["cli_version_ms"] = timed(lambda: world.run("--help"), rounds)
        sandbox_id = world.create()
        world.exec_true(sandbox_id)
        results["exec_true_ms"] = timed(lambda: world.exec_true(sandbox_id), rounds)
        time.sleep(0.5)
        results["idle_memory"] = sandbox_memory(world, sandbox_id)
        world.teardown(sandbox_id)

        results["cycle_ms"] = timed(world.cycle, max(5, rounds // 2))

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=20) as pool:
            ids = list(pool.map(lambda _: world.create(), range(20)))
            list(pool.map(world.exec_true, ids))
            receipts = list(pool.map(world.teardown, ids))
        left = sorted(os.listdir(world.state / "sandboxes"))
        results["concurrent_20"] = {
            "seconds": round(time.perf_counter() - started, 2),
            "all_succeeded": len(ids) == 20 and len(set(ids)) == 20,
            "residue": [r["residue"] for r in receipts if r["residue"]],
            "left_in_registry": [name for name in left if not name.startswith(".")],
        }
        docker = docker_setup()
        try:
            results.update(service(world, rounds, docker))
            docker_references(world, rounds, results, docker)
        finally:
            if docker is not None:
                subprocess.run(["docker", "rm", "-f", docker[1]], capture_output=True, check=False)
    report(results, as_json=args.json)
    ok = results["concurrent_20"]["all_succeeded"] and not results["concurrent_20"]["residue"]
    ok = ok and results["service_200_execs"]["all_succeeded"]
    return 0 if ok else 1


def report(results: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    rows = [
        ("bare bwrap --unshare-all true", results["bwrap_true_ms"]),
        ("python -c pass (the installed CLI's interpreter)", results["python_start_ms"]),
        ("the same importing json and socket", results["client_floor_ms"]),
        ("sandboxer --help, in-process", results["cli_version_ms"]),
        ("sandboxer exec ID -- true, in-process", results["exec_true_ms"]),
        ("create -> exec true -> teardown, in-process", results["cycle_ms"]),
        ("sandboxer --help, through the service", results["service_cli_help_ms"]),
        ("sandboxer exec ID -- true, through the service", results["service_exec_true_ms"]),
        ("create -> exec -> teardown, through the service", results["service_cycle_ms"]),
        ("the same, warm (config.warm: 1, fill waited out)", results["service_warm_cycle_ms"]),
        ("the same, warm, back to back", results["service_warm_back_to_back_cycle_ms"]),
        ("Client.exec(['true']) through the service", results["client_exec_true_ms"]),
    ]
    if results.get("docker") != "unavailable":
        rows += [
            ("docker exec CONTAINER true", results["docker_exec_true_ms"]),
            ("docker run --rm --network none IMAGE true", results["docker_run_true_ms"]),
            ("alternating: Client.exec", results["client_exec_interleaved_ms"]),
            ("alternating: docker exec", results["docker_exec_interleaved_ms"]),
            ("alternating: sandboxer exec, through the service", results["service_exec_interleaved_ms"]),
            ("alternating: python importing json and socket", results["client_floor_interleaved_ms"]),
            ("docker run --rm, alternating with the warm cycle", results["service_docker_run_interleaved_ms"]),
        ]
    print(f"median of {results['rounds']} runs, {results['cpus']} CPUs")
    for name, value in rows:
        print(f"  {name:45s} {value:8.1f} ms")
    print(f"  warm sandbox taken through the service: {results['service_warm_taken']}")
    memory = results["idle_memory"]
    print(
        f"  idle sandbox: {memory['processes']} host processes, RSS {memory['rss_mib']:.1f} MiB, "
        f"USS {memory['uss_mib']:.1f} MiB"
    )
    c20 = results["concurrent_20"]
    print(
        f"  20 concurrent create/exec/teardown: {c20['seconds']} s, all succeeded {c20['all_succeeded']}, "
        f"residue {c20['residue']}, left {c20['left_in_registry']}"
    )
    if results.get("docker") == "unavailable":
        print("  docker: unavailable (start dockerd to compare)")
        return
    print(f"  {'docker backend: sandboxer exec ID -- true':45s} {results['docker_backend_exec_ms']:8.1f} ms")
    print(f"  {'docker backend: create -> exec -> teardown':45s} {results['docker_backend_cycle_ms']:8.1f} ms")
    print(f"  {'docker exec SANDBOX-CONTAINER true':45s} {results['docker_exec_same_container_ms']:8.1f} ms")
    print(f"  {'docker create + start + exec true + rm -f':45s} {results['docker_same_work_ms']:8.1f} ms")
    print(f"  {'docker backend, warm: create -> exec -> teardown':45s} {results['docker_warm_cycle_ms']:8.1f} ms")
    print(f"  {'docker run --rm, in the same rounds':45s} {results['docker_run_interleaved_ms']:8.1f} ms")
    print(f"  {'docker backend, warm, back to back':45s} {results['docker_warm_back_to_back_cycle_ms']:8.1f} ms")
    print(f"  warm container taken: {results['docker_warm_taken']}")
    print(
        f"  (no target) a standard-library client's start (python importing json and socket) vs docker exec: "
        f"{results['client_floor_vs_docker_exec']:.2f}x; "
        f"alternating: {results['client_floor_vs_docker_exec_interleaved']:.2f}x"
    )
    print(
        f"  (no target) docker backend exec vs docker exec into the same container: "
        f"{results['docker_backend_exec_vs_same_container']:.2f}x; cycle vs the same work with the docker CLI: "
        f"{results['docker_backend_cycle_vs_same_work']:.2f}x"
    )
    for label, ratio, target in (
        ("exec vs docker exec, in-process", results["exec_vs_docker_exec"], 1.0),
        ("cycle vs docker run, in-process", results["cycle_vs_docker_run"], 1.0),
        ("exec vs docker exec, through the service", results["service_exec_vs_docker_exec"], 0.3),
        ("the same, alternating", results["service_exec_vs_docker_exec_interleaved"], 0.3),
        ("cycle vs docker run, through the service", results["service_cycle_vs_docker_run"], 0.5),
        ("warm cycle vs docker run, through the service", results["service_warm_cycle_vs_docker_run"], 0.5),
        ("Client.exec vs docker exec", results["client_exec_vs_docker_exec"], 0.1),
        ("Client.exec vs docker exec, alternating", results["client_exec_vs_docker_exec_interleaved"], 0.1),
        ("idle memory (USS MiB)", memory["uss_mib"] / 8.0, 1.0),
        ("docker backend exec vs docker exec", results["docker_backend_exec_vs_docker_exec"], 1.2),
        ("docker backend cycle vs docker run", results["docker_backend_cycle_vs_docker_run"], 1.2),
        ("docker backend cycle, warm, vs docker run", results["docker_warm_cycle_vs_docker_run"], 1.2),
    ):
        print(f"  {'PASS' if ratio <= target else 'MISS'}  {label}: {ratio:.2f}x (target <= {target}x)")


if __name__ == "__main__":
    sys.exit(main())
