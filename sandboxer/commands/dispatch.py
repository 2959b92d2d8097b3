"""`dispatch-tool`: relay one request from a sandbox's request spool to its trusted endpoint
(docs/tool-requests.md).

The consumer inside writes `requests/<R>.json` (mode 0600, by rename). The owner's side runs
`sandboxer dispatch-tool ID --lease L --request-id R --wait-seconds N`: the broker waits for that
file, moves it into `.processing/` (which the consumer cannot see) before reading it, checks it
and its envelope, makes a capability-stripped canonical copy durable in the replay ledger (an
owner-only directory outside the sandbox) and only then relays it, as one JSON line, to the
lease's endpoint socket. The correlated response is made durable in the ledger, then written to
`responses/<R>.json` (the consumer's, 0400).

Exit statuses: 0 dispatched; 75 nothing pending yet (retryable); 2 bad usage; 3 a terminal
refusal (a bad request file, envelope or capability, a changed or blocked request id, a response
that does not correlate, an expired lease); 4 no such sandbox; 5 the endpoint could not be
reached (terminal without the lease's replay policy).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import shutil
import stat
import time
from typing import Any, NoReturn

from sandboxer.api.results import Dispatched
from sandboxer.backends import Backends
from sandboxer.commands.dispatch_endpoint import Refused, canonical, relay, strict_json
from sandboxer.core import manifest as mf
from sandboxer.core.leases import SPOOL_PENDING_FILES, SPOOL_REQUEST_BYTES, SPOOL_TOTAL_BYTES, spool_name
from sandboxer.core.manifest.schema import REPLAY_POLICY, TOOL_REQUEST
from sandboxer.core.manifest.schema import run_dir as manifest_run_dir
from sandboxer.core.reading import open_beneath
from sandboxer.errors import BackendError, NotPendingError, UsageError
from sandboxer.host.fsutil import atomic_write
from sandboxer.host.registry import Registry, check_id

MAX_WAIT = 300
ENVELOPE = ("version", "run_id", "lease_id", "consumer", "request_id", "capability", "payload")
POLL_SECONDS = 0.05


class _Target:
    """One dispatch: the sandbox, its lease, the spool, the ledger and the endpoint."""

    def __init__(self, state_dir: str, sandbox_id: str, lease_id: str, request_id: str, backends: Backends) -> None:
        registry = Registry(state_dir)
        self.record = registry.read_caller(check_id(sandbox_id))
        if self.record.state != "ready":
            raise BackendError(f"sandbox {sandbox_id} is not ready (state {self.record.state})")
        assignment = self.record.manifest
        if assignment is None:
            raise UsageError(f"sandbox {sandbox_id} was not created with a manifest: it has no request spools")
        if self.record.plan is None:
            raise BackendError(f"sandbox {sandbox_id}: its record has no plan")
        checked = mf.load(assignment.file, forbidden=())
        if checked.sha256 != assignment.sha256:
            raise Refused(f"{checked.file}: the manifest changed since the sandbox was created")
        lease = checked.lease(lease_id)
        if lease is None or lease.scope != TOOL_REQUEST:
            raise UsageError(f"--lease {lease_id}: not a tool-request lease of this sandbox's manifest")
        if not _is_request_id(request_id):
            raise UsageError("--request-id: must be 1-128 of [A-Za-z0-9._:-], not . or ..")
        endpoint = checked.lease(str(lease.endpoint_lease_id))
        if endpoint is None:  # the manifest check rules it out
            raise Refused(f"{lease.field}.endpoint_lease_id: names no lease")
        self.manifest, self.lease, self.request_id = checked, lease, request_id
        self.endpoint = endpoint.materializations[0].source_path
        self.owner = assignment.owner_uid
        self.replay = lease.replay_policy == REPLAY_POLICY
        self.uid = self.record.plan.uid  # the sandbox user's
        self.consumer_uid = self.record.plan.host_uid  # who the consumer is on the host (Docker: remapped)
        if self.uid != lease.consumer_uid or self.uid == 0:
            raise Refused(f"{lease.field}.consumer_uid: is not the sandbox user's uid")

        name = spool_name(checked.run_id, lease.lease_id)
        backend = backends.backend(self.record.backend)
        self.spool = backend.spool_directory(name, sandbox_dir=registry.path(sandbox_id))
        self.ledger = registry.path(sandbox_id, "ledger", name)


def _is_request_id(value: str) -> bool:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
    return 0 < len(value) <= 128 and set(value) <= allowed and value not in (".", "..")


def dispatch(
    state_dir: str, sandbox_id: str, *, lease_id: str, request_id: str, wait_seconds: int, backends: Backends
) -> Dispatched:
    """Relay one request; what was dispatched, or an error carrying the exit status."""
    if not 0 <= wait_seconds <= MAX_WAIT:
        raise UsageError(f"--wait-seconds: must be between 0 and {MAX_WAIT}")
    deadline = time.monotonic() + wait_seconds
    target = _Target(state_dir, sandbox_id, lease_id, request_id, backends)
    os.makedirs(target.ledger, mode=0o700, exist_ok=True)
    lock = os.open(
        os.path.join(target.ledger, f"{request_id}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
    )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # per request id; the kernel drops it if we die
        return _dispatch_locked(target, deadline)
    finally:
        os.close(lock)


def _ledger_path(target: _Target) -> str:
    return os.path.join(target.ledger, f"{target.request_id}.json")


def _read_ledger(target: _Target) -> dict[str, Any] | None:
    try:
        with open(_ledger_path(target), "rb") as stream:
            entry: dict[str, Any] = json.loads(stream.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise Refused(f"request {target.request_id}: its replay record is unreadable; the id stays blocked") from None
    return entry


def _write_ledger(target: _Target, entry: dict[str, Any]) -> None:
    atomic_write(_ledger_path(target), json.dumps(entry, sort_keys=True).encode(), mode=0o600, durable=True)


def _dispatch_locked(target: _Target, deadline: float) -> Dispatched:
    mf.check_live(target.manifest)
    entry = _read_ledger(target)
    if entry is not None and entry.get("state") in ("blocked", "rejected"):
        raise Refused(f"request {target.request_id}: this id is blocked ({entry.get('reason')})")
    staged = _pick_up(target, deadline, required=entry is None)
    if staged is not None:
        request = _check_request(target, staged)
        fingerprint = hashlib.sha256(canonical(request)).hexdigest()
        if entry is None:
            entry = {"state": "claimed", "request": request, "fingerprint": fingerprint, "claimed_at": time.time()}
            _write_ledger(target, entry)  # durable before the staged file goes and before the relay
        elif entry.get("fingerprint") != fingerprint:
            _block(target, entry, "a different request arrived under the same id")
        _unlink_staged(target)
    if entry is None:  # _pick_up waits for the file while there is no entry
        raise NotPendingError(f"request {target.request_id}: not pending")
    if entry.get("state") == "responded":
        _write_response(target, entry["response"])
        return _result(target, entry, cached=True)
    if not target.replay and entry.get("attempts", 0) > 0:
        _block(target, entry, "a relay of it was interrupted, and the lease allows no replay")
    return _relay_until(target, entry, deadline)


def _block(target: _Target, entry: dict[str, Any], reason: str) -> NoReturn:
    _write_ledger(target, {**entry, "state": "blocked", "reason": reason})
    _unlink_staged(target)
    raise Refused(f"request {target.request_id}: {reason}; the id is now blocked")


def _pick_up(target: _Target, deadline: float, *, required: bool) -> bytes | None:
    """Wait for the final request file and stage it; None if absent and not `required`."""
    final = os.path.join(target.spool, "requests", f"{target.request_id}.json")
    staged = os.path.join(target.spool, ".processing", f"{target.request_id}.json")
    while True:
        if os.path.lexists(staged):
            break  # a dispatcher died after staging and before the claim: take it up again
        try:
            os.rename(final, staged)
        except FileNotFoundError:
            pass
        else:
            _check_quota(target, staged)
            break
        if not required:
            return None
        if time.monotonic() >= deadline:
            raise NotPendingError(f"request {target.request_id}: not pending in lease {target.lease.lease_id} yet")
        time.sleep(POLL_SECONDS)
    return _read_staged(target, staged)


def _check_quota(target: _Target, staged: str) -> None:
    """The spool's quotas, counting the request just staged: a violation refuses (and blocks) it."""
    requests = os.path.join(target.spool, "requests")
    try:
        names = [os.path.join(requests, name) for name in os.listdir(requests)]
    except OSError as exc:
        _reject(target, f"the spool's requests/ cannot be read ({exc.strerror})")
    total = 0
    for path in [*names, staged]:
        with contextlib.suppress(OSError):
            total += os.lstat(path).st_size
    if len(names) + 1 > SPOOL_PENDING_FILES:
        _reject(target, f"the spool holds {len(names) + 1} pending files, more than {SPOOL_PENDING_FILES}")
    if total > SPOOL_TOTAL_BYTES:
        _reject(target, f"the spool's pending files hold more than {SPOOL_TOTAL_BYTES} bytes")


