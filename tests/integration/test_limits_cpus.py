"""limits.cpus: a CPU quota the kernel holds (a CFS quota in the sandbox's cpu cgroup on bwrap,
NanoCpus on Docker), shown by inspect and usage, and counted by `nproc` inside (OMP_NUM_THREADS);
refused (3) where no cgroup can hold it, unless the profile allows best effort.

The quota is measured, not timed: a busy loop inside runs for 5 s of wall time and reports the
CPU time it got; the ratio is what the quota allows (0.5 of a core), whatever the machine's speed.
"""

from __future__ import annotations

import json

from tests.integration.conftest import SandboxBroker, backend_profile_text

BUSY = """
import json, time
wall, cpu = time.monotonic(), time.process_time()
while time.monotonic() - wall < 5:
    pass
print(json.dumps({"wall": time.monotonic() - wall, "cpu": time.process_time() - cpu}))
"""


def _profile(broker: SandboxBroker, name: str, limits: str) -> str:
    if not (broker.config / "profiles" / f"{name}.yaml").exists():
        broker.write_profile(name, backend_profile_text(broker, name, broker.repo, f"limits:\n{limits}"))
        broker.approve(name)
    return name


def test_a_busy_loop_gets_half_a_core_under_cpus_half(sbx_root: SandboxBroker) -> None:
    broker = sbx_root
    sandbox = broker.create(_profile(broker, "half-core", "  cpus: 0.5\n"))
    done = broker.exec(sandbox, "python3", "-c", BUSY)
    assert done.status == 0, done.stderr
    measured = json.loads(done.stdout)
    ratio = measured["cpu"] / measured["wall"]
    assert 0.3 <= ratio <= 0.7, f"the loop got {ratio:.2f} of a core under a quota of 0.5"
    evidence = json.loads(broker.run("inspect", sandbox, "--json").stdout)
    assert evidence["matches_plan"] is True, evidence["differences"]
    assert evidence["limits"]["cpus"] == 0.5
    assert evidence["usage"]["cpus"] == 0.5
    assert evidence["usage"]["cpu_seconds"] >= measured["cpu"]
    nproc = broker.exec(sandbox, "nproc")
    assert (nproc.status, nproc.stdout) == (0, "1\n")


def test_without_a_quota_nothing_is_held_back(sbx_root: SandboxBroker) -> None:
    """The same loop with no limits.cpus: no quota in the evidence, no OMP_NUM_THREADS, and a
    loop that gets more than the quota would give it (a control for the test above)."""
    broker = sbx_root
    sandbox = broker.create()
    evidence = json.loads(broker.run("inspect", sandbox, "--json").stdout)
    assert evidence["limits"]["cpus"] is None
    assert "OMP_NUM_THREADS" not in evidence["env_names"]
    done = broker.exec(sandbox, "python3", "-c", BUSY)
    assert done.status == 0, done.stderr
    measured = json.loads(done.stdout)
    assert measured["cpu"] / measured["wall"] > 0.7


def test_a_quota_needs_a_cgroup_unless_best_effort(sb: SandboxBroker) -> None:
    """As root the quota is a cgroup's. An unprivileged broker has no cgroup of its own here:
    limits.cpus refuses the create (3) with the reason and leaves nothing; with best_effort the
    sandbox runs under rlimits, without the quota."""
    broker = sb
    profile = _profile(broker, "quota", "  cpus: 0.5\n")
    if not broker.as_user:
        evidence = json.loads(broker.run("inspect", broker.create(profile), "--json").stdout)
        assert evidence["limits"]["mechanism"].startswith("cgroup-")
        assert evidence["limits"]["cpus"] == 0.5
        return
    refused = broker.run("create", "--profile", profile)
    assert refused.status == 3, refused.stderr
    assert refused.stderr == (
        "sandboxer: limits.cpus: a CPU quota needs a cgroup, and this host offers none; set limits.best_effort\n"
    )
    assert not any((broker.state / "sandboxes").glob("[0-9a-f]*"))
    relaxed = _profile(broker, "quota-best-effort", "  cpus: 0.5\n  best_effort: true\n")
    evidence = json.loads(broker.run("inspect", broker.create(relaxed), "--json").stdout)
    assert evidence["limits"]["mechanism"] == "rlimit"
    assert evidence["usage"]["source"] == "processes"
