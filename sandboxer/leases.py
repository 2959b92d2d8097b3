"""What a checked lease manifest grants one sandbox, on either backend (docs/manifest.md).

The broker plays the manifest's in-guest runtime: shared directories, standalone tool endpoints
and a provider credential become read-only binds at their targets; the project environment file
is bound read-only and its variables join every exec; each tool-request lease gets a writable
request spool of its own (a host directory under the sandbox's directory on bwrap, a named
volume on Docker) laid out as the specification says, and suppresses the bind of the socket
endpoint it links. Provider-environment values are never mounted or stored: a provider launch
reads them again right before it starts (`provider_environment`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandboxer import manifest as mf
from sandboxer.errors import BackendError, PolicyError
from sandboxer.plan import SAFE_PATH, SANDBOX_GID, SANDBOX_UID, STATE_DIRS, STATE_ROOT, Grants, Mount, MountKind, Plan

if TYPE_CHECKING:
    from sandboxer.observe import MountSeen

SPOOL_PENDING_FILES = 16
SPOOL_REQUEST_BYTES = 256 * 1024
SPOOL_TOTAL_BYTES = 1024 * 1024
# A spool is a tmpfs of its own (root brokers; on Docker mounted over its volume's directory):
# room for the pending quota and the responses, and nothing a consumer could use to fill the
# state dir's or the Engine's filesystem.
SPOOL_FS_OPTIONS = "size=64m,nr_inodes=4096,mode=0755"
SPOOL_VOLUME_PREFIX = "sandboxer-spool-"


def spool_name(run_id: str, lease_id: str) -> str:
    """The spool's name, derived from the run and the lease (a Docker volume name; on bwrap the
    directory's name below the sandbox's `spools/`)."""
    return SPOOL_VOLUME_PREFIX + hashlib.sha256(f"{run_id}\n{lease_id}".encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """A checked manifest with what create needs of its files, read once through checked
    descriptors: the project environment and each spool's capability (never a provider value)."""

    manifest: mf.Manifest
    owner: int
    project_env: bytes | None
    capabilities: dict[str, bytes] = field(repr=False)

    @property
    def file(self) -> str:
        return self.manifest.file

    @property
    def revision(self) -> str:
        return self.manifest.repository_revision

    @property
    def branch(self) -> str:
        return self.manifest.task_branch

    @property
    def image(self) -> str | None:
        return service_image(self.manifest)

    def grants(self, backend: str, sandbox_dir: str) -> Grants:
        return grants(self.manifest, backend=backend, sandbox_dir=sandbox_dir, project_env=self.project_env)

    def record(self, plan: Plan) -> dict[str, Any]:
        return record(self.manifest, plan.mounts, owner=self.owner)

    def make_spools(self, plan: Plan, state_dir: str, *, consumer: tuple[int, int]) -> None:
        """Each tool-request lease's spool, laid out before the sandbox starts."""
        for mount in plan.mounts:
            if mount.kind is not MountKind.SPOOL:
                continue
            lease = next(item for item in self.manifest.leases if item.lease_id == mount.lease)
            if plan.backend == "docker":
                # The volume's own directory gets the same bounded tmpfs as a bwrap spool: the
                # container binds it from there, and dispatch-tool reads it there.
                root = create_volume(str(mount.source), sandbox_id=plan.sandbox_id, state_dir=state_dir)
                _mount_spool_tmpfs(root)
            else:
                root = str(mount.source)
                spools = os.path.dirname(root)
                if not os.path.isdir(spools):  # bwrap walks it as the sandbox's uid and gid; nobody else
                    os.mkdir(spools, 0o700)
                    os.chown(spools, 0, consumer[1])
                    os.chmod(spools, 0o710)  # noqa: S103 - root's, passable by the sandbox's own group only
                os.mkdir(root, 0o755)
                _mount_spool_tmpfs(root)
            lay_out_spool(
                root,
                binding_doc=binding(self.manifest, lease),
                capability=self.capabilities[lease.lease_id],
                consumer=consumer,
            )


