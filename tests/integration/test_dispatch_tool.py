"""`dispatch-tool` end to end (docs/tool-requests.md, the spool part of the managed-runtime
manifest): a real consumer inside a manifest sandbox spools a request, the broker relays it to the
reference endpoint (examples/tool-endpoint/endpoint.py) on the host and writes the response back.
On bwrap as root and on Docker: the happy path, not-pending, every terminal refusal and the id it
blocks, tool-level declines, a dispatcher killed mid-relay with and without exact-digest replay,
cached responses, transport failures, and teardown of the ledger and the spool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import Result
from tests.integration.conftest import Endpoints, SandboxBroker, log_lines
from tests.integration.test_manifest_sandboxes import SPOOL, create, docker, prepare, record_of
from tests.manifest_samples import ENDPOINT, REQUEST, RUN_ID, Run, build_run

LEASE = "delivery_requests"
CONSUMER = "coding-agent"
CONSUMER_UID = 1000
REPLAY = "exact-digest-replay-v1"
CAP_MARK = "@CAPABILITY@"
NOT_PENDING = {"status": "not-pending", "retryable": True}
DECLINE = {"declined": True, "reason": "optional upload declined; use the artifact link"}


# ------------------------------------------------------------------------------------ helpers


def socket_path(run: Run) -> Path:
    return run.source(ENDPOINT)


def setup(
    broker: SandboxBroker, base: Path, endpoints: Endpoints, *, replay: bool = False, mode: str = "echo"
) -> tuple[Run, str]:
    """A v2 run for this broker (replay policy set or its key removed), the endpoint started on
    the linked socket, the sandbox created from the manifest."""
    run = build_run(base, "2")
    prepare(run, broker)
    lease = run.doc["leases"][REQUEST]
    assert lease["lease_id"] == LEASE
    assert lease["request_spool_target"] == SPOOL
    if replay:
        lease["replay_policy"] = REPLAY
    else:
        lease.pop("replay_policy", None)
    run.save()
    endpoints.start(socket_path(run), mode)
    checked = broker.run("manifest", "check", str(run.assignment), "--json")
    assert checked.status == 0, (checked.stdout, checked.stderr)
    sandbox_id = create(broker, run)
    return run, sandbox_id


def envelope(request_id: str, payload: Any = None, **changes: Any) -> dict[str, Any]:
    """A request envelope; its capability is a mark the consumer replaces with `.capability`."""
    doc: dict[str, Any] = {
        "version": "1",
        "run_id": RUN_ID,
        "lease_id": LEASE,
        "consumer": CONSUMER,
        "request_id": request_id,
        "capability": CAP_MARK,
        "payload": {"action": "deliver", "artifact": f"artifact-{request_id}"} if payload is None else payload,
    }
    doc.update(changes)
    return doc


def stripped(doc: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in doc.items() if key != "capability"}


def spool(broker: SandboxBroker, sandbox_id: str, request_id: str, doc: dict[str, Any], mode: str = "600") -> None:
    """The consumer, inside: read the capability, write a temporary file of `mode` in requests/,
    then rename it to requests/<R>.json."""
    script = f"""
set -e
cd {SPOOL}
cap=$(cat .capability)
umask 077
tmp=requests/.tmp-{request_id}-$$
sed "s/{CAP_MARK}/$cap/" > "$tmp"
chmod {mode} "$tmp"
mv -f "$tmp" requests/{request_id}.json
"""
    wrote = broker.sh(sandbox_id, script, stdin=json.dumps(doc).encode())
    assert wrote.status == 0, (wrote.stdout, wrote.stderr)


def inside(broker: SandboxBroker, sandbox_id: str, script: str) -> str:
    result = broker.sh(sandbox_id, f"cd {SPOOL} || exit 90\n{script}")
    assert result.status == 0, (script, result.stdout, result.stderr)
    return result.stdout


def response_of(broker: SandboxBroker, sandbox_id: str, request_id: str) -> tuple[str, dict[str, Any]]:
    """The response file inside: "mode uid" and its JSON."""
    out = inside(broker, sandbox_id, f"stat -c '%a %u' responses/{request_id}.json; cat responses/{request_id}.json")
    head, _, body = out.partition("\n")
    return head, json.loads(body)


def response_text(broker: SandboxBroker, sandbox_id: str, request_id: str) -> str | None:
    """The response file's mode, owner and bytes inside, or None when there is none."""
    path = f"responses/{request_id}.json"
    out = inside(broker, sandbox_id, f"if test -e {path}; then stat -c '%a %u' {path}; cat {path}; else echo none; fi")
    return None if out == "none\n" else out


