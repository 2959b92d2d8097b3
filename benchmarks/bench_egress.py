"""Benchmark of egress through the broker's proxy (issue 33), against the same transfers made
directly on the host's loopback, in one run.

    .venv/bin/python benchmarks/bench_egress.py [--rounds N] [--json] [--requests N] [--no-docker]

Run as root. Loopback only: the upstream is this process's own HTTP server on the host's
127.0.0.1, and the profile pins its one name, bench.test, to 127.0.0.1 (`addresses`); nothing
connects anywhere else. A root service (`sandboxer serve`) runs each sandbox's proxy; the
sandbox reaches it on its own 127.0.0.1:3128 through HTTP_PROXY.

Measures, in interleaved rounds (medians; a throughput ratio is the median of each round's ratio
to that round's direct download):
- throughput of a 64 MiB download: `curl` inside a bwrap sandbox through the proxy (plain HTTP
  forwarding, and a CONNECT tunnel with `--proxytunnel`) vs the same `curl` on the host straight
  from 127.0.0.1 (target: >= 0.5x direct), beside the floor of the proxy's copy: the same
  download through a bare asyncio stream relay on the host (the proxy's tunnel loop, reads of
  64 KiB, write and drain, no HTTP parsing and no policy) in a process of its own;
- added latency per request: one Python process making `--requests` small GETs with urllib
  (warm-up requests first, the interpreter's start outside the timing), inside through the
  proxy vs on the host directly; p50 and p90 of each, the added p50 (target <= 1 ms);
- scale: 50 sandboxes, each doing 4 parallel 4 MiB downloads through its own proxy at once;
  every download must complete with the right size (wall time reported).
The Docker backend's throughput and latency are measured too when a daemon answers and
`scripts/build-base-image` gives the base image (`--no-docker` skips it). A missed target is
printed, not an error; the exit is non-zero only when something breaks (a download failing or
short, a sandbox not created).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_sandbox import REPO, World, run, serving

from sandboxer import Client
from sandboxer.clients.service import ClientSandbox

NAME = "bench.test"  # the upstream's name in the profile, pinned to 127.0.0.1
BIG = 64 * 2**20  # the throughput download
PART = 4 * 2**20  # each of the scale run's downloads
SMALL = b"ok\n"  # the latency requests' body
SANDBOXES = 50
PARALLEL = 4
RELAY_CHUNK = 64 * 1024  # the proxy's READ_CHUNK (sandboxer/service/egress/heads.py)

# One process making `n` GETs of `url` after 10 unmeasured ones, each timed on its own; through
# the environment's proxy, or straight (`direct`). Run as `python3 -c LATENCY URL N MODE`.
LATENCY = """
import json, sys, time, urllib.request
url, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
handlers = [urllib.request.ProxyHandler({})] if mode == "direct" else []
opener = urllib.request.build_opener(*handlers)
def get():
    with opener.open(url, timeout=30) as response:
        assert response.read() == b"ok\\n"
for _ in range(10):
    get()
samples = []
for _ in range(n):
    start = time.perf_counter()
    get()
    samples.append((time.perf_counter() - start) * 1000)
print(json.dumps(samples))
"""

CURL_FORMAT = "%{speed_download} %{size_download} %{http_code}"


class Upstream:
    """A threaded HTTP/1.0 server on the host's 127.0.0.1: /big (64 MiB), /part (4 MiB), /small."""

    def __init__(self) -> None:
        bodies = {"/big": bytes(BIG), "/part": bytes(PART), "/small": SMALL}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = bodies.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 1024  # 200 connections arrive at once in the scale run

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the floor: a bare asyncio stream relay ------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The proxy's tunnel loop (sandboxer/service/egress/proxy.py `_pipe`), without its counting."""
    while data := await reader.read(RELAY_CHUNK):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()