def admit_assignment(path: str, *, forbidden: Sequence[str], backend: str, repository: str) -> Assignment:
    """The whole manifest check at create: ManifestError (2), LeaseExpiredError or PolicyError (3)."""
    data, info = mf.read_assignment(path)
    checked = mf.parse(data, file=path)
    mf.check_sources(checked, owner=info.st_uid, forbidden=forbidden)
    mf.check_live(checked)
    admit(checked, backend=backend, repository=repository, broker_uid=os.geteuid())
    project_env = None
    capabilities: dict[str, bytes] = {}
    for lease in checked.leases:
        if lease.scope == mf.PROJECT_ENVIRONMENT:
            project_env = mf.read_material(checked, lease, 0, owner=info.st_uid)
        elif lease.scope == mf.TOOL_REQUEST:
            capabilities[lease.lease_id] = mf.read_material(checked, lease, 0, owner=info.st_uid)
    return Assignment(manifest=checked, owner=info.st_uid, project_env=project_env, capabilities=capabilities)


def admit(manifest: mf.Manifest, *, backend: str, repository: str, broker_uid: int) -> None:
    """What this broker refuses of a valid manifest for this profile (PolicyError, exit 3)."""
    file = manifest.file
    if os.path.realpath(manifest.repository_path) != os.path.realpath(repository):
        raise PolicyError(f"{file}: repository.path: is not the profile's workspace repository")
    if manifest.published_ports:
        raise PolicyError(f"{file}: published_ports: sandboxes are loopback-only; nothing is published")
    if manifest.service_images and backend != "docker":
        raise PolicyError(f"{file}: service_images: images need the Docker backend")
    clash = mf.targets_apart(manifest)
    if clash is not None:
        raise PolicyError(f"{file}: {clash}: mount targets must not be equal or nested")
    for lease in manifest.by_scope(mf.PROVIDER_CREDENTIAL):
        target = str(lease.materializations[0].target_path)
        if any(target == t or target.startswith(t + "/") for t in mf.RESERVED_TARGETS):
            raise PolicyError(
                f"{file}: {lease.field}.materializations[0].target_path: "
                "this broker never mounts a lease over a path the sandbox itself mounts (/usr, /proc, /etc/passwd, ...)"
            )
    uid = manifest.workspace_consumer[0] if manifest.workspace_consumer else SANDBOX_UID
    if manifest.workspace_consumer is not None and uid == broker_uid:
        raise PolicyError(f"{file}: workspace_consumer.uid: must differ from the broker's own uid")
    for lease in manifest.by_scope(mf.TOOL_REQUEST):
        if lease.consumer_uid != uid:
            raise PolicyError(f"{file}: {lease.field}.consumer_uid: is not the sandbox user's uid ({uid})")
        if broker_uid != 0:
            raise PolicyError(
                f"{file}: {lease.field}: a request spool needs a root broker (its files must not be the consumer's)"
            )


def service_image(manifest: mf.Manifest, name: str = "app") -> str | None:
    """The sandbox image a manifest assigns (Docker), if any."""
    return dict(manifest.service_images).get(name)