def has_response(broker: SandboxBroker, sandbox_id: str, request_id: str) -> bool:
    out = inside(broker, sandbox_id, f"if test -e responses/{request_id}.json; then echo yes; else echo no; fi")
    return out.strip() == "yes"


def pending(broker: SandboxBroker, sandbox_id: str) -> list[str]:
    return inside(broker, sandbox_id, "ls -A requests").split()


def dispatch(broker: SandboxBroker, sandbox_id: str, request_id: str, wait: int | str = 0) -> Result:
    return broker.run(
        "dispatch-tool", sandbox_id, "--lease", LEASE, "--request-id", request_id, "--wait-seconds", str(wait), "--json"
    )


def dispatch_proc(broker: SandboxBroker, sandbox_id: str, request_id: str, wait: int) -> subprocess.Popen[bytes]:
    argv = broker.argv(
        "dispatch-tool", sandbox_id, "--lease", LEASE, "--request-id", request_id, "--wait-seconds", str(wait), "--json"
    )
    return subprocess.Popen(argv, env=broker.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(proc: subprocess.Popen[bytes], timeout: float = 60) -> Result:
    out, err = proc.communicate(timeout=timeout)
    return Result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def assert_dispatched(result: Result, request_id: str, *, cached: bool) -> dict[str, Any]:
    assert result.status == 0, (result.status, result.stdout, result.stderr)
    doc: dict[str, Any] = result.json()
    assert doc["status"] == "dispatched", doc
    assert doc["cached"] is cached, doc
    assert doc["request_id"] == request_id, doc
    assert doc["lease_id"] == LEASE, doc
    assert doc["response"] == f"{SPOOL}/responses/{request_id}.json", doc
    return doc


def assert_terminal(result: Result, *statuses: int) -> None:
    """A terminal refusal: one of `statuses` (3 unless said), never the retryable 75."""
    allowed = statuses or (3,)
    assert result.status != 75, ("retryable status for a terminal refusal", result.stdout, result.stderr)
    assert result.status in allowed, (result.status, result.stdout, result.stderr)
    assert result.stderr.startswith("sandboxer:"), result.stderr


def assert_echo_response(
    broker: SandboxBroker, sandbox_id: str, doc: dict[str, Any], *, count: int = 1
) -> dict[str, Any]:
    """responses/<R>.json inside: 0400, the consumer's, correlated, the echo endpoint's payload."""
    head, response = response_of(broker, sandbox_id, doc["request_id"])
    assert head == f"400 {CONSUMER_UID}", head
    assert response == {**stripped(doc), "payload": {"received": doc["payload"], "count": count}}, response
    return response


def assert_blocked(
    broker: SandboxBroker, sandbox_id: str, endpoints: Endpoints, request_id: str, *statuses: int
) -> None:
    """A correct request under the same id is refused now, terminally, without reaching the
    (running, echoing) endpoint and without a new or changed response."""
    lines_before = endpoints.total_lines()
    response_before = response_text(broker, sandbox_id, request_id)
    spool(broker, sandbox_id, request_id, envelope(request_id))
    again = dispatch(broker, sandbox_id, request_id, wait=2)
    assert_terminal(again, *statuses)
    assert endpoints.total_lines() == lines_before, "a blocked id reached the endpoint"
    assert response_text(broker, sandbox_id, request_id) == response_before, "a blocked id got a response"


# ------------------------------------------------------------------------------------ happy path


def test_dispatch_relays_a_consumer_request(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints)
    capability = run.source(REQUEST).read_bytes().decode()
    assert inside(broker, sandbox_id, "cat .capability") == capability
    doc = envelope("artifact-delivery", {"files": ["a.txt", "b.txt"], "note": "ünïcödé", "n": 3})
    spool(broker, sandbox_id, "artifact-delivery", doc)
    assert pending(broker, sandbox_id) == ["artifact-delivery.json"]

    result = dispatch(broker, sandbox_id, "artifact-delivery")
    out = assert_dispatched(result, "artifact-delivery", cached=False)
    assert out["sandbox"] == sandbox_id

    lines = log_lines(endpoints.log)
    assert len(lines) == 1, lines
    assert json.loads(lines[0]) == stripped(doc)
    assert capability not in endpoints.log.read_text(), "the capability reached the endpoint"
    assert capability not in result.stdout + result.stderr

    assert_echo_response(broker, sandbox_id, doc)
    assert pending(broker, sandbox_id) == [], "the request file is still pending"
    assert inside(broker, sandbox_id, "id -u").strip() == str(CONSUMER_UID)


def test_dispatch_waits_for_a_request_written_later(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    proc = dispatch_proc(broker, sandbox_id, "later", wait=10)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "the dispatcher did not wait for the request"
        assert log_lines(endpoints.log) == []
        doc = envelope("later")
        spool(broker, sandbox_id, "later", doc)
        result = finished(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_dispatched(result, "later", cached=False)
    lines = log_lines(endpoints.log)
    assert [json.loads(line) for line in lines] == [stripped(doc)]
    assert_echo_response(broker, sandbox_id, doc)


# ------------------------------------------------------------------------------------ not pending, usage


def test_nothing_pending_is_retryable(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    started = time.monotonic()
    result = dispatch(broker, sandbox_id, "nothing-yet", wait=1)
    elapsed = time.monotonic() - started
    assert result.status == 75, (result.status, result.stdout, result.stderr)
    assert json.loads(result.stdout) == NOT_PENDING, result.stdout
    assert 1.0 <= elapsed < 10, f"not-pending after {elapsed:.2f}s with --wait-seconds 1"
    assert log_lines(endpoints.log) == []

    for bad in ("301", "-1"):
        usage = dispatch(broker, sandbox_id, "nothing-yet", wait=bad)
        assert usage.status == 2, (bad, usage.status, usage.stdout, usage.stderr)

    # Not blocked by having been absent: it is dispatched once it is there.
    doc = envelope("nothing-yet")
    spool(broker, sandbox_id, "nothing-yet", doc)
    assert_dispatched(dispatch(broker, sandbox_id, "nothing-yet"), "nothing-yet", cached=False)
    assert_echo_response(broker, sandbox_id, doc)


# ------------------------------------------------------------------------------------ terminal violations


def test_symlink_request_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    script = f"""
set -e
cap=$(cat .capability)
umask 077
sed "s/{CAP_MARK}/$cap/" > $HOME/valid.json
chmod 600 $HOME/valid.json
ln -s $HOME/valid.json requests/.link
mv requests/.link requests/linked.json
test -L requests/linked.json
"""
    inside_doc = json.dumps(envelope("linked")).encode()
    made = broker.sh(sandbox_id, f"cd {SPOOL} || exit 90\n{script}", stdin=inside_doc)
    assert made.status == 0, (made.stdout, made.stderr)

    assert_terminal(dispatch(broker, sandbox_id, "linked"))
    assert log_lines(endpoints.log) == [], "the endpoint was contacted for a symlink"
    assert not has_response(broker, sandbox_id, "linked")
    assert_blocked(broker, sandbox_id, endpoints, "linked")


def test_mode_0644_request_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    spool(broker, sandbox_id, "wide", envelope("wide"), mode="644")
    assert inside(broker, sandbox_id, "stat -c %a requests/wide.json").strip() == "644"

    assert_terminal(dispatch(broker, sandbox_id, "wide"))
    assert log_lines(endpoints.log) == [], "the endpoint was contacted for a 0644 request"
    assert_blocked(broker, sandbox_id, endpoints, "wide")


def test_oversized_request_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    doc = envelope("big", {"blob": "x" * (257 * 1024)})
    spool(broker, sandbox_id, "big", doc)
    size = int(inside(broker, sandbox_id, "stat -c %s requests/big.json").strip())
    assert size > 256 * 1024

    assert_terminal(dispatch(broker, sandbox_id, "big"))
    assert log_lines(endpoints.log) == [], "the endpoint was contacted for an oversized request"
    assert_blocked(broker, sandbox_id, endpoints, "big")


def test_seventeen_pending_files_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    inside(broker, sandbox_id, "umask 077; for i in $(seq 1 16); do echo '{}' > requests/other-$i.json; done")
    spool(broker, sandbox_id, "crowded", envelope("crowded"))
    assert len(pending(broker, sandbox_id)) == 17

    assert_terminal(dispatch(broker, sandbox_id, "crowded"))
    assert log_lines(endpoints.log) == [], "the endpoint was contacted over the pending-file quota"
    inside(broker, sandbox_id, "rm -f requests/other-*.json")
    assert_blocked(broker, sandbox_id, endpoints, "crowded")


def test_wrong_capability_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints)
    real = run.source(REQUEST).read_bytes().decode()
    forged = "cap-" + "0" * 40
    assert forged != real
    spool(broker, sandbox_id, "forged", envelope("forged", capability=forged))

    result = dispatch(broker, sandbox_id, "forged")
    assert_terminal(result)
    assert real not in result.stdout + result.stderr
    assert log_lines(endpoints.log) == [], "the endpoint was contacted with a wrong capability"
    assert_blocked(broker, sandbox_id, endpoints, "forged")


def test_extra_envelope_field_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    spool(broker, sandbox_id, "extra", envelope("extra", extra="field"))

    assert_terminal(dispatch(broker, sandbox_id, "extra"))
    assert log_lines(endpoints.log) == [], "the endpoint was contacted for a bad envelope"
    assert_blocked(broker, sandbox_id, endpoints, "extra")


def test_uncorrelated_response_is_terminal_and_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints, mode="wrong-ids")
    doc = envelope("mismatch")
    spool(broker, sandbox_id, "mismatch", doc)

    assert_terminal(dispatch(broker, sandbox_id, "mismatch"))
    assert [json.loads(line) for line in log_lines(endpoints.log)] == [stripped(doc)]
    assert not has_response(broker, sandbox_id, "mismatch"), "an uncorrelated response was written"

    endpoints.start(socket_path(run), "echo")
    assert_blocked(broker, sandbox_id, endpoints, "mismatch")
    assert endpoints.total_lines() == 1


def test_changed_request_under_a_dispatched_id_is_terminal(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    doc = envelope("same-id", {"version": 1})
    spool(broker, sandbox_id, "same-id", doc)
    assert_dispatched(dispatch(broker, sandbox_id, "same-id"), "same-id", cached=False)
    first = assert_echo_response(broker, sandbox_id, doc)

    spool(broker, sandbox_id, "same-id", envelope("same-id", {"version": 2}))
    assert_terminal(dispatch(broker, sandbox_id, "same-id"))
    assert len(log_lines(endpoints.log)) == 1, "the changed request reached the endpoint"
    head, response = response_of(broker, sandbox_id, "same-id")
    assert (head, response) == (f"400 {CONSUMER_UID}", first), "the response changed"

    assert_blocked(broker, sandbox_id, endpoints, "same-id")
    assert len(log_lines(endpoints.log)) == 1


# ------------------------------------------------------------------------------------ decline


def test_tool_level_decline_is_a_successful_dispatch(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints, mode="decline")
    doc = envelope("optional-upload")
    spool(broker, sandbox_id, "optional-upload", doc)

    assert_dispatched(dispatch(broker, sandbox_id, "optional-upload"), "optional-upload", cached=False)
    assert len(log_lines(endpoints.log)) == 1
    head, response = response_of(broker, sandbox_id, "optional-upload")
    assert head == f"400 {CONSUMER_UID}", head
    assert response == {**stripped(doc), "payload": DECLINE}, response


# ------------------------------------------------------------------------------------ killed dispatcher


def kill_mid_relay(broker: SandboxBroker, run: Run, sandbox_id: str, endpoints: Endpoints, doc: dict[str, Any]) -> None:
    """Start the dispatcher against the slow endpoint, wait for the endpoint to have the request
    (the claim is durable by then), SIGKILL the dispatcher, restart the endpoint in echo mode."""
    spool(broker, sandbox_id, doc["request_id"], doc)
    proc = dispatch_proc(broker, sandbox_id, doc["request_id"], wait=5)
    try:
        deadline = time.monotonic() + 20
        while not log_lines(endpoints.log) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, ("the dispatcher ended before it was killed", finished(proc))
        assert [json.loads(line) for line in log_lines(endpoints.log)] == [stripped(doc)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL
    assert pending(broker, sandbox_id) == [], "the claimed request is still pending"
    assert not has_response(broker, sandbox_id, doc["request_id"])
    endpoints.start(socket_path(run), "echo")


def test_killed_dispatch_without_replay_policy_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints, replay=False, mode="slow")
    doc = envelope("interrupted")
    kill_mid_relay(broker, run, sandbox_id, endpoints, doc)

    retried = dispatch(broker, sandbox_id, "interrupted", wait=2)
    assert_terminal(retried, 3, 5)
    assert log_lines(endpoints.log) == [], "an interrupted relay was replayed without the policy"
    assert not has_response(broker, sandbox_id, "interrupted")
    assert_terminal(dispatch(broker, sandbox_id, "interrupted", wait=2), 3, 5)
    assert_blocked(broker, sandbox_id, endpoints, "interrupted", 3, 5)
    assert endpoints.total_lines() == 1


def test_killed_dispatch_with_replay_policy_retries_the_persisted_request(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints, replay=True, mode="slow")
    doc = envelope("replayed")
    kill_mid_relay(broker, run, sandbox_id, endpoints, doc)

    retried = dispatch(broker, sandbox_id, "replayed", wait=5)
    assert_dispatched(retried, "replayed", cached=False)
    assert [json.loads(line) for line in log_lines(endpoints.log)] == [stripped(doc)]
    assert endpoints.total_lines() == 2, "the endpoint saw the request more than once more"
    assert_echo_response(broker, sandbox_id, doc, count=1)


# ------------------------------------------------------------------------------------ cached responses


def test_cached_response_is_returned_without_the_endpoint(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    doc = envelope("cached")
    spool(broker, sandbox_id, "cached", doc)
    assert_dispatched(dispatch(broker, sandbox_id, "cached"), "cached", cached=False)
    first = assert_echo_response(broker, sandbox_id, doc)
    endpoints.stop()

    again = dispatch(broker, sandbox_id, "cached")
    assert_dispatched(again, "cached", cached=True)
    assert assert_echo_response(broker, sandbox_id, doc) == first

    spool(broker, sandbox_id, "cached", doc)
    respooled = dispatch(broker, sandbox_id, "cached", wait=2)
    assert_dispatched(respooled, "cached", cached=True)
    assert assert_echo_response(broker, sandbox_id, doc) == first
    assert pending(broker, sandbox_id) == [], "the re-spooled request is still pending"
    assert endpoints.total_lines() == 1


# ------------------------------------------------------------------------------------ transport failures


def test_transport_failure_without_replay_policy_blocks_the_id(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints, replay=False, mode="close")
    doc = envelope("dropped")
    spool(broker, sandbox_id, "dropped", doc)

    failed = dispatch(broker, sandbox_id, "dropped", wait=1)
    assert failed.status not in (0, 75), (failed.status, failed.stdout, failed.stderr)
    assert len(log_lines(endpoints.log)) == 1, "the relay was retried without the policy"
    assert not has_response(broker, sandbox_id, "dropped")

    endpoints.start(socket_path(run), "echo")
    assert_terminal(dispatch(broker, sandbox_id, "dropped", wait=2), 3, 5)
    assert_blocked(broker, sandbox_id, endpoints, "dropped", 3, 5)
    assert endpoints.total_lines() == 1


def test_transport_failure_with_replay_policy_is_retried_later(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints
) -> None:
    broker = sbx_root
    run, sandbox_id = setup(broker, base, endpoints, replay=True, mode="close")
    doc = envelope("flaky")
    spool(broker, sandbox_id, "flaky", doc)

    failed = dispatch(broker, sandbox_id, "flaky", wait=1)
    assert failed.status not in (0, 75), (failed.status, failed.stdout, failed.stderr)
    closed = [json.loads(line) for line in log_lines(endpoints.log)]
    assert closed, "the endpoint was not contacted"
    assert all(line == stripped(doc) for line in closed), closed
    assert not has_response(broker, sandbox_id, "flaky")

    endpoints.start(socket_path(run), "echo")
    retried = dispatch(broker, sandbox_id, "flaky", wait=5)
    assert_dispatched(retried, "flaky", cached=False)
    assert [json.loads(line) for line in log_lines(endpoints.log)] == [stripped(doc)]
    assert_echo_response(broker, sandbox_id, doc)


# ------------------------------------------------------------------------------------ teardown


def test_teardown_removes_the_ledger_and_the_spool(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    doc = envelope("torn")
    spool(broker, sandbox_id, "torn", doc)
    assert_dispatched(dispatch(broker, sandbox_id, "torn"), "torn", cached=False)
    ledger = broker.sandbox_dir(sandbox_id) / "ledger"
    assert ledger.is_dir(), "no replay ledger after a dispatch"
    spools = record_of(broker, sandbox_id)["manifest"]["spools"]
    assert len(spools) == 1
    spool_source = spools[0]["source"]

    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, (teardown.stdout, teardown.stderr)
    receipt = teardown.json()
    assert receipt["residue"] == []
    removed = receipt["removed"]
    assert any(item.startswith("replay ledger") for item in removed), removed
    assert any(spool_source in item and "spool" in item for item in removed), removed
    assert not os.path.lexists(ledger)
    assert not broker.sandbox_dir(sandbox_id).exists()
    if broker.backend == "docker":
        gone = subprocess.run(["docker", "volume", "inspect", spool_source], capture_output=True, check=False)
        assert gone.returncode != 0, "the spool volume is still there"
        assert spool_source not in docker("volume", "ls", "-q").split()
    else:
        assert not os.path.lexists(spool_source)