async def _relay(upstream_port: int) -> None:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def floor_relay(upstream_port: int) -> Iterator[int]:
    """The bare relay in a process of its own (as the service is), listening on a port it prints."""
    relay = subprocess.Popen(
        [sys.executable, __file__, "--floor-relay", str(upstream_port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert relay.stdout is not None
        yield int(relay.stdout.readline())
    finally:
        relay.terminate()
        relay.wait(timeout=10)


# --- the world -----------------------------------------------------------------------------------


def egress_profile(world: World, name: str, extension: str, port: int) -> str:
    """An approved profile `name` on `extension` whose one egress rule is bench.test:PORT pinned
    to 127.0.0.1, with a byte allowance no round reaches."""
    rules = (
        "network:\n  default: deny\n  egress:\n"
        f"    - host: {NAME}\n      ports: [{port}]\n      addresses: [127.0.0.1]\n"
        "  limits:\n    mib: 1048576\n"
    )
    text = (world.config / "profiles" / "bench.yaml").read_text()
    text = text.replace("profile: bench\n", f"profile: {name}\n").replace("ext.bwrap", extension)
    text = text.replace("network:\n  default: deny\n  egress: []\n", rules)
    assert rules in text, text
    (world.config / "profiles" / f"{name}.yaml").write_text(text)
    world.run("ext", "approve", name)
    return name


def docker_image() -> str | None:
    """The base image's id when a Docker daemon answers (scripts/build-base-image), else None."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, check=False).returncode != 0:
        return None
    return run([sys.executable, str(REPO / "scripts" / "build-base-image")]).strip()


def curl_result(text: str) -> tuple[float, int, str]:
    """(MB/s, bytes, HTTP status) of curl's `-w CURL_FORMAT`."""
    speed, size, status = text.split()
    return float(speed) / 1e6, int(float(size)), status


def check(what: str, size: int, status: str, expected: int) -> None:
    if status != "200" or size != expected:
        raise RuntimeError(f"{what}: HTTP {status}, {size} bytes (expected 200, {expected})")


def host_curl(url: str) -> float:
    """MB/s of a download on the host, no proxy."""
    out = run(["curl", "-sS", "--noproxy", "*", "--max-time", "120", "-o", "/dev/null", "-w", CURL_FORMAT, url])
    speed, size, status = curl_result(out)
    check(f"host {url}", size, status, BIG)
    return speed


def sandbox_curl(sandbox: ClientSandbox, url: str, *extra: str) -> float:
    """MB/s of a download inside `sandbox`, through its proxy."""
    argv = ["curl", "-sS", *extra, "--max-time", "120", "-o", "/dev/null", "-w", CURL_FORMAT, url]
    ran = sandbox.exec(argv)
    if ran.status != 0:
        raise RuntimeError(f"curl {extra} {url} in {sandbox.id}: {ran.status} {ran.stderr.decode()[-300:]}")
    speed, size, status = curl_result(ran.stdout.decode())
    check(f"sandbox {url}", size, status, BIG)
    return speed


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)], 3),
        "n": len(ordered),
    }


def latency_loop(argv: list[str], ran_in: ClientSandbox | None) -> list[float]:
    if ran_in is None:
        samples: list[float] = json.loads(run(argv))
        return samples
    ran = ran_in.exec(argv)
    if ran.status != 0:
        raise RuntimeError(f"latency loop in {ran_in.id}: {ran.status} {ran.stderr.decode()[-300:]}")
    inside: list[float] = json.loads(ran.stdout)
    return inside


# --- the measurements ----------------------------------------------------------------------------