def grants(manifest: mf.Manifest, *, backend: str, sandbox_dir: str, project_env: bytes | None) -> Grants:
    """The plan's share of the manifest: user, lease mounts in document order, project variables."""
    suppressed = manifest.linked_endpoints()
    directory = mf.run_dir(manifest)
    mounts: list[Mount] = []
    env: tuple[tuple[str, str], ...] = ()
    for lease in manifest.leases:
        if lease.scope in (mf.SHARED_DIRECTORY, mf.TOOL_ENDPOINT, mf.PROVIDER_CREDENTIAL):
            if lease.lease_id in suppressed:
                continue
            item = lease.materializations[0]
            mounts.append(
                Mount(
                    kind=MountKind.RO_BIND,
                    target=str(item.target_path),
                    source=item.source_path,
                    lease=lease.lease_id,
                    beneath=directory,
                )
            )
        elif lease.scope == mf.PROJECT_ENVIRONMENT and project_env is not None:
            mounts.append(
                Mount(
                    kind=MountKind.FILE,
                    target=mf.PROJECT_ENV_TARGET,
                    content=project_env,
                    mode=0o444,
                    lease=lease.lease_id,
                )
            )
            env = tuple(mf.project_variables(project_env))
        elif lease.scope == mf.TOOL_REQUEST:
            name = spool_name(manifest.run_id, lease.lease_id)
            spools = os.path.join(sandbox_dir, "spools")
            source, beneath = (name, None) if backend == "docker" else (os.path.join(spools, name), spools)
            mounts.append(
                Mount(
                    kind=MountKind.SPOOL,
                    target=str(lease.request_spool_target),
                    source=source,
                    lease=lease.lease_id,
                    beneath=beneath,
                )
            )
    uid, gid = manifest.workspace_consumer or (SANDBOX_UID, SANDBOX_GID)
    return Grants(uid=uid, gid=gid, mounts=tuple(mounts), env=env)


def check_lease_fd(fd: int, mount: Mount) -> None:
    """The source a lease mount opened is what was checked: no symlink, and a directory, socket or
    regular file (a spool: a directory)."""
    info = os.fstat(fd)
    kinds = (stat.S_ISDIR,) if mount.kind is MountKind.SPOOL else (stat.S_ISDIR, stat.S_ISSOCK, stat.S_ISREG)
    if not any(kind(info.st_mode) for kind in kinds):
        raise PolicyError(f"lease {mount.lease}: its source {mount.source} changed since it was checked")


def binding(manifest: mf.Manifest, lease: mf.Lease) -> dict[str, Any]:
    """The spool's `.binding.json`: the non-secret facts of the signed lease."""
    spool = str(lease.request_spool_target)
    return {
        "version": "1",
        "run_id": manifest.run_id,
        "lease_id": lease.lease_id,
        "consumer": lease.consumer,
        "consumer_uid": lease.consumer_uid,
        "request_dir": f"{spool}/requests",
        "response_dir": f"{spool}/responses",
        "request_file": "<request_id>.json (write a temporary file of mode 0600, then rename it)",
        "quotas": {
            "pending_files": SPOOL_PENDING_FILES,
            "request_bytes": SPOOL_REQUEST_BYTES,
            "total_bytes": SPOOL_TOTAL_BYTES,
        },
        "replay_policy": lease.replay_policy,
    }


