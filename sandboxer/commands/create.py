"""`create`: a new sandbox from an approved profile, or a warm container taken for it."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.api.results import BootstrapSummary, Created, ManifestSummary
from sandboxer.commands import warm
from sandboxer.commands.destroy import destroy
from sandboxer.commands.making import CreateRequest, before, clone_workspace, deliver_requested, plan_for
from sandboxer.commands.services import Services
from sandboxer.commands.sites import site_of
from sandboxer.commands.spools import make_spools
from sandboxer.core.egress.inside import EGRESS_PORT
from sandboxer.core.plan import WORKSPACE_TARGET
from sandboxer.core.record import SandboxRecord, expiry_text, now_text
from sandboxer.errors import PolicyError, SandboxerError, UsageError
from sandboxer.host import activity, procs, workspace_volume
from sandboxer.host.registry import Registry

MIN_TTL, MAX_TTL = 1, 30 * 24 * 3600  # create --ttl, in seconds

if TYPE_CHECKING:
    from sandboxer.core.reading import CallerFile
    from sandboxer.dirs import Dirs


def create(
    dirs: Dirs,
    profile_name: str,
    *,
    manifest_path: str | None = None,
    bootstrap: str | CallerFile | None = None,
    caller_uid: int | None = None,
    ttl: float | None = None,
    default_ttl: float | None = None,
    ref: str | None = None,
    branch: str | None = None,
    services: Services,
) -> Created:
    """Create a sandbox from an approved profile (a lease manifest by path, a runtime bootstrap
    by path or as its caller read it);
    nothing is left behind if any step fails. `caller_uid`: the account a service creates it
    for, which alone (with the owners) may use it then. `ttl`: seconds until the service tears
    it down (create --ttl), at most the profile's lifetime.max_seconds, which is the lifetime
    when none is asked (or `default_ttl`, a granted caller's ceiling, when that is less).
    `ref`, `branch`: what the workspace checks out instead of the
    profile's ref (one workspace.refs allows), on a new branch (create --ref, --branch)."""
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
        raise UsageError("ttl: must be a number of seconds")  # from a program: the CLI's is a float
    if ttl is not None and not MIN_TTL <= ttl <= MAX_TTL:
        raise UsageError(f"--ttl: must be between {MIN_TTL} and {MAX_TTL} seconds")

    request = CreateRequest(
        dirs, profile_name, manifest_path, bootstrap, backends=services.backends, ref=ref, branch=branch
    )
    most = request.profile.lifetime.max_seconds
    if most is not None and ttl is not None and ttl > most:
        raise PolicyError(f"--ttl: {ttl:g} seconds is past the profile's lifetime.max_seconds ({most})")
    if ttl is None:
        bounds = [bound for bound in (default_ttl, most) if bound is not None]
        ttl = min(bounds) if bounds else None
    if request.profile.egress:
        services.egress.require(request.profile.name)  # before anything is made
    manifest = None if request.assignment is None else request.assignment.manifest
    published = () if manifest is None else manifest.published_ports
    if published:
        services.publish.require(request.profile.name)
    # The host's ports first: a taken one refuses the create before anything is made.
    listeners = services.publish.reserve(str(manifest.file), published) if manifest and published else []
    try:
        return _create(request, dirs, services, listeners, caller_uid=caller_uid, ttl=ttl)
    except BaseException:
        for listener in listeners:  # the service serves them only once the create is done
            listener.close()
        raise


def _create(
    request: CreateRequest,
    dirs: Dirs,
    services: Services,
    listeners: list[socket.socket],
    *,
    caller_uid: int | None,
    ttl: float | None,
) -> Created:
    """The create once its host ports are reserved (`listeners`, handed to the service at the end)."""
    registry = Registry(dirs.state)

    warm_count = warm.wanted(request)  # 0 unless the backend keeps warm sandboxes for the profile
    taken = None
    if warm_count:
        before("taking a warm sandbox")
        taken = warm.claim(request, registry)
    if taken is None:
        sandbox_id, lock = registry.allocate()
        record = SandboxRecord(
            id=sandbox_id, profile=request.profile.name, backend=request.backend, state="creating", created_at=""
        )
    else:
        lock, record, plan = taken
    now = time.time()
    record = replace(
        record,
        state="creating",
        created_at=now_text(),
        owner_pid=os.getpid(),
        owner_start=procs.start_time(os.getpid()),
        caller_uid=caller_uid,
        expires_at=None if ttl is None else now + ttl,
        max_expires_at=None
        if request.profile.lifetime.max_seconds is None
        else now + request.profile.lifetime.max_seconds,
        idle_seconds=request.profile.lifetime.idle_seconds,
        warm_profile=bool(warm_count),  # its teardown tops the profile's warm sandboxes up
    )
    try:
        registry.write(record)
        activity.prepare(registry.path(record.id))
        record = _make(request, registry, record) if taken is None else warm.finish(request, registry, record, plan)
        if request.profile.egress:
            _serve_egress(request, record, services)
        if listeners:
            _serve_published(request, record, services, listeners)
        record = replace(record, state="ready")
        registry.write(record)
    except BaseException as exc:
        record = replace(record, state="failed")
        with contextlib.suppress(OSError, SandboxerError):
            registry.write(record)
        for close in (services.egress.close, services.publish.close):
            with contextlib.suppress(Exception):  # whatever they do, the sandbox is destroyed
                close(record.id)
        residue = destroy(registry, record.id, record, backends=services.backends).residue
        if residue and isinstance(exc, SandboxerError):
            exc.message += f" (and cleanup left residue: {'; '.join(residue)})"
        raise
    finally:
        os.close(lock)
    if warm_count and taken is None:
        # None was warm (the first create of the profile, or a burst took them all): fill now.
        # A taken one is replaced when its sandbox is torn down, not while the caller uses it.
        services.fills.spawn(dirs, request.profile.name)
    manifest = None if request.assignment is None else request.assignment.manifest
    return Created(
        id=record.id,
        profile=request.profile.name,
        backend=record.backend,
        runtime_sha256=request.extension.runtime.sha256,
        workspace=WORKSPACE_TARGET,
        limits=record.limits.mechanism if record.limits else None,
        expires_at=None if record.expires_at is None else expiry_text(record.expires_at),
        manifest=None if manifest is None else ManifestSummary(run_id=manifest.run_id, leases=len(manifest.leases)),
        bootstrap=None
        if record.bootstrap is None
        else BootstrapSummary(target=record.bootstrap.target, suspend_control=record.bootstrap.suspend_control),
    )


def _make(request: CreateRequest, registry: Registry, record: SandboxRecord) -> SandboxRecord:
    """Plan, clone, spools, start and verify, deliver: the body of a create."""

    assignment = request.assignment
    plan = plan_for(request, registry, record.id)
    backend = request.engine

    record = replace(record, workspace_fs=workspace_volume.prepare(plan, registry.path(record.id)))
    before("the clone")
    record = replace(record, work=clone_workspace(request, plan))
    if assignment is not None:
        image_user = request.extension.service_user == "image"
        services = assignment.services(record.id, state_dir=request.state_dir, image_user=image_user)
        record = replace(record, manifest=assignment.record(plan), services=services)
        registry.write(record)
        make_spools(assignment, plan, backend, request.state_dir, consumer=(plan.host_uid, plan.host_gid))
    before("the start")
    record = backend.start(
        plan,
        record,
        site=site_of(registry, record.id),
        image=request.image,
        profile_file=request.profile_file,
        note=registry.write,  # before anything the record names could outlive this process
    )
    return deliver_requested(request, plan, record)


def _serve_egress(request: CreateRequest, record: SandboxRecord, services: Services) -> None:
    """The sandbox's egress listener, made inside its network namespace before anything of the
    caller's runs there (so nothing inside can take the port first), served by the service's
    proxy from now on (docs/egress.md)."""
    before("the egress proxy")
    listener = request.engine.listen_inside(record, ("127.0.0.1", EGRESS_PORT))
    services.egress.open(record.id, request.profile.name, listener)


def _serve_published(
    request: CreateRequest, record: SandboxRecord, services: Services, listeners: list[socket.socket]
) -> None:
    """The manifest's published ports: the reserved host listeners forwarded into the sandbox by
    the service from now on (docs/publish.md)."""
    before("the published ports")
    ports = () if request.assignment is None else request.assignment.manifest.published_ports
    inside = request.engine.inside_sockets(record)
    try:
        services.publish.open(record.id, ports, listeners, inside)
    except BaseException:
        inside.close()  # a second close (the table's own, on its failure) is harmless
        raise
