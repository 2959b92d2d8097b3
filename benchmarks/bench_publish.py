"""Benchmark of published ports (issue 34): a request through a published port against the same
request made directly on the host's loopback, in one run.

    .venv/bin/python benchmarks/bench_publish.py [--rounds N] [--requests N] [--sandboxes N] [--json] [--no-docker]

Run as root. Loopback only: the host side is 127.0.0.1, the server inside listens on the sandbox's
own 127.0.0.1. The same small HTTP server (the standard library's, /big 64 MiB and /small) runs
inside a sandbox whose lease manifest publishes its port, and on the host for the direct figure.

Measures, in interleaved rounds (medians; a throughput ratio is the median of each round's ratio
to that round's direct download):
- throughput of a 64 MiB download with host `curl`: through the published port vs straight from
  the host's copy of the server (target >= 0.5x);
- added latency per request: one Python process making `--requests` small GETs (each a new
  connection) through the published port vs directly; the added p50 (target <= 0.5 ms);
- scale: `--sandboxes` (50) sandboxes created, each publishing one port; every port answers.
Docker is measured too when a daemon answers and `scripts/build-base-image` gives the image. A
missed target is printed, not an error; the exit is non-zero only when something breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_egress import LATENCY, check, curl_result, docker_image, load, percentiles, teardown
from bench_sandbox import World, run, serving

from sandboxer.clients.service import ClientSandbox

BIG = 64 * 2**20
INSIDE_PORT = 8000
SANDBOXES = 50
# The server, inside and on the host: /big (64 MiB), /small ("ok\n"), HTTP/1.0, threaded.
SERVER = """
import http.server, sys
bodies = {"/big": bytes(64 * 2**20), "/small": b"ok\\n"}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = bodies.get(self.path)
        if body is None:
            self.send_error(404); return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 256
    allow_reuse_address = True
Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def publishing_profile(world: World, name: str, extension: str) -> str:
    """An approved profile `name` on `extension` that lets manifests publish ports."""
    text = (world.config / "profiles" / "bench.yaml").read_text()
    text = text.replace("profile: bench\n", f"profile: {name}\n").replace("ext.bwrap", extension)
    text = text.replace("network:\n  default: deny\n", "network:\n  default: deny\n  publish: loopback\n")
    (world.config / "profiles" / f"{name}.yaml").write_text(text)
    world.run("ext", "approve", name)
    return name