def lay_out_spool(root: str, *, binding_doc: dict[str, Any], capability: bytes, consumer: tuple[int, int]) -> None:
    """The spool's layout in an empty directory the broker (root) owns: `.binding.json` and
    `.capability` 0444, `requests/` 0700 the consumer's, `responses/` 0755, `.processing/` 0700."""
    os.chmod(root, 0o755)  # noqa: S103 - the consumer traverses it; only requests/ is its to write
    for name, data in (
        (".binding.json", json.dumps(binding_doc, indent=2).encode() + b"\n"),
        (".capability", capability),
    ):
        fd = os.open(
            os.path.join(root, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444
        )
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
    for name, mode in (("requests", 0o700), ("responses", 0o755), (".processing", 0o700)):
        os.mkdir(os.path.join(root, name), mode)
        os.chmod(os.path.join(root, name), mode)
    os.lchown(os.path.join(root, "requests"), *consumer)


def record(manifest: mf.Manifest, plan_mounts: tuple[Mount, ...], *, owner: int) -> dict[str, Any]:
    """What the registry keeps of the manifest: ids, expiries, targets, paths and digests the
    broker checks again later; never a value or a capability."""
    info = os.lstat(mf.run_dir(manifest))
    return {
        "file": manifest.file,
        "sha256": manifest.sha256,
        "owner_uid": owner,
        "run_dir": mf.run_dir(manifest),
        "run_dir_identity": [info.st_dev, info.st_ino],
        "version": manifest.version,
        "run_id": manifest.run_id,
        "task_branch": manifest.task_branch,
        "revision": manifest.repository_revision,
        "expiries": [
            [lease.lease_id, lease.expires_at.timestamp()]
            for lease in manifest.leases
            if lease.expires_at is not None and mf.expiry_checked(manifest, lease)
        ],
        "leases": [
            {
                "lease_id": lease.lease_id,
                "scope": lease.scope,
                "consumer": lease.consumer,
                "expires_at": None if lease.expires_at is None else lease.expires_at.isoformat(),
            }
            for lease in manifest.leases
        ],
        "mounts": [
            {"lease_id": m.lease, "target": m.target, "kind": m.kind.value, "source": m.source}
            for m in plan_mounts
            if m.lease is not None
        ],
        "spools": [
            {"lease_id": m.lease, "target": m.target, "source": m.source}
            for m in plan_mounts
            if m.kind is MountKind.SPOOL
        ],
        "materializations": [item.source_path for lease in manifest.leases for item in lease.materializations],
    }


def expired(manifest_record: dict[str, Any], now: float) -> str | None:
    """The id of a lease whose expiry has passed, if any."""
    for lease_id, moment in manifest_record.get("expiries", []):
        if float(moment) <= now:
            return str(lease_id)
    return None


def provider_environment(
    manifest_record: dict[str, Any], *, consumer: str, executable: str, caller_env: dict[str, str]
) -> dict[str, str]:
    """The whole environment of a provider launch, or PolicyError: the fixed PATH, the private
    state directories, the lease's inherited names from the caller, and the consumer's
    provider-environment values read now (their digests recomputed from these bytes)."""
    file = str(manifest_record["file"])
    checked = mf.load(file, forbidden=())
    if checked.sha256 != manifest_record["sha256"]:
        raise PolicyError(f"{file}: the manifest changed since the sandbox was created")
    identities = [
        lease
        for lease in checked.by_scope(mf.MODEL_IDENTITY)
        if lease.consumer == consumer and lease.executable == executable
    ]
    if len(identities) != 1:
        raise PolicyError(f"no live model-identity lease grants consumer {consumer} the executable {executable}")
    env = {"PATH": SAFE_PATH}
    env.update({name: f"{STATE_ROOT}/{sub}" for name, sub in STATE_DIRS})
    for name in identities[0].inherited_environment:
        if name not in caller_env:
            raise PolicyError(
                f"{identities[0].field}.inherited_environment: {name} is not set in the caller's environment"
            )
        env[name] = caller_env[name]
    owner = int(manifest_record["owner_uid"])
    for lease in checked.by_scope(mf.PROVIDER_ENVIRONMENT):
        if lease.consumer != consumer:
            continue
        for index, item in enumerate(lease.materializations):
            data = mf.read_material(checked, lease, index, owner=owner)
            env[str(item.environment_name)] = data.decode("utf-8")
    return env


def remove(
    manifest_record: dict[str, Any], *, backend: str, sandbox_id: str, materializations: bool
) -> tuple[list[str], list[str]]:
    """Remove the spools and, when the sandbox had consumed its assignment (`materializations`),
    every recorded materialization source: (removed, residue)."""
    from sandboxer import workspace

    removed: list[str] = []
    residue: list[str] = []
    for spool in manifest_record.get("spools", []):
        source = str(spool["source"])
        if backend == "docker":
            problem = remove_volume(source, sandbox_id=sandbox_id)
            if problem == "gone":
                continue
            (residue if problem else removed).append(f"spool volume {source}" + (f": {problem}" if problem else ""))
        elif not unmount_below(source) and workspace.remove_tree(source):
            removed.append(f"spool {source}")
        else:
            residue.append(f"spool {source}")
    if materializations:
        more_removed, more_residue = _remove_materializations(manifest_record)
        removed += more_removed
        residue += more_residue
    return removed, residue


def _remove_materializations(manifest_record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Remove the run's recorded sources, relative to the run directory opened without following
    symlinks and checked to be the very directory create saw: a run directory swapped (or a
    parent made a symlink) since is left alone and reported."""
    import shutil

    from sandboxer.fsutil import open_dir_nofollow

    sources = [str(source) for source in manifest_record.get("materializations", [])]
    directory = str(manifest_record.get("run_dir", ""))
    identity = manifest_record.get("run_dir_identity")
    try:
        run_fd = open_dir_nofollow(directory)
    except OSError:
        return [], [f"materialization {source}: the run directory cannot be reached safely" for source in sources]
    removed: list[str] = []
    residue: list[str] = []
    try:
        info = os.fstat(run_fd)
        if [info.st_dev, info.st_ino] != identity or info.st_uid != manifest_record.get("owner_uid"):
            return [], [f"materialization {source}: the run directory changed since create" for source in sources]
        for source in sources:
            parent, name = os.path.split(os.path.relpath(source, directory))
            try:
                parent_fd = _walk(run_fd, parent)
            except FileNotFoundError:
                continue
            except OSError:
                residue.append(f"materialization {source}")
                continue
            try:
                seen = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                if stat.S_ISDIR(seen.st_mode):
                    shutil.rmtree(name, dir_fd=parent_fd)
                else:
                    os.unlink(name, dir_fd=parent_fd)
                removed.append(f"materialization {source}")
            except FileNotFoundError:
                continue
            except OSError:
                residue.append(f"materialization {source}")
            finally:
                os.close(parent_fd)
    finally:
        os.close(run_fd)
    return removed, residue


def _walk(directory_fd: int, relative: str) -> int:
    """A new descriptor of the directory `relative` below `directory_fd`, symlink-free."""
    current = os.dup(directory_fd)
    for part in [p for p in relative.split("/") if p]:
        try:
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
        finally:
            os.close(current)
        current = inner
    return current


def create_volume(name: str, *, sandbox_id: str, state_dir: str) -> str:
    """Create the named volume of a spool; returns its host mount point (the broker is root)."""
    from sandboxer import dockerexec
    from sandboxer.backends.docker.render import LABEL, STATE_LABEL

    body: dict[str, object] = {"Name": name, "Driver": "local", "Labels": {LABEL: sandbox_id, STATE_LABEL: state_dir}}
    try:
        status, content = dockerexec.engine_request("GET", f"/volumes/{name}")
        if status == 200:
            raise PolicyError(f"spool volume {name} already exists: a run's spool belongs to one sandbox")
        status, content = dockerexec.engine_request("POST", "/volumes/create", body)
    except (OSError, dockerexec.EngineError) as exc:
        raise BackendError(f"docker: the spool volume could not be created ({exc})") from None
    if status != 201:
        raise BackendError(f"docker: the spool volume could not be created (HTTP {status})")
    mountpoint = json.loads(content).get("Mountpoint")
    if not isinstance(mountpoint, str) or not os.path.isdir(mountpoint):
        raise BackendError(f"docker: spool volume {name} has no local mount point")
    return mountpoint


def orphan_volumes(state_dir: str, present: Callable[[], set[str]]) -> list[tuple[str, str]]:
    """(volume, sandbox id) of spool volumes this state dir made whose sandbox directory is gone.

    `present` lists the sandbox directories; it is asked only after the volumes are listed: a
    create makes its directory before its volumes, so one in progress is never taken for gone.
    """
    from urllib.parse import quote

    from sandboxer import dockerexec
    from sandboxer.backends.docker.render import LABEL, STATE_LABEL

    filters = quote(json.dumps({"label": [f"{STATE_LABEL}={state_dir}"]}))
    try:
        status, content = dockerexec.engine_request("GET", f"/volumes?filters={filters}")
        found = json.loads(content).get("Volumes") or [] if status == 200 else []
    except (OSError, ValueError, dockerexec.EngineError):
        return []
    orphans = []
    present_ids = present()
    for volume in found:
        owner = (volume.get("Labels") or {}).get(LABEL)
        if (
            isinstance(owner, str)
            and owner not in present_ids
            and str(volume.get("Name", "")).startswith(SPOOL_VOLUME_PREFIX)
        ):
            orphans.append((str(volume["Name"]), owner))
    return orphans


def remove_volume(name: str, *, sandbox_id: str) -> str | None:
    """Remove this sandbox's spool volume: None when removed, "gone" when it was not there (or is
    another sandbox's, which is never touched), else what went wrong."""
    from sandboxer import dockerexec
    from sandboxer.backends.docker.render import LABEL

    try:
        status, content = dockerexec.engine_request("GET", f"/volumes/{name}")
        if status == 404:
            return "gone"
        document = json.loads(content) if status == 200 else {}
        if status == 200 and (document.get("Labels") or {}).get(LABEL) != sandbox_id:
            return "gone"
        mountpoint = document.get("Mountpoint")
        # Its tmpfs goes first: the Engine removes a volume's directory, not what is mounted on it.
        if isinstance(mountpoint, str) and mountpoint.startswith("/") and unmount_below(mountpoint):
            return f"its tmpfs at {mountpoint} cannot be unmounted"
        status, _ = dockerexec.engine_request("DELETE", f"/volumes/{name}")
    except (OSError, ValueError, dockerexec.EngineError) as exc:
        return f"the Engine cannot be reached ({exc})"
    return None if status in (204, 404) else f"the Engine answered HTTP {status}"


def spool_mismatches(plan: Plan, inside: list[MountSeen]) -> list[str]:
    """Docker spools the sandbox does not see as the broker's tmpfs on their volume: the mount at
    each spool target inside must be that tmpfs (same filesystem and root)."""
    spools = [m for m in plan.mounts if m.kind is MountKind.SPOOL]
    if plan.backend != "docker" or not spools:
        return []
    from sandboxer import dockerexec
    from sandboxer.observe import parse_mountinfo

    with open("/proc/self/mountinfo") as stream:
        host = {m.target: m for m in parse_mountinfo(stream.read())}  # the last at a point is on top
    seen = {m.target: m for m in inside}
    problems = []
    for mount in spools:
        try:
            status, content = dockerexec.engine_request("GET", f"/volumes/{mount.source}")
            mountpoint = json.loads(content).get("Mountpoint") if status == 200 else None
        except (OSError, ValueError, dockerexec.EngineError):
            mountpoint = None
        ours, theirs = host.get(str(mountpoint)), seen.get(mount.target)
        if (
            ours is None
            or theirs is None
            or ours.fstype != "tmpfs"
            or (ours.device, ours.root, ours.fstype) != (theirs.device, theirs.root, theirs.fstype)
        ):
            problems.append(f"lease {mount.lease}: {mount.target} is not its spool's bounded tmpfs inside the sandbox")
    return problems


# ------------------------------------------------------------- bwrap as root: staged lease sources
#
# bwrap (0.8) resolves a --ro-bind-fd source back to its path and walks it as the sandbox's own
# unprivileged uid, which cannot pass the run directory (0700, the assignment owner's). So a root
# broker binds each lease source, opened symlink-free below the run directory, read-only onto a
# mount point in the sandbox's own directory (0711) first; bwrap binds from there. teardown and
# gc unmount them before anything else (`unstage`).

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 1 << 18
_MNT_DETACH = 2


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount_call(source: str | None, target: str, flags: int) -> None:
    import ctypes

    result = _libc().mount(None if source is None else source.encode(), target.encode(), None, flags, None)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def stage(plan: Plan, sandbox_dir: str, *, owner: int) -> Plan:
    """The plan with each lease bind's source replaced by a read-only staged bind of it.

    The staging directory is root's and 0710 with the sandbox's own host group, so that only
    bwrap (run as the sandbox's uid and gid) passes it, and it is a private mount of its own, so
    nothing bound below it propagates to other mount namespaces."""
    from dataclasses import replace as replaced

    staging = os.path.join(sandbox_dir, "leases")
    mounts = []
    for index, mount in enumerate(plan.mounts):
        if mount.kind is not MountKind.RO_BIND or mount.lease is None or mount.beneath is None:
            mounts.append(mount)
            continue
        point = os.path.join(staging, str(index))
        try:
            if not os.path.isdir(staging):
                os.mkdir(staging, 0o700)
                os.chown(staging, 0, plan.host_gid)
                os.chmod(staging, 0o710)  # noqa: S103 - root's, passable by the sandbox's own group only
                _mount_call(staging, staging, _MS_BIND)
                _mount_call(None, staging, _MS_PRIVATE)
            fd = open_beneath_checked(mount)
        except OSError as exc:
            raise PolicyError(
                f"lease {mount.lease}: its source {mount.source} cannot be opened ({exc.strerror})"
            ) from None
        try:
            info = os.fstat(fd)
            if info.st_uid != owner:
                raise PolicyError(f"lease {mount.lease}: its source {mount.source} changed owner since it was checked")
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(point, 0o755)
            else:
                os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
            _mount_call(f"/proc/self/fd/{fd}", point, _MS_BIND)
            _mount_call(None, point, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        except OSError as exc:
            raise BackendError(f"lease {mount.lease}: staging its source failed ({exc.strerror})") from None
        finally:
            os.close(fd)
        mounts.append(replaced(mount, source=point, beneath=staging))
    return replaced(plan, mounts=tuple(mounts))


def staged_mismatches(staged: Plan, inside: list[MountSeen]) -> list[str]:
    """Lease binds of a staged plan that the sandbox does not see as their staged mount.

    The staged mounts exist in the broker's mount namespace. A Docker daemon in another one would
    bind the empty point beneath them instead, and the sandbox would see an empty lease: the
    mount at each lease target inside must show the filesystem and root the staged mount has."""
    from sandboxer.observe import parse_mountinfo

    with open("/proc/self/mountinfo") as stream:
        host = {m.target: m for m in parse_mountinfo(stream.read())}  # the last at a point is on top
    seen = {m.target: m for m in inside}
    problems = []
    for mount in staged.mounts:
        staged_bind = mount.lease is not None and mount.kind is MountKind.RO_BIND
        if not staged_bind or os.path.basename(str(mount.beneath)) != "leases":
            continue
        ours, theirs = host.get(str(mount.source)), seen.get(mount.target)
        if ours is None or theirs is None or (ours.device, ours.root) != (theirs.device, theirs.root):
            problems.append(f"lease {mount.lease}: {mount.target} is not its staged source inside the sandbox")
    return problems


def open_beneath_checked(mount: Mount) -> int:
    """A lease source or spool opened below its directory without following symlinks on the
    whole path from /, and still of a kind the check allowed."""
    from sandboxer.fsutil import open_beneath

    fd = open_beneath(str(mount.beneath), str(mount.source), strict_root=True)
    try:
        check_lease_fd(fd, mount)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unstage(sandbox_dir: str) -> list[str]:
    """Unmount every staged lease source of a sandbox and the staging mount itself; returns what
    could not be unmounted."""
    return unmount_below(os.path.join(sandbox_dir, "leases"))


def unmount_below(directory: str) -> list[str]:
    """Unmount (lazily) every mount at or below `directory`, deepest first; what could not be."""
    from sandboxer.fsutil import mount_points

    left = []
    points = {p for p in mount_points() if p == directory or p.startswith(directory + "/")}
    for point in sorted(points, key=len, reverse=True):
        if _libc().umount2(point.encode(), _MNT_DETACH) != 0:
            left.append(f"mount {point}")
    return left


def _mount_spool_tmpfs(root: str) -> None:
    """A private tmpfs of SPOOL_FS_OPTIONS at the spool's directory: no exec, setuid or devices."""
    import ctypes

    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc().mount(b"tmpfs", root.encode(), b"tmpfs", flags, SPOOL_FS_OPTIONS.encode()) != 0:
        code = ctypes.get_errno()
        raise BackendError(f"spool {os.path.basename(root)}: its tmpfs cannot be mounted ({os.strerror(code)})")
    _mount_call(None, root, _MS_PRIVATE)
