"""`make tour`: the owner's and the caller's first steps on an embedded default, through the real CLI.

Builds a throwaway runtime with `/usr/bin/python3 -m venv --copies`, writes a temporary owner
config from the shipped templates in extensions/, pins the runtime by its tree digest, approves
the extension and the profile, and shows `ext list` and `runtime digest`; then, as a caller,
creates a sandbox, runs commands in it, inspects it, lists it with its usage, copies a file in,
commits it, shows the work, extends the lifetime, exports the work and tears it down;
then does the same with a lease manifest (a shared directory, a provider launch, a tool request
relayed by dispatch-tool) and with a runtime bootstrap. Everything lives in a temporary directory that is
removed at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPOOL = "/run/branchbox/leases/tool-requests/tool"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(argv: list[str], **kwargs: object) -> str:
    proc = subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    return str(proc.stdout)


def caller_tour(sandboxer: list[str], env: dict[str, str], root: Path) -> None:
    """Create a sandbox, run commands in it, inspect it, work in it, take the work out, tear it down."""
    step("a caller: sandboxer create --profile bwrap-local --ttl 3600")
    sandbox_id = run([*sandboxer, "create", "--profile", "bwrap-local", "--ttl", "3600"], env=env).strip()
    print(sandbox_id)
    step("sandboxer exec ID -- ... (who, where, what network, what persists)")
    script = (
        "echo uid=$(id -u) cwd=$(pwd) python=$(command -v python3); "
        "echo interfaces: $(tail -n +3 /proc/net/dev | cut -d: -f1); "
        "echo kept > $HOME/note; touch /opt/sandboxer/runtime/x 2>&1 | sed 's/^/runtime write: /'"
    )
    print(run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", script], env=env), end="")
    print(
        run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", "echo second exec reads: $(cat $HOME/note)"], env=env),
        end="",
    )
    step("sandboxer inspect ID --json (observed, summarized)")
    evidence = json.loads(run([*sandboxer, "inspect", sandbox_id, "--json"], env=env))
    print(
        f"matches plan: {evidence['matches_plan']}; interfaces: {evidence['network']['interfaces']}; "
        f"uid {evidence['user']['uid']}; CapEff {evidence['capabilities']['effective']}; "
        f"no_new_privs {evidence['capabilities']['no_new_privs']}; runtime read-only "
        f"{evidence['runtime']['read_only']}; limits {evidence['limits']['mechanism']}"
    )
    step("sandboxer list; sandboxer usage ID (whose, how old, its work; what it uses now)")
    print(run([*sandboxer, "list"], env=env), end="")
    print(run([*sandboxer, "usage", sandbox_id], env=env), end="")
    step("sandboxer cp FILE ID:/workspace/FILE, a commit inside, sandboxer work ID")
    notes = root / "notes.txt"
    notes.write_text("copied in from the host\n")
    run([*sandboxer, "cp", str(notes), f"{sandbox_id}:/workspace/notes.txt"], env=env)
    commit = "git add notes.txt && git commit -qm 'notes from the host' && git log --oneline -1"
    print(run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", commit], env=env), end="")
    print(run([*sandboxer, "work", sandbox_id], env=env), end="")
    step("sandboxer extend ID 7200 (its lifetime, within the profile's lifetime.max_seconds)")
    print(run([*sandboxer, "extend", sandbox_id, "7200"], env=env), end="")
    step("sandboxer export ID --bundle FILE (its new commits, verified on the host)")
    bundle = root / "work.bundle"
    print(run([*sandboxer, "export", sandbox_id, "--bundle", str(bundle)], env=env), end="")
    print(run(["git", "bundle", "list-heads", str(bundle)]), end="")
    step("sandboxer teardown ID (its work was exported: nothing is lost)")
    print(run([*sandboxer, "teardown", sandbox_id], env=env), end="")


def _file(path: Path, data: bytes, mode: int) -> str:
    path.write_bytes(data)
    path.chmod(mode)
    return hashlib.sha256(data).hexdigest()


def _assignment(repo: Path, run_dir: Path, digests: dict[str, str], endpoint_socket: Path) -> dict[str, object]:
    """The tour's lease manifest: a model identity with one provider value, a shared directory,
    a socket endpoint and the tool-request lease linked to it."""
    materials = run_dir / "materializations"
    token, capability = digests["token"], digests["capability"]
    revision = run(["git", "-C", str(repo), "rev-parse", "HEAD"]).strip()
    expiry = "2099-01-01T00:00:00Z"
    spool = SPOOL
    document = {
        "version": "2", "run_id": "run-1", "lease_id": "assignment-1", "outer_runtime_id": "demo",
        "workspace": "/workspace", "repository": {"path": str(repo), "revision": revision},
        "task_branch": "task/demo", "tunnel_placement": "outer",
        "leases": [
            {"lease_id": "model", "scope": "model-identity", "consumer": "agent", "executable": "env",
             "inherited_environment": [], "expires_at": expiry, "materializations": []},
            {"lease_id": "value", "scope": "provider-environment", "consumer": "agent", "expires_at": expiry,
             "materializations": [{"source_path": str(materials / "token"), "environment_name": "DEMO_TOKEN",
                                   "sha256": token}]},
            {"lease_id": "exchange", "scope": "shared-directory", "consumer": "agent", "expires_at": expiry,
             "materializations": [{"source_path": str(run_dir / "shared" / "exchange"),
                                   "target_path": "/run/branchbox/leases/shared/exchange"}]},
            {"lease_id": "endpoint", "scope": "tool-endpoint", "consumer": "agent", "expires_at": expiry,
             "materializations": [{"source_path": str(endpoint_socket),
                                   "target_path": "/run/branchbox/leases/tool-endpoints/tool.sock"}]},
            {"lease_id": "requests", "scope": "tool-request", "consumer": "agent", "consumer_uid": 1000,
             "endpoint_lease_id": "endpoint", "request_spool_target": spool, "expires_at": expiry,
             "materializations": [{"source_path": str(materials / "capability"),
                                   "target_path": f"{spool}/.capability", "sha256": capability}]},
        ],
    }  # fmt: skip
    return document


def lease_tour(sandboxer: list[str], env: dict[str, str], root: Path, repo: Path) -> None:
    """A run an orchestrator signed off: manifest check, create --manifest, a shared directory,
    a provider launch, a tool request relayed by dispatch-tool; then a runtime bootstrap."""
    step("a lease manifest: a run directory with a shared directory, a provider value and a tool endpoint")
    run_dir = root / "managed" / "run-1"
    run_dir.mkdir(parents=True, mode=0o700)
    (root / "managed").chmod(0o700)
    materials = run_dir / "materializations"
    materials.mkdir(mode=0o700)
    token = _file(materials / "token", b"demo-provider-value", 0o600)
    capability = _file(materials / "capability", b"demo-capability-" + b"x" * 24, 0o600)
    (run_dir / "shared").mkdir(mode=0o700)
    (run_dir / "shared" / "exchange").mkdir()
    (run_dir / "shared" / "exchange").chmod(0o755)
    (run_dir / "shared" / "exchange" / "evidence.txt").write_text("written outside, read inside\n")
    (run_dir / "endpoints").mkdir(mode=0o700)
    endpoint_socket = run_dir / "endpoints" / "tool.sock"
    endpoint = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "tool-endpoint" / "endpoint.py"), "--socket", str(endpoint_socket)],
        stdout=subprocess.PIPE,
    )
    try:
        if endpoint.stdout is not None:
            endpoint.stdout.readline()  # "ready": the socket exists
        document = _assignment(repo, run_dir, {"token": token, "capability": capability}, endpoint_socket)
        spool = SPOOL
        assignment = run_dir / "assignment.json"
        _file(assignment, json.dumps(document, indent=2).encode(), 0o600)
        step("sandboxer manifest check FILE")
        print(run([*sandboxer, "manifest", "check", str(assignment)], env=env), end="")
        step("sandboxer create --profile bwrap-local --manifest FILE")
        sandbox_id = run([*sandboxer, "create", "--profile", "bwrap-local", "--manifest", str(assignment)], env=env)
        sandbox_id = sandbox_id.strip()
        print(sandbox_id)
        step("inside: the shared directory (read-only), the spool, the task branch")
        script = (
            "cat /run/branchbox/leases/shared/exchange/evidence.txt; "
            "touch /run/branchbox/leases/shared/exchange/x 2>&1 | sed 's/^/write: /'; "
            f"ls -la {spool}; git -C /workspace branch --show-current; echo DEMO_TOKEN=${{DEMO_TOKEN:-absent}}"
        )
        print(run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", script], env=env), end="")
        step("a provider launch: exec --consumer agent --executable env (its value only here)")
        print(run([*sandboxer, "exec", sandbox_id, "--consumer", "agent", "--executable", "env", "--", "env"], env=env))
        step("the consumer spools a request; sandboxer dispatch-tool relays it to the endpoint")
        request = (
            f"cap=$(cat {spool}/.capability); cd {spool}/requests && umask 077 && "
            'printf \'{"version":"1","run_id":"run-1","lease_id":"requests","consumer":"agent",'
            '"request_id":"r1","capability":"%s","payload":{"hello":"endpoint"}}\' "$cap" '
            "> .r1.tmp && mv .r1.tmp r1.json"
        )
        run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", request], env=env)
        relay = ["dispatch-tool", sandbox_id, "--lease", "requests", "--request-id", "r1", "--wait-seconds", "5"]
        print(run([*sandboxer, *relay], env=env), end="")
        print(run([*sandboxer, "exec", sandbox_id, "--", "cat", f"{spool}/responses/r1.json"], env=env), end="")
        step("sandboxer teardown ID (spool, ledger and the run's materializations go too)")
        print(run([*sandboxer, "teardown", sandbox_id], env=env), end="")
    finally:
        endpoint.terminate()
        endpoint.wait()
    bootstrap_tour(sandboxer, env, root)


def bootstrap_tour(sandboxer: list[str], env: dict[str, str], root: Path) -> None:
    """Check a runtime bootstrap and deliver it into a sandbox."""
    step("a runtime bootstrap: sandboxer bootstrap check, create --bootstrap")
    document_bytes = json.dumps(
        {
            "version": "1",
            "core_url": "https://core.example/api/v1",
            "device_id": "0b6f9e0e-3c0a-4a57-9d3e-8a8f0b6f9e0e",
            "credential": "demo-credential",
            "environment_id": "1b6f9e0e-3c0a-4a57-9d3e-8a8f0b6f9e0e",
            "session_id": "2b6f9e0e-3c0a-4a57-9d3e-8a8f0b6f9e0e",
            "workspace": "/workspace",
            "suspend_control": True,
        }
    ).encode()
    bootstrap = root / "runtime-bootstrap.json"
    _file(bootstrap, document_bytes, 0o600)
    print(run([*sandboxer, "bootstrap", "check", str(bootstrap)], env=env), end="")
    sandbox_id = run([*sandboxer, "create", "--profile", "bwrap-local", "--bootstrap", str(bootstrap)], env=env)
    sandbox_id = sandbox_id.strip()
    script = "stat -c '%a %U %n' $HOME/runtime-bootstrap.json /run/sandboxer/state/suspend"
    print(run([*sandboxer, "exec", sandbox_id, "--", "sh", "-c", script], env=env), end="")
    print(run([*sandboxer, "teardown", sandbox_id], env=env), end="")


def main() -> int:
    """Run the tour; exit non-zero if any step fails."""
    with tempfile.TemporaryDirectory(prefix="sandboxer-demo-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # as root, the sandbox's own uid must reach the runtime and the state dir
        config, state, runtime, repo = root / "config", root / "state", root / "runtime", root / "repo"
        sandboxer = [sys.executable, "-m", "sandboxer", "--config-dir", str(config), "--state-dir", str(state)]
        # In-process: as root, the command would start a service for the tour's state dir, which
        # outlives the tour's temporary directory until its idle exit.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "SANDBOXER_NO_SERVICE": "1"}

        step("build a throwaway runtime: /usr/bin/python3 -m venv --copies")
        run(["/usr/bin/python3", "-m", "venv", "--copies", "--without-pip", str(runtime)])
        print(f"runtime at {runtime}")

        step("pin it: sandboxer runtime digest")
        digest = run([*sandboxer, "runtime", "digest", str(runtime)], env=env).strip()
        print(digest)

        step("a throwaway Git repository for the profile's workspace")
        git = ["git", "-c", "init.defaultBranch=main", "-c", "user.name=demo", "-c", "user.email=demo@localhost"]
        repo.mkdir()
        run([*git, "init", "-q", str(repo)])
        (repo / "README").write_text("demo workspace\n")
        run([*git, "-C", str(repo), "add", "README"])
        run([*git, "-C", str(repo), "commit", "-qm", "demo"])

        step("write the owner config from extensions/ (the shipped templates)")
        (config / "extensions").mkdir(parents=True)
        (config / "profiles").mkdir()
        config.chmod(0o700)
        template = (REPO / "extensions" / "ext.bwrap.yaml").read_text()
        template = template.replace("/srv/sandboxer/runtimes/demo", str(runtime)).replace("0" * 64, digest)
        (config / "extensions" / "ext.bwrap.yaml").write_text(template)
        profile = (REPO / "extensions" / "profiles" / "bwrap-local.yaml").read_text()
        (config / "profiles" / "bwrap-local.yaml").write_text(profile.replace("/srv/repos/demo", str(repo)))
        print(run([*sandboxer, "ext", "check", str(config / "profiles" / "bwrap-local.yaml")], env=env), end="")

        step("before approval: sandboxer ext list")
        print(run([*sandboxer, "ext", "list"], env=env), end="")

        step("approve: sandboxer ext approve ext.bwrap && sandboxer ext approve bwrap-local")
        print(run([*sandboxer, "ext", "approve", "ext.bwrap"], env=env), end="")
        print(run([*sandboxer, "ext", "approve", "bwrap-local"], env=env), end="")

        step("after approval: sandboxer ext list")
        print(run([*sandboxer, "ext", "list"], env=env), end="")

        step("re-verify the pin (warm, from the stat cache) and in full")
        print(run([*sandboxer, "runtime", "digest", str(runtime)], env=env), end="")
        print(run([*sandboxer, "runtime", "digest", "--full", str(runtime)], env=env), end="")

        caller_tour(sandboxer, env, root)
        lease_tour(sandboxer, env, root, repo)

        step("a one-byte change to the profile voids its approval")
        path = config / "profiles" / "bwrap-local.yaml"
        path.write_text(path.read_text().replace("pids: 512", "pids: 513"))
        print(run([*sandboxer, "ext", "list"], env=env), end="")

    print("\ntour complete: the temporary config, state and runtime were removed.")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(f"tour failed: {' '.join(map(str, exc.cmd))}\n{exc.stderr}")
        sys.exit(1)