def throughput_and_latency(
    sandboxes: dict[str, ClientSandbox], upstream: Upstream, rounds: int, requests: int
) -> dict[str, Any]:
    """Per round, one after another: the direct download, the floor relay's, then each backend's
    plain and tunnelled downloads; and the latency loops, direct then each backend's."""
    port = upstream.port
    direct_url, proxied_url = f"http://127.0.0.1:{port}/big", f"http://{NAME}:{port}/big"
    speeds: dict[str, list[float]] = {"direct": [], "floor_relay": []}
    for backend in sandboxes:
        speeds[f"{backend}_proxy"], speeds[f"{backend}_tunnel"] = [], []
    latencies: dict[str, list[float]] = {"direct": [], "floor_relay": [], **{backend: [] for backend in sandboxes}}
    per_round = max(1, requests // rounds)
    with floor_relay(port) as relay_port:
        for _ in range(rounds):
            speeds["direct"].append(host_curl(direct_url))
            speeds["floor_relay"].append(host_curl(f"http://127.0.0.1:{relay_port}/big"))
            for backend, sandbox in sandboxes.items():
                speeds[f"{backend}_proxy"].append(sandbox_curl(sandbox, proxied_url))
                speeds[f"{backend}_tunnel"].append(sandbox_curl(sandbox, proxied_url, "--proxytunnel"))
            small = [f"http://127.0.0.1:{port}/small", str(per_round), "direct"]
            latencies["direct"] += latency_loop(["/usr/bin/python3", "-c", LATENCY, *small], None)
            relayed = [f"http://127.0.0.1:{relay_port}/small", str(per_round), "direct"]
            latencies["floor_relay"] += latency_loop(["/usr/bin/python3", "-c", LATENCY, *relayed], None)
            for backend, sandbox in sandboxes.items():
                through = [f"http://{NAME}:{port}/small", str(per_round), "proxy"]
                latencies[backend] += latency_loop(["python3", "-c", LATENCY, *through], sandbox)
    results: dict[str, Any] = {"throughput_mb_s": {k: round(statistics.median(v), 1) for k, v in speeds.items()}}
    # Each round's download against that round's direct one, then their median: a machine whose
    # speed drifts between rounds tilts no ratio.
    results["throughput_ratio"] = {
        key: round(statistics.median(v / d for v, d in zip(values, speeds["direct"], strict=True)), 3)
        for key, values in speeds.items()
        if key != "direct"
    }
    results["latency"] = {key: percentiles(values) for key, values in latencies.items()}
    results["added_p50_ms"] = {
        key: round(results["latency"][key]["p50_ms"] - results["latency"]["direct"]["p50_ms"], 3)
        for key in ["floor_relay", *sandboxes]
    }
    return results


SCALE_SCRIPT = (
    f"for i in $(seq {PARALLEL}); do "
    f"curl -sS --max-time 300 -o /dev/null -w '%{{http_code}} %{{size_download}}\\n' http://{NAME}:PORT/part & "
    "done; wait"
)


def scale(client: Client, profile: str, port: int, count: int) -> dict[str, Any]:
    """`count` (50) sandboxes created, then each does 4 parallel 4 MiB downloads, all at once."""
    created: list[ClientSandbox] = []
    results: dict[str, Any] = {"sandboxes": count, "downloads_each": PARALLEL, "mib_each": PART // 2**20}
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=10) as pool:
            futures = [pool.submit(client.create, profile) for _ in range(count)]
        # Every create that succeeded is kept (and torn down below) before a failed one is raised.
        created.extend(future.result() for future in futures if future.exception() is None)
        for future in futures:
            future.result()
        results["create_seconds"] = round(time.perf_counter() - started, 2)
        script = SCALE_SCRIPT.replace("PORT", str(port))

        def downloads(sandbox: ClientSandbox) -> list[str]:
            ran = sandbox.exec(["sh", "-c", script])
            return ran.stdout.decode().split("\n")[:-1] if ran.status == 0 else [f"exit {ran.status}"]

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=count) as pool:
            outcomes = list(pool.map(downloads, created))
        results["wall_seconds"] = round(time.perf_counter() - started, 2)
        lines = [line for outcome in outcomes for line in outcome]
        good = sum(line == f"200 {PART}" for line in lines)
        results["downloads_ok"] = good
        results["downloads_expected"] = count * PARALLEL
        results["failures"] = sorted({line for line in lines if line != f"200 {PART}"})[:5]
        results["all_complete"] = good == count * PARALLEL and len(lines) == good
        results["aggregate_mb_s"] = round(good * PART / 1e6 / results["wall_seconds"], 1)
    finally:
        with ThreadPoolExecutor(max_workers=10) as pool:
            receipts = list(pool.map(teardown, created))
        results["teardown_failures"] = [r for r in receipts if r]
    return results


def teardown(sandbox: ClientSandbox) -> str:
    """Discard `sandbox`; what went wrong, or ""."""
    try:
        receipt = sandbox.teardown(discard=True)
    except Exception as exc:  # every sandbox is torn down; the failure is reported
        return f"{sandbox.id}: {exc}"
    return f"{sandbox.id}: residue {receipt.residue}" if receipt.residue else ""


