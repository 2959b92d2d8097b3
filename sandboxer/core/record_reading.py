"""Reading a sandbox's record back from its JSON form (sandboxer.core.record writes it).

Every field is checked for its type, and a key the record never has is refused: a record out of
shape (a bug, a crash mid-write is impossible — writes are atomic — or tampering) is refused as
a whole with the path of the first field that is wrong (RecordShapeError), never half-read.
"""

from __future__ import annotations

from typing import Any, cast, get_args

from sandboxer.core.plan import Backend, Mount, MountKind
from sandboxer.core.record import (
    RECORD_FORMAT,
    BootstrapRecord,
    LeaseMount,
    LeaseRecord,
    LimitsRecord,
    ManifestRecord,
    PlanShare,
    Processes,
    RecordShapeError,
    SandboxRecord,
    SeccompRecord,
    ServiceRecord,
    ServicesRecord,
    Spool,
    WarmStamp,
    WorkRecord,
    WorkspaceFs,
    kept_content,
)


def read_record(data: object) -> SandboxRecord:
    """The record of a JSON document; RecordShapeError names the first field out of shape."""
    top = _Reader(data, "")
    if top.raw("format") != RECORD_FORMAT:
        raise RecordShapeError("format")
    backend = top.text("backend")
    if backend not in get_args(Backend):
        raise RecordShapeError("backend")
    has_plan = "mounts" in top.data
    has_processes = "holder_pid" in top.data
    known = _TOP_KEYS | (_PLAN_KEYS if has_plan else set()) | (set(_PROCESS_KEYS) if has_processes else set())
    top.only(known)
    return SandboxRecord(
        id=top.text("id"),
        profile=top.text("profile"),
        backend=cast("Backend", backend),
        state=top.text("state"),
        created_at=top.text("created_at"),
        owner_pid=top.maybe_int("owner_pid"),
        owner_start=top.maybe_int("owner_start"),
        caller_uid=top.maybe_int("caller_uid"),
        expires_at=top.maybe_number("expires_at"),
        max_expires_at=top.maybe_number("max_expires_at"),
        idle_seconds=top.maybe_int("idle_seconds"),
        warm_profile=top.flag("warm_profile"),
        consumed=top.flag("consumed"),
        workspace_fs=top.part("workspace_fs", _workspace_fs),
        work=top.part("work", _work),
        manifest=top.part("manifest", _manifest),
        bootstrap=top.part("bootstrap", _bootstrap),
        limits=top.part("limits", _limits),
        seccomp=top.part("seccomp", _seccomp),
        plan=_plan_share(top) if has_plan else None,
        processes=Processes(**{key: top.maybe_int(key) for key in _PROCESS_KEYS}) if has_processes else None,
        image=top.maybe_text("image"),
        container_id=top.maybe_text("container_id"),
        warm=top.part("warm", _warm),
        services=top.part("services", _services),
    )


_TOP_KEYS = {
    "format", "id", "profile", "backend", "state", "created_at", "owner_pid", "owner_start", "caller_uid",
    "expires_at", "max_expires_at", "idle_seconds", "warm_profile",
    "consumed", "workspace_fs", "work", "manifest", "bootstrap", "limits", "seccomp", "image", "container_id", "warm",
    "services",
}  # fmt: skip
_PLAN_KEYS = {
    "uid",
    "gid",
    "host_uid",
    "host_gid",
    "env",
    "runtime_path",
    "runtime_sha256",
    "allow_ptrace",
    "mounts",
    "caller_env",
}
_WARM_SEEN = {"pid", "started_at", "since"}
_PROCESS_KEYS = ("bwrap_pid", "bwrap_start", "init_pid", "init_start", "holder_pid", "holder_start", "pid_namespace")


