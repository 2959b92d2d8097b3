"""`make tour`: the owner's and the caller's first steps on an embedded default, through the real CLI.

Builds a throwaway runtime with `/usr/bin/python3 -m venv --copies`, writes a temporary owner
config from the shipped templates in extensions/, pins the runtime by its tree digest, approves
the extension and the profile, and shows `ext list` and `runtime digest`; then, as a caller,
creates a sandbox, runs commands in it, inspects it and tears it down. Everything lives in a temporary directory that is
removed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(argv: list[str], **kwargs: object) -> str:
    proc = subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    return str(proc.stdout)


def caller_tour(sandboxer: list[str], env: dict[str, str]) -> None:
    """Create a sandbox, run commands in it, inspect it, tear it down."""
    step("a caller: sandboxer create --profile bwrap-local")
    sandbox_id = run([*sandboxer, "create", "--profile", "bwrap-local"], env=env).strip()
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
    step("sandboxer teardown ID")
    print(run([*sandboxer, "teardown", sandbox_id], env=env), end="")


def main() -> int:
    """Run the tour; exit non-zero if any step fails."""
    with tempfile.TemporaryDirectory(prefix="sandboxer-demo-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # as root, the sandbox's own uid must reach the runtime and the state dir
        config, state, runtime, repo = root / "config", root / "state", root / "runtime", root / "repo"
        sandboxer = [sys.executable, "-m", "sandboxer", "--config-dir", str(config), "--state-dir", str(state)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}

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

        caller_tour(sandboxer, env)

        step("a one-byte change to the profile voids its approval")
        path = config / "profiles" / "bwrap-local.yaml"
        path.write_text(path.read_text().replace("pids: 512", "pids: 513"))
        print(run([*sandboxer, "ext", "list"], env=env), end="")

    print("\ndemo complete: the temporary config, state and runtime were removed.")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(f"demo failed: {' '.join(map(str, exc.cmd))}\n{exc.stderr}")
        sys.exit(1)