def _read_staged(target: _Target, staged: str) -> bytes:
    """The staged request's bytes, re-checked on the descriptor they are read through."""
    reason = None
    try:
        fd = open_beneath(target.spool, staged, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        reason = "it is a symlink" if exc.errno == errno.ELOOP else f"it cannot be read ({exc.strerror})"
        fd = -1
    data = b""
    if fd >= 0:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                reason = "it is not a regular file"
            elif info.st_uid != target.consumer_uid:
                reason = "it does not belong to the consumer"
            elif stat.S_IMODE(info.st_mode) != 0o600:
                reason = "its mode is not 0600"
            elif info.st_nlink != 1:
                reason = "it has more than one link"
            elif info.st_size > SPOOL_REQUEST_BYTES:
                reason = f"it is larger than {SPOOL_REQUEST_BYTES} bytes"
            else:
                data = os.read(fd, SPOOL_REQUEST_BYTES + 1)
                if len(data) > SPOOL_REQUEST_BYTES:
                    reason = f"it is larger than {SPOOL_REQUEST_BYTES} bytes"
        finally:
            os.close(fd)
    if reason is not None:
        _reject(target, f"the request file is refused: {reason}")
    return data


def _reject(target: _Target, reason: str) -> NoReturn:
    """A terminal refusal of the staged request: the id is blocked and the file removed."""
    entry = _read_ledger(target) or {}
    _write_ledger(target, {**entry, "state": "rejected", "reason": reason, "rejected_at": time.time()})
    _unlink_staged(target)
    raise Refused(f"request {target.request_id}: {reason}")


def _unlink_staged(target: _Target) -> None:
    """Remove the staged entry, whatever the consumer made it (a directory too); what cannot be
    removed now goes at teardown."""
    staged = os.path.join(target.spool, ".processing", f"{target.request_id}.json")
    try:
        os.unlink(staged)
    except FileNotFoundError:
        pass
    except (IsADirectoryError, PermissionError):
        shutil.rmtree(staged, ignore_errors=True)  # never follows symlinks
    except OSError:
        pass


def _check_request(target: _Target, data: bytes) -> dict[str, Any]:
    """The envelope, exactly: its fields, its ids, its capability. Returns it without the capability."""
    try:
        envelope = strict_json(data, "the request")
    except Refused as exc:
        _reject(target, exc.message)
    if sorted(envelope) != sorted(ENVELOPE):
        _reject(target, f"the envelope must have exactly the fields {', '.join(ENVELOPE)}")
    expected = {
        "version": "1",
        "run_id": target.manifest.run_id,
        "lease_id": target.lease.lease_id,
        "consumer": target.lease.consumer,
        "request_id": target.request_id,
    }
    for key, value in expected.items():
        if envelope[key] != value:
            _reject(target, f"the envelope's {key} does not match the lease")
    capability = envelope["capability"]
    if not isinstance(capability, str) or not hmac.compare_digest(capability.encode(), _capability(target)):
        _reject(target, "the capability does not match")
    if target.uid != target.lease.consumer_uid:
        _reject(target, "the consumer's uid does not match the lease")
    return {key: value for key, value in envelope.items() if key != "capability"}


def _capability(target: _Target) -> bytes:
    """The spool's capability file, re-read now (the broker wrote it; the consumer cannot)."""
    try:
        fd = open_beneath(target.spool, os.path.join(target.spool, ".capability"), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        raise Refused("the spool's capability file cannot be read") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (info.st_uid != 0 and os.geteuid() == 0):
            raise Refused("the spool's capability file is not the broker's")
        return os.read(fd, 256)
    finally:
        os.close(fd)


def _relay_until(target: _Target, entry: dict[str, Any], deadline: float) -> Dispatched:
    """Relay the persisted request; with the replay policy, transport failures are retried
    until `deadline`."""
    while True:
        entry = {**entry, "attempts": int(entry.get("attempts", 0)) + 1}
        _write_ledger(target, entry)  # an attempt is durable before it starts
        try:
            response = relay(
                entry["request"],
                run_dir=manifest_run_dir(target.manifest),
                endpoint=target.endpoint,
                owner=target.owner,
            )
        except ConnectionError as exc:
            if not target.replay:
                _write_ledger(target, {**entry, "state": "blocked", "reason": f"the relay failed ({exc})"})
                raise BackendError(
                    f"request {target.request_id}: the endpoint failed ({exc}); "
                    "without a replay policy the id is now blocked"
                ) from None
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"request {target.request_id}: the endpoint failed ({exc}); "
                    "the exact request may be dispatched again"
                ) from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        except Refused as exc:
            _write_ledger(target, {**entry, "state": "blocked", "reason": exc.message})
            raise
        entry = {**entry, "state": "responded", "response": response, "responded_at": time.time()}
        _write_ledger(target, entry)
        _write_response(target, response)
        return _result(target, entry, cached=False)


def _write_response(target: _Target, response: dict[str, Any]) -> None:
    """responses/<R>.json: the consumer's, 0400, written atomically (and again, identically)."""
    directory = os.path.join(target.spool, "responses")
    final = os.path.join(directory, f"{target.request_id}.json")
    temporary = os.path.join(directory, f".{target.request_id}.{secrets.token_hex(8)}.tmp")
    data = json.dumps(response, sort_keys=True, ensure_ascii=False).encode() + b"\n"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.fchmod(fd, 0o400)
        if os.geteuid() == 0:
            os.fchown(fd, target.consumer_uid, -1)
        os.close(fd)
        fd = -1
        os.replace(temporary, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _result(target: _Target, entry: dict[str, Any], *, cached: bool) -> Dispatched:
    return Dispatched(
        sandbox=target.record.id,
        lease_id=target.lease.lease_id,
        request_id=target.request_id,
        fingerprint=entry["fingerprint"],
        cached=cached,
        attempts=entry.get("attempts", 0),
        response=f"{target.lease.request_spool_target}/responses/{target.request_id}.json",
    )