def manifest(world: World, host_port: int) -> str:
    """A version-1 assignment with no leases, publishing host_port -> INSIDE_PORT."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    run_dir = world.root / "managed" / run_id
    run_dir.mkdir(parents=True, mode=0o700)
    repo = world.root / "repo"
    head = run(["git", "-C", str(repo), "rev-parse", "HEAD"]).strip()
    document = {
        "version": "1",
        "run_id": run_id,
        "lease_id": "assignment-1",
        "outer_runtime_id": "outer-1",
        "workspace": "/srv/work/bench",
        "repository": {"path": str(repo), "revision": head},
        "task_branch": "task/bench",
        "tunnel_placement": "outer",
        "published_ports": [{"host": host_port, "runtime": INSIDE_PORT}],
        "leases": [],
    }
    path = run_dir / "assignment.json"
    path.write_text(json.dumps(document))
    path.chmod(0o600)
    return str(path)


def serve_inside(sandbox: ClientSandbox, host_port: int) -> None:
    """The server inside `sandbox` (an exec on a thread of its own, until teardown), answering
    through the published port."""
    threading.Thread(target=lambda: sandbox.exec(["python3", "-c", SERVER, str(INSIDE_PORT)]), daemon=True).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if answers(host_port):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the server in {sandbox.id} never answered on 127.0.0.1:{host_port}")


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /small HTTP/1.0\r\n\r\n")
            return conn.recv(64).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def curl_speed(url: str) -> float:
    out = run(["curl", "-sS", "--noproxy", "*", "--max-time", "120", "-o", "/dev/null", "-w", CURL_FORMAT, url])
    speed, size, status = curl_result(out)
    check(url, size, status, BIG)
    return speed


CURL_FORMAT = "%{speed_download} %{size_download} %{http_code}"


def latency(port: int, count: int) -> list[float]:
    argv = ["/usr/bin/python3", "-c", LATENCY, f"http://127.0.0.1:{port}/small", str(count), "direct"]
    samples: list[float] = json.loads(run(argv))
    return samples


def throughput_and_latency(ports: dict[str, int], direct: int, rounds: int, requests: int) -> dict[str, Any]:
    speeds: dict[str, list[float]] = {"direct": [], **{name: [] for name in ports}}
    latencies: dict[str, list[float]] = {"direct": [], **{name: [] for name in ports}}
    per_round = max(1, requests // rounds)
    for _ in range(rounds):
        speeds["direct"].append(curl_speed(f"http://127.0.0.1:{direct}/big"))
        for name, port in ports.items():
            speeds[name].append(curl_speed(f"http://127.0.0.1:{port}/big"))
        latencies["direct"] += latency(direct, per_round)
        for name, port in ports.items():
            latencies[name] += latency(port, per_round)
    results: dict[str, Any] = {"throughput_mb_s": {k: round(statistics.median(v), 1) for k, v in speeds.items()}}
    results["throughput_ratio"] = {
        name: round(statistics.median(v / d for v, d in zip(speeds[name], speeds["direct"], strict=True)), 3)
        for name in ports
    }
    results["latency"] = {key: percentiles(values) for key, values in latencies.items()}
    results["added_p50_ms"] = {
        name: round(results["latency"][name]["p50_ms"] - results["latency"]["direct"]["p50_ms"], 3) for name in ports
    }
    return results


def scale(world: World, client: Any, profile: str, count: int) -> dict[str, Any]:
    """`count` sandboxes, each publishing one port of its own; every one must answer."""
    ports = [free_port() for _ in range(count)]
    created: list[ClientSandbox] = []
    results: dict[str, Any] = {"sandboxes": count}
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=10) as pool:
            futures = [pool.submit(client.create, profile, manifest=manifest(world, port)) for port in ports]
        created.extend(future.result() for future in futures if future.exception() is None)
        for future in futures:
            future.result()
        results["create_seconds"] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=count) as pool:
            list(pool.map(serve_inside, created, ports))
        results["serve_seconds"] = round(time.perf_counter() - started, 2)
        results["answering"] = sum(answers(port) for port in ports)
        results["all_answer"] = results["answering"] == count
    finally:
        with ThreadPoolExecutor(max_workers=10) as pool:
            receipts = list(pool.map(teardown, created))
        results["teardown_failures"] = [r for r in receipts if r]
    return results


def measure(world: World, args: argparse.Namespace, image: str | None) -> dict[str, Any]:
    profiles = {"bwrap": publishing_profile(world, "pub", "ext.bwrap")}
    if image is not None:
        world.add_docker(image)
        profiles["docker"] = publishing_profile(world, "pub-docker", "ext.docker")
    direct_port = free_port()
    direct = subprocess.Popen(["/usr/bin/python3", "-c", SERVER, str(direct_port)])
    results: dict[str, Any] = {}
    try:
        with serving(world) as client:
            sandboxes: dict[str, ClientSandbox] = {}
            ports: dict[str, int] = {}
            try:
                for backend, profile in profiles.items():
                    ports[backend] = free_port()
                    sandboxes[backend] = client.create(profile, manifest=manifest(world, ports[backend]))
                    serve_inside(sandboxes[backend], ports[backend])
                while not answers(direct_port):
                    time.sleep(0.05)
                results.update(throughput_and_latency(ports, direct_port, args.rounds, args.requests))
            finally:
                results["teardown_failures"] = [r for r in map(teardown, sandboxes.values()) if r]
            results["scale"] = scale(world, client, profiles["bwrap"], args.sandboxes)
    finally:
        direct.terminate()
        direct.wait(timeout=10)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="published ports vs direct loopback")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="latency requests in all, over the rounds")
    parser.add_argument("--sandboxes", type=int, default=SANDBOXES)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-docker", action="store_true")
    args = parser.parse_args()
    if min(args.rounds, args.requests, args.sandboxes) < 1:
        parser.error("--rounds, --requests and --sandboxes must be at least 1")
    if os.geteuid() != 0:
        print("bench_publish.py runs as root (a root service and its sandboxes)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count(), "load_before": load()}
    with tempfile.TemporaryDirectory(prefix="sbx-bench-publish-") as tmp:
        Path(tmp).chmod(0o755)
        world = World(Path(tmp))
        image = None if args.no_docker else docker_image()
        results["docker"] = "measured" if image is not None else "skipped (no daemon, or --no-docker)"
        results.update(measure(world, args, image))
    results["load_after"] = load()
    report(results, as_json=args.json)
    broken = not results["scale"]["all_answer"] or results["teardown_failures"] or results["scale"]["teardown_failures"]
    return 1 if broken else 0


def report(results: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    print(f"median of {results['rounds']} rounds, {results['cpus']} CPUs; {results['load_before']} before")
    speeds = results["throughput_mb_s"]
    print(f"  64 MiB download, host curl, direct                    {speeds['direct']:8.1f} MB/s")
    for name, ratio in results["throughput_ratio"].items():
        print(f"  {name}: through the published port                   {speeds[name]:8.1f} MB/s ({ratio:.2f}x)")
    for key, seen in results["latency"].items():
        print(f"  small GET, {key:8}  p50 {seen['p50_ms']:6.3f} ms, p90 {seen['p90_ms']:6.3f} ms (n={seen['n']})")
    for name, ratio in results["throughput_ratio"].items():
        print(f"  {'PASS' if ratio >= 0.5 else 'MISS'}  {name}: throughput vs direct {ratio:.2f}x (target >= 0.5x)")
    for name, added in results["added_p50_ms"].items():
        print(f"  {'PASS' if added <= 0.5 else 'MISS'}  {name}: added p50 latency {added:.3f} ms (target <= 0.5 ms)")
    scale_result = results["scale"]
    verdict = "PASS" if scale_result["all_answer"] else "FAIL"
    print(
        f"  {verdict}  {scale_result['sandboxes']} sandboxes each publishing a port: {scale_result['answering']} answer"
        f" (creates {scale_result['create_seconds']} s, servers up in {scale_result['serve_seconds']} s)"
    )
    print(f"  docker: {results['docker']}; {results['load_after']} after")


if __name__ == "__main__":
    sys.exit(main())
