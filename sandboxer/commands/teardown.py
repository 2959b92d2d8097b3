"""`teardown`, `list` and `gc`: they run often and need little, so what only create and inspect
use is never imported here (no YAML, netlink or plan checker)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.api.results import GcReport, Receipt, SandboxInfo, SandboxList
from sandboxer.backends import Backends
from sandboxer.commands.destroy import destroy
from sandboxer.commands.export_space import reclaim_abandoned
from sandboxer.commands.services import Services
from sandboxer.commands.warm import is_current
from sandboxer.commands.work import unexported
from sandboxer.core.record import expiry_text
from sandboxer.errors import BackendError, NotFoundError, ResidueError, SandboxerError, UnexportedWorkError
from sandboxer.host.registry import Registry, check_id

if TYPE_CHECKING:
    from sandboxer.core.record import SandboxRecord
    from sandboxer.core.removal import Removal
    from sandboxer.dirs import Dirs


def teardown(dirs: Dirs, sandbox_id: str, *, services: Services, keep_work: bool = False) -> Receipt:
    """Tear a sandbox down and return the receipt, residue and all (the caller decides: see
    `residue_error`).
    With `keep_work` (a caller's teardown without --discard), a sandbox whose work no export took
    out is refused instead (UnexportedWorkError, 2, saying what would be lost)."""
    registry = Registry(dirs.state)
    check_id(sandbox_id)
    if keep_work:
        lost = unexported(dirs, sandbox_id, backends=services.backends)
        if lost:
            raise UnexportedWorkError(
                f"teardown: sandbox {sandbox_id} holds work no export took out: {' and '.join(lost)}; "
                "export it first (sandboxer export), or teardown --discard",
                unexported=tuple(lost),
            )
    lock = registry.lock(sandbox_id)
    if lock is None:
        raise BackendError(f"sandbox {sandbox_id}: its lock could not be taken")
    try:
        record = registry.read_or_none(sandbox_id)
        if record is not None and record.hidden:
            raise NotFoundError(f"no such sandbox: {sandbox_id}")
        if record is not None:
            # A ready sandbox's assignment was used: its materializations go too.
            record = replace(record, state="tearing-down", consumed=record.consumed or record.state == "ready")
            with contextlib.suppress(OSError, SandboxerError):
                registry.write(record)
        with contextlib.suppress(Exception):  # whatever it does, the sandbox is destroyed
            services.publish.close(sandbox_id)  # its ports stop forwarding before its processes go
        done = destroy(registry, sandbox_id, record, backends=services.backends)
        with contextlib.suppress(Exception):  # the watch closes what this could not
            services.egress.close(sandbox_id)  # its listener went with its namespace; its proxy goes too
    finally:
        os.close(lock)
    if record is not None and record.warm_profile:
        services.fills.spawn(dirs, record.profile)
    return receipt_of(sandbox_id, done)


def receipt_of(sandbox_id: str, removal: Removal) -> Receipt:
    """The receipt of one sandbox, as teardown and gc report it: what its removal did."""
    return Receipt(id=sandbox_id, removed=removal.removed, residue=removal.residue)


def residue_error(receipt: Receipt) -> ResidueError:
    """The error (exit status 6) of a receipt with residue, carrying it as `.receipt`: the one
    wording of residue, whichever front end reports it."""
    error = ResidueError(f"teardown of {receipt.id} left residue: {'; '.join(receipt.residue)}")
    error.receipt = receipt
    return error


def is_running(record: SandboxRecord, backends: Backends) -> bool | None:
    """Whether the sandbox's processes run; None when that cannot be known (Engine silent)."""

    return backends.backend(record.backend).is_running(record)


def list_sandboxes(dirs: Dirs, *, backends: Backends) -> SandboxList:
    """Every sandbox in the registry with its state."""
    registry = Registry(dirs.state)
    entries: list[SandboxInfo] = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record is None:
            entries.append(SandboxInfo(id=sandbox_id, profile=None, backend=None, status="unknown", created_at=None))
            continue
        if record.hidden:
            continue
        status = record.state
        if status == "ready":
            running = is_running(record, backends)
            status = "unknown" if running is None else "running" if running else "dead"
        entries.append(
            SandboxInfo(
                id=sandbox_id,
                profile=record.profile,
                backend=record.backend,
                status=status,
                created_at=record.created_at,
                expires_at=None if record.expires_at is None else expiry_text(record.expires_at),
            )
        )
    return SandboxList(sandboxes=tuple(entries))


def gc(dirs: Dirs, *, backends: Backends) -> GcReport:
    """Finish what crashed creates and teardowns left; never touch a healthy or busy sandbox.

    Each sandbox is collected on its own: whatever goes wrong with one (a tree it made hostile, a
    broken record) is that sandbox's residue in its receipt, and the others are still collected.
    The quarantine of an export whose exporter died (kill -9 mid-export) goes too, at once: its
    exporter's lock is gone (`exports`: their names; sandboxer.commands.export_space).
    """

    registry = Registry(dirs.state)
    collected: list[Receipt] = _collect_orphans(registry, backends)
    healthy: list[str] = []
    busy: list[str] = []
    warm: list[str] = []
    for sandbox_id in registry.ids():
        try:
            lock = registry.try_lock_for_gc(sandbox_id)
            if lock is None:
                busy.append(sandbox_id)
                continue
            try:
                record = registry.read_or_none(sandbox_id)
                state = record.state if record is not None else None
                running = is_running(record, backends) if record is not None and state in ("ready", "warm") else False
                if running is None:  # the Engine does not answer: never destroy what may be healthy
                    busy.append(sandbox_id)
                    continue
                if running and record is not None and state == "warm":
                    if is_current(dirs, record):
                        warm.append(sandbox_id)
                        continue
                elif running:
                    healthy.append(sandbox_id)
                    continue
                collected.append(receipt_of(sandbox_id, destroy(registry, sandbox_id, record, backends=backends)))
            finally:
                os.close(lock)
        except Exception as exc:  # one sandbox's failure is its own residue, never gc's end
            problem = " ".join(f"{type(exc).__name__}: {exc}".split())
            collected.append(Receipt(id=sandbox_id, removed=(), residue=(f"gc failed ({problem})",)))
    exports = reclaim_abandoned(dirs.state)  # last: the sandboxes are collected whatever happens here
    return GcReport(
        collected=tuple(collected), healthy=tuple(healthy), busy=tuple(busy), warm=tuple(warm), exports=tuple(exports)
    )


def _collect_orphans(registry: Registry, backends: Backends) -> list[Receipt]:
    """What each engine still holds of sandboxes whose directory is gone (its own receipts)."""

    def present() -> set[str]:
        return set(registry.ids())

    receipts: list[Receipt] = []
    for name in backends.names:
        collected = backends.backend(name).collect_orphans(state_dir=registry.state_dir, present=present)
        receipts += [receipt_of(sandbox_id, removal) for sandbox_id, removal in collected.items()]
    return receipts
