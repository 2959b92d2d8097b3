"""Making a sandbox: admitting a create request, its plan, the clone, starting and verifying it on
bwrap, delivering its bootstrap. Shared by create and the warm pool."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.backends import Backends
from sandboxer.core import bootstrap, leases
from sandboxer.core.approvals import Ledger, Status
from sandboxer.core.bootstrap import SUSPEND_DIR, TARGET
from sandboxer.core.config import is_git_ref
from sandboxer.core.configdir import load_extension, load_profile
from sandboxer.core.digest import RuntimeArtifactError
from sandboxer.core.egress.profile_policy import route_problem
from sandboxer.core.manifest.schema import PROVIDER_CREDENTIAL, PROVIDER_ENVIRONMENT
from sandboxer.core.plan import BACKEND_OF, SANDBOX_GID, SANDBOX_UID, Grants, Mount, MountKind, build_plan
from sandboxer.core.record import BootstrapRecord, WorkRecord
from sandboxer.core.runtime import check_digest, check_overlap
from sandboxer.dirs import require_state_dir
from sandboxer.errors import PolicyError, UnapprovedError, UsageError
from sandboxer.host import workspace
from sandboxer.host.digest_cache import digest_runtime
from sandboxer.host.parse_cache import ParseCache
from sandboxer.host.registry import Registry
from sandboxer.host.sandbox_ca import load_ca, make_ca, trust_bundle

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend
    from sandboxer.core.bootstrap import Bootstrap
    from sandboxer.core.config_types import ExtensionConfig, Profile, RuntimePin
    from sandboxer.core.digest import TreeDigest
    from sandboxer.core.leases import Assignment
    from sandboxer.core.plan import Backend as BackendName
    from sandboxer.core.plan import Plan
    from sandboxer.core.reading import CallerFile
    from sandboxer.core.record import SandboxRecord
    from sandboxer.dirs import Dirs

# What a service checks before each step that makes something for a caller (its grant, again:
# grants.yaml may have changed since the request was admitted). Set by the core for a caller's
# create and export (sandboxer.api.caller.Authority); nothing for an owner.
_CHECKPOINT: ContextVar[Callable[[str], None] | None] = ContextVar("sandboxer_checkpoint", default=None)


@contextlib.contextmanager
def checked_by(check: Callable[[str], None]) -> Iterator[None]:
    """Run the block with `check(step)` called by before(step)."""
    token = _CHECKPOINT.set(check)
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def before(step: str) -> None:
    """Before `step` (the clone, the start, taking a warm sandbox, an export's quarantine): the
    caller may still do what it asked, else PolicyError (the step's caller removes what it made)."""
    check = _CHECKPOINT.get()
    if check is not None:
        check(step)


HOST_LINKS_CANDIDATES = (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin"))
# Host /etc entries a sandbox sees read-only: TLS certificates, the loader cache, the time zone,
# and Debian's alternatives (the links behind awk, cc, vi, editor, pager, which, ...).
HOST_ETC_CANDIDATES = (
    "/etc/ssl/certs",
    "/etc/ca-certificates",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/alternatives",
)


def _host_layout() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    links = tuple((target, link) for target, link in HOST_LINKS_CANDIDATES if os.path.isdir(f"/{link}"))
    etc = tuple(path for path in HOST_ETC_CANDIDATES if os.path.exists(path))
    return links, etc


def _require_approved(ledger: Ledger, name: str, file_sha256: str) -> None:

    status = ledger.status(name, file_sha256)
    if status is Status.UNAPPROVED:
        raise UnapprovedError(f"{name} is not approved", hint=f"sandboxer ext approve {name}")
    if status is Status.CHANGED:
        raise UnapprovedError(
            f"{name} changed since it was approved", hint=f"review it, then sandboxer ext approve {name}"
        )


def require_routes(profile: Profile, extension: ExtensionConfig) -> None:
    """The profile's network.routes name routes of its extension config, each for a host its
    network.egress lists (PolicyError otherwise: 3)."""
    problem = route_problem(profile, extension)
    if problem is not None:
        raise PolicyError(
            problem, hint=f"name routes of {extension.extension}'s config.routes, for hosts in network.egress"
        )


def backend_name(extension: ExtensionConfig) -> BackendName:
    """The backend an extension config runs its sandboxes on."""

    return BACKEND_OF[extension.extension]


def _admit(dirs: Dirs, profile_name: str, backends: Backends) -> tuple[str, Profile, ExtensionConfig, Backend]:
    """Every check before anything is made: approvals, backend, runtime pin, reachability."""

    Registry(dirs.state).ensure()  # the state dir first, with its own mode, before any cache in it
    require_state_dir(dirs.state)  # again once made: nobody swapped a directory above it meanwhile
    cache = ParseCache.of_state(dirs.state)
    raw, profile = load_profile(dirs.config, profile_name, cache=cache)
    ledger = Ledger(dirs.config)
    _require_approved(ledger, profile.name, profile.file_sha256)
    _, extension = load_extension(dirs.config, profile.extension, cache=cache)
    _require_approved(ledger, extension.extension, extension.file_sha256)
    require_routes(profile, extension)
    backend = backends.backend(backend_name(extension))
    backend.preflight(extension)
    verify_pin(
        extension.runtime,
        state_dir=dirs.state,
        others={
            "config dir": dirs.config,
            "state dir": dirs.state,
            "workspace repository": profile.workspace.repository,
        },
    )
    backend.admit(extension, state_dir=dirs.state)
    return raw.path, profile, extension, backend


class CreateRequest:
    """Everything a create checks before anything is made: the approved profile and extension,
    the lease manifest, the runtime bootstrap, and what the workspace checks out."""

    def __init__(
        self,
        dirs: Dirs,
        profile_name: str,
        manifest_path: str | None,
        bootstrap: str | CallerFile | None,
        *,
        backends: Backends,
        ref: str | None = None,
        branch: str | None = None,
    ) -> None:
        self.state_dir = dirs.state
        self.backends = backends
        self.profile_file, self.profile, self.extension, self.engine = _admit(dirs, profile_name, backends)
        self.backend = backend_name(self.extension)
        repository = self.profile.workspace.repository
        self.assignment = _admit_manifest(
            dirs, manifest_path, engine=self.engine, repository=repository, publish=self.profile.publish == "loopback"
        )
        self.delivery = _admit_bootstrap(bootstrap, self.assignment)
        image = self.assignment.image if self.assignment is not None else None
        self.image = image or str(self.extension.image)
        self.checkout = _checkout(self, ref, branch)


def _checkout(request: CreateRequest, ref: str | None, branch: str | None) -> workspace.Checkout:
    """What the clone checks out: a manifest's revision and task branch; else the profile's ref,
    or the caller's --ref where workspace.refs allows it, on the caller's --branch if given."""

    assignment = request.assignment
    if assignment is not None:
        if ref is not None or branch is not None:
            raise UsageError("--ref, --branch: a lease manifest names the revision and the task branch itself")
        return workspace.Checkout(
            assignment.revision, assignment.branch, "repository.revision", "task_branch", missing=PolicyError
        )
    for option, value in (("--ref", ref), ("--branch", branch)):
        if value is not None and not is_git_ref(value):
            raise UsageError(f"{option}: must be a Git branch, tag or commit name (letters, digits, . _ / -)")
    if ref is not None and not request.profile.workspace.allows(ref):
        raise PolicyError(
            f"--ref: profile {request.profile.name} does not allow {ref}",
            hint="the owner lists the refs a caller may ask for in workspace.refs",
        )
    return workspace.Checkout(
        ref or request.profile.workspace.ref, branch, "--ref" if ref else "workspace.ref", "--branch", fresh_branch=True
    )


def plan_for(
    request: CreateRequest, registry: Registry, sandbox_id: str, *, known_ids: tuple[int, int] | None = None
) -> Plan:
    """The plan of the sandbox `sandbox_id` for this request. `known_ids`: the host ids of a
    sandbox that already runs for it (a warm container's, checked on its pid 1 before it is
    taken), which spares asking for them again."""

    backend = request.engine
    assignment, delivery = request.assignment, request.delivery
    links, etc = _host_layout()
    sandbox_dir = registry.path(sandbox_id)
    grants: Grants | None = None
    if assignment is not None:  # each spool where this backend keeps it
        grants = assignment.grants(lambda name: backend.spool_place(name, sandbox_dir=sandbox_dir))
    if delivery is not None and delivery[0].suspend_control:
        grants = _with_suspend_dir(grants)
    inside = (grants.uid or SANDBOX_UID, grants.gid or SANDBOX_GID) if grants else (SANDBOX_UID, SANDBOX_GID)
    ids = backend.host_ids(inside, known=known_ids)
    return build_plan(
        sandbox_id=sandbox_id,
        profile=request.profile,
        extension=request.extension,
        workspace_source=registry.path(sandbox_id, "workspace"),
        workspace_in_memory=backend.workspace_in_memory(),
        host_ids=ids,
        host_links=links,
        host_etc=etc,
        grants=grants,
        trust_bundle=_trust_bundle(request, registry.path(sandbox_id)),
    )


def _trust_bundle(request: CreateRequest, sandbox_dir: str) -> bytes | None:
    """With credential routes, what the sandbox trusts: the host's roots and its own CA, made
    now (a warm sandbox's, when it was started) and kept beside its record, where the service
    loads its key from (docs/egress.md). Without routes: None (the host's roots serve)."""
    if not (request.profile.routes and request.profile.egress):
        return None
    return trust_bundle(load_ca(sandbox_dir) or make_ca(sandbox_dir, os.path.basename(sandbox_dir)))


def clone_workspace(request: CreateRequest, plan: Plan) -> WorkRecord:
    """The workspace: the profile's repository (or the manifest's revision) cloned for this plan;
    the record's account of its history."""
    assignment = request.assignment
    checkout = request.checkout
    base = workspace.clone(
        repository=request.profile.workspace.repository,
        checkout=checkout,
        destination=str(plan.workspace_source),
        git_home=Registry(request.state_dir).path(plan.sandbox_id, workspace.GIT_HOME),  # gc finds what it leaves
        profile_file=assignment.file if assignment else request.profile_file,
        owner=(plan.host_uid, plan.host_gid) if os.geteuid() == 0 else None,
        identity=(request.profile.workspace.git_user_name, request.profile.workspace.git_user_email),
    )
    return WorkRecord(base=base, ref=checkout.ref, repository=request.profile.workspace.repository)


def deliver_requested(request: CreateRequest, plan: Plan, record: SandboxRecord) -> SandboxRecord:
    """Deliver the runtime bootstrap of the request, if it has one, into the started sandbox;
    the record says so."""
    if request.delivery is None:
        return record

    request.engine.deliver(plan, record, request.delivery[1], TARGET)
    return replace(
        record, bootstrap=BootstrapRecord(target=TARGET, suspend_control=request.delivery[0].suspend_control)
    )


def _admit_bootstrap(source: str | CallerFile | None, assignment: Assignment | None) -> tuple[Bootstrap, bytes] | None:
    """The runtime bootstrap of a create, read once and checked before anything is made."""
    if source is None:
        return None

    document, data = bootstrap.load(source)
    file = os.path.abspath(source if isinstance(source, str) else source.path)
    if document.workspace != bootstrap.PUBLIC_WORKSPACE:
        raise PolicyError(f"{file}: workspace: must be {bootstrap.PUBLIC_WORKSPACE}, where the sandbox serves it")
    if assignment is not None:
        for lease in assignment.manifest.leases:
            if lease.scope in (PROVIDER_ENVIRONMENT, PROVIDER_CREDENTIAL):
                raise PolicyError(
                    f"{file}: the bootstrap is the launch's only credential source, and the manifest's "
                    f"{lease.field} ({lease.scope}) is another"
                )
    return document, data


def _with_suspend_dir(grants: Grants | None) -> Grants:
    """The grants plus the suspend control's directory (0700, the sandbox user's)."""

    base = grants or Grants()
    return replace(base, mounts=(*base.mounts, Mount(kind=MountKind.DIR, target=SUSPEND_DIR, mode=0o700)))


def _admit_manifest(
    dirs: Dirs, path: str | None, *, engine: Backend, repository: str, publish: bool
) -> Assignment | None:
    """The lease manifest of a create, fully checked before anything is made (or None)."""
    if path is None:
        return None

    assignment = leases.admit_assignment(
        os.path.abspath(path),
        forbidden=(dirs.config, dirs.state),
        images_admitted=engine.admits_service_images(),
        repository=repository,
        publish=publish,
    )
    registry = Registry(dirs.state)
    for other in registry.ids():  # a run is one sandbox: its spools, ledger and materializations are one
        record = registry.read_or_none(other)
        held = record.manifest if record else None
        if held is not None and held.run_id == assignment.manifest.run_id:
            raise PolicyError(f"{assignment.file}: run_id: run {held.run_id} already has sandbox {other}")
    return assignment


def verify_pin(pin: RuntimePin, *, state_dir: str, others: Mapping[str, str], full: bool = False) -> TreeDigest:
    """Check the runtime against its pin: artifact rules, no overlap, the exact tree digest (read
    through the state dir's cache unless `full`)."""

    try:
        check_overlap(pin.path, others)
        result = digest_runtime(pin.path, state_dir=state_dir, full=full)
    except RuntimeArtifactError as exc:
        raise PolicyError(exc.message) from exc
    check_digest(pin, result)
    return result