def measure(world: World, upstream: Upstream, args: argparse.Namespace, image: str | None) -> dict[str, Any]:
    profiles = {"bwrap": egress_profile(world, "egress", "ext.bwrap", upstream.port)}
    if image is not None:
        world.add_docker(image)
        profiles["docker"] = egress_profile(world, "egress-docker", "ext.docker", upstream.port)
    results: dict[str, Any] = {}
    with serving(world) as client:
        sandboxes: dict[str, ClientSandbox] = {}
        try:
            for backend, profile in profiles.items():
                sandboxes[backend] = client.create(profile)
            results.update(throughput_and_latency(sandboxes, upstream, args.rounds, args.requests))
        finally:
            results["teardown_failures"] = [r for r in map(teardown, sandboxes.values()) if r]
        results["scale"] = scale(client, profiles["bwrap"], upstream.port, args.sandboxes)
    return results


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main() -> int:
    parser = argparse.ArgumentParser(description="egress through the broker's proxy vs direct loopback")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="latency requests in all, over the rounds")
    parser.add_argument("--sandboxes", type=int, default=SANDBOXES, help="the scale run's sandboxes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-docker", action="store_true", help="the bwrap backend only")
    parser.add_argument("--floor-relay", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.rounds, args.requests, args.sandboxes) < 1:
        parser.error("--rounds, --requests and --sandboxes must be at least 1")
    if args.floor_relay is not None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_relay(args.floor_relay))
        return 0
    if os.geteuid() != 0:
        print("bench_egress.py runs as root (a root service and its sandboxes)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"rounds": args.rounds, "cpus": os.cpu_count(), "load_before": load()}
    upstream = Upstream()
    try:
        with tempfile.TemporaryDirectory(prefix="sbx-bench-egress-") as tmp:
            Path(tmp).chmod(0o755)  # as root the sandbox's uid must reach the runtime and the state dir
            world = World(Path(tmp))
            image = None if args.no_docker else docker_image()
            results["docker"] = "measured" if image is not None else "skipped (no daemon, or --no-docker)"
            results.update(measure(world, upstream, args, image))
    finally:
        upstream.close()
    results["load_after"] = load()
    report(results, as_json=args.json)
    scale_result = results["scale"]
    broken = not scale_result["all_complete"] or results["teardown_failures"] or scale_result["teardown_failures"]
    return 1 if broken else 0


def report(results: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    print(f"median of {results['rounds']} rounds, {results['cpus']} CPUs; {results['load_before']} before")
    speeds, ratios = results["throughput_mb_s"], results["throughput_ratio"]
    print(f"  {'64 MiB download, host curl from 127.0.0.1 (direct)':55s} {speeds['direct']:8.1f} MB/s")
    print(f"  {'the same through a bare asyncio relay (the floor)':55s} {speeds['floor_relay']:8.1f} MB/s")
    backends = [key for key in results["added_p50_ms"] if key != "floor_relay"]
    for backend in backends:
        print(f"  {backend + ': curl in the sandbox, through its proxy':55s} {speeds[backend + '_proxy']:8.1f} MB/s")
        print(f"  {backend + ': the same, CONNECT tunnel (--proxytunnel)':55s} {speeds[backend + '_tunnel']:8.1f} MB/s")
    latency = results["latency"]
    for key, values in latency.items():
        label = {"direct": "small GET, host urllib direct", "floor_relay": "the same through the bare relay"}.get(
            key, f"{key}: small GET through the proxy"
        )
        print(f"  {label:55s} p50 {values['p50_ms']:6.3f} ms, p90 {values['p90_ms']:6.3f} ms (n={values['n']})")
    scaled = results["scale"]
    print(
        f"  scale: {scaled['sandboxes']} sandboxes x {scaled['downloads_each']} x {scaled['mib_each']} MiB: "
        f"{scaled['downloads_ok']}/{scaled['downloads_expected']} complete and the right size in "
        f"{scaled['wall_seconds']} s ({scaled['aggregate_mb_s']} MB/s in all; creates {scaled['create_seconds']} s)"
    )
    if scaled["failures"]:
        print(f"  scale failures: {scaled['failures']}")
    print(f"  docker: {results['docker']}")
    print(
        f"  (no target) the bare relay vs direct: {ratios['floor_relay']:.2f}x, "
        f"added p50 {results['added_p50_ms']['floor_relay']:.3f} ms"
    )
    for backend in backends:
        for label, ratio in (
            (f"{backend}: proxy vs direct", ratios[f"{backend}_proxy"]),
            (f"{backend}: tunnel vs direct", ratios[f"{backend}_tunnel"]),
        ):
            print(f"  {'PASS' if ratio >= 0.5 else 'MISS'}  {label}: {ratio:.2f}x (target >= 0.5x)")
        added = results["added_p50_ms"][backend]
        print(f"  {'PASS' if added <= 1.0 else 'MISS'}  {backend}: added p50 latency {added:.3f} ms (target <= 1 ms)")
    complete = scaled["all_complete"]
    print(f"  {'PASS' if complete else 'MISS'}  {scaled['sandboxes']} sandboxes x 4 parallel downloads all complete")
    print(f"  {results['load_after']} after")


if __name__ == "__main__":
    sys.exit(main())