class _Reader:
    """Typed access to one JSON object of a record; `where` is its path, for the refusal."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise RecordShapeError(where or "record")
        self.data: dict[str, Any] = data
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def only(self, keys: set[str]) -> None:
        unknown = sorted(set(self.data) - keys)
        if unknown:
            raise RecordShapeError(self.path(unknown[0]))

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def typed(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        value = self.data.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RecordShapeError(self.path(key))
        return value

    def text(self, key: str) -> str:
        return str(self.typed(key, str))

    def maybe_text(self, key: str) -> str | None:
        value = self.typed(key, str, optional=True)
        return None if value is None else str(value)

    def number(self, key: str) -> int:
        return int(self.typed(key, int))

    def maybe_int(self, key: str) -> int | None:
        value = self.typed(key, int, optional=True)
        return None if value is None else int(value)

    def maybe_number(self, key: str) -> float | None:
        value = self.typed(key, (int, float), optional=True)
        return None if value is None else float(value)

    def flag(self, key: str) -> bool:
        return bool(self.typed(key, bool, optional=True))

    def items(self, key: str) -> list[Any]:
        return list(self.typed(key, list))

    def texts(self, key: str) -> tuple[str, ...]:
        values = self.items(key)
        if not all(isinstance(value, str) for value in values):
            raise RecordShapeError(self.path(key))
        return tuple(values)

    def pairs(self, key: str, first: type, second: type | tuple[type, ...]) -> tuple[tuple[Any, Any], ...]:
        found = []
        for item in self.items(key):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], first)):
                raise RecordShapeError(self.path(key))
            if not isinstance(item[1], second) or isinstance(item[1], bool):
                raise RecordShapeError(self.path(key))
            found.append((item[0], item[1]))
        return tuple(found)

    def objects(self, key: str) -> list[_Reader]:
        return [_Reader(item, f"{self.path(key)}[{index}]") for index, item in enumerate(self.items(key))]

    def part(self, key: str, read: Any) -> Any:
        value = self.data.get(key)
        return None if value is None else read(_Reader(value, self.path(key)))


def _workspace_fs(part: _Reader) -> WorkspaceFs:
    part.only({"mib", "enforced", "kind"})
    return WorkspaceFs(
        mib=part.number("mib"), enforced=bool(part.typed("enforced", bool)), kind=part.maybe_text("kind")
    )


def _work(part: _Reader) -> WorkRecord:
    part.only({"base", "ref", "repository", "exported"})
    return WorkRecord(
        base=part.text("base"),
        ref=part.text("ref"),
        repository=part.text("repository"),
        exported=part.pairs("exported", str, str),
    )


def _bootstrap(part: _Reader) -> BootstrapRecord:
    part.only({"target", "suspend_control"})
    return BootstrapRecord(target=part.text("target"), suspend_control=part.flag("suspend_control"))


def _limits(part: _Reader) -> LimitsRecord:
    part.only({"mechanism", "groups", "procs_files", "rlimits", "memory_mib", "pids", "cpus"})
    return LimitsRecord(
        mechanism=part.text("mechanism"),
        groups=part.texts("groups"),
        procs_files=part.texts("procs_files"),
        rlimits=part.pairs("rlimits", int, int),
        memory_mib=part.number("memory_mib"),
        pids=part.number("pids"),
        cpus=part.maybe_number("cpus"),
    )


def _seccomp(part: _Reader) -> SeccompRecord:
    part.only({"allow_ptrace", "sha256"})
    return SeccompRecord(allow_ptrace=part.flag("allow_ptrace"), sha256=part.maybe_text("sha256"))


def _warm(part: _Reader) -> WarmStamp:
    part.only(
        {
            "profile_sha256",
            "extension_sha256",
            "image",
            "body_sha256",
            "probe",
            "interfaces",
            "pid",
            "started_at",
            "since",
            "workspace_refs",
        }
    )
    return WarmStamp(
        profile_sha256=part.text("profile_sha256"),
        extension_sha256=part.text("extension_sha256"),
        image=part.text("image"),
        body_sha256=part.text("body_sha256"),
        probe=dict(part.typed("probe", dict)),
        interfaces=part.texts("interfaces"),
        pid=part.maybe_int("pid"),
        started_at=part.maybe_text("started_at"),
        since=part.number("since"),
        workspace_refs=part.maybe_text("workspace_refs") or "",  # a record from before: stale when taken
    )


def _services(part: _Reader) -> ServicesRecord:
    part.only({"network", "image_user", "sidecars", "proxy_image", "proxies", "proxy_sockets"})
    sidecars = []
    for item in part.objects("sidecars"):
        item.only({"name", "image", "container_id", "address"})
        sidecars.append(
            ServiceRecord(
                name=item.text("name"),
                image=item.text("image"),
                container_id=item.maybe_text("container_id"),
                address=item.maybe_text("address"),
            )
        )
    return ServicesRecord(
        network=part.maybe_text("network"),
        image_user=part.flag("image_user"),
        sidecars=tuple(sidecars),
        proxy_image=part.maybe_text("proxy_image"),
        proxies=part.pairs("proxies", int, str) if part.raw("proxies") is not None else (),
        proxy_sockets=part.maybe_text("proxy_sockets"),
    )


def _manifest(part: _Reader) -> ManifestRecord:
    keys = {"file", "sha256", "owner_uid", "run_dir", "run_dir_identity", "version", "run_id", "task_branch"}
    part.only(keys | {"revision", "expiries", "leases", "mounts", "spools", "materializations", "published"})
    identity = part.items("run_dir_identity")
    if len(identity) != 2 or not all(type(value) is int for value in identity):
        raise RecordShapeError(part.path("run_dir_identity"))
    return ManifestRecord(
        file=part.text("file"),
        sha256=part.text("sha256"),
        owner_uid=part.number("owner_uid"),
        run_dir=part.text("run_dir"),
        run_dir_identity=(identity[0], identity[1]),
        version=part.text("version"),
        run_id=part.text("run_id"),
        task_branch=part.text("task_branch"),
        revision=part.text("revision"),
        expiries=tuple((lease, float(moment)) for lease, moment in part.pairs("expiries", str, (int, float))),
        leases=tuple(
            LeaseRecord(
                lease_id=item.text("lease_id"),
                scope=item.text("scope"),
                consumer=item.maybe_text("consumer"),
                expires_at=item.maybe_text("expires_at"),
            )
            for item in part.objects("leases")
        ),
        mounts=tuple(
            LeaseMount(
                lease_id=item.text("lease_id"),
                target=item.text("target"),
                kind=item.text("kind"),
                source=item.maybe_text("source"),
            )
            for item in part.objects("mounts")
        ),
        spools=tuple(
            Spool(lease_id=item.text("lease_id"), target=item.text("target"), source=item.text("source"))
            for item in part.objects("spools")
        ),
        materializations=part.texts("materializations"),
        published=part.pairs("published", int, int) if part.raw("published") is not None else (),
    )


def _plan_share(top: _Reader) -> PlanShare:
    mounts = []
    for item in top.objects("mounts"):
        item.only({"target", "kind", "source", "read_only", "mode", "size_bytes", "lease", "beneath"})
        try:
            kind = MountKind(item.text("kind"))
        except ValueError:
            raise RecordShapeError(item.path("kind")) from None
        mounts.append(
            Mount(
                kind=kind,
                target=item.text("target"),
                source=item.maybe_text("source"),
                mode=item.maybe_int("mode"),
                size_bytes=item.maybe_int("size_bytes"),
                content=kept_content(kind),
                lease=item.maybe_text("lease"),
                beneath=item.maybe_text("beneath"),
            )
        )
    return PlanShare(
        uid=top.number("uid"),
        gid=top.number("gid"),
        host_uid=top.number("host_uid"),
        host_gid=top.number("host_gid"),
        env=top.pairs("env", str, str),
        runtime_path=top.text("runtime_path"),
        runtime_sha256=top.text("runtime_sha256"),
        allow_ptrace=top.flag("allow_ptrace"),
        mounts=tuple(mounts),
        caller_env=top.texts("caller_env") if "caller_env" in top.data else (),
    )
