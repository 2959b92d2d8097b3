"""The sandbox record's JSON form loses nothing, and a record out of shape is refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxer.core.plan import Mount, MountKind
from sandboxer.core.record import (
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
from sandboxer.core.record_exec import ExecView
from sandboxer.core.record_reading import read_record

text = st.text(max_size=12)
maybe_text = st.none() | text
number = st.integers(min_value=-(2**63), max_value=2**63)
maybe_number = st.none() | number
texts = st.lists(text, max_size=3).map(tuple)


@st.composite
def mounts(draw: st.DrawFn) -> Mount:
    kind = draw(st.sampled_from(MountKind))
    return Mount(
        kind=kind,
        target=draw(text),
        source=draw(maybe_text),
        mode=draw(st.none() | st.integers(0, 0o7777)),
        size_bytes=draw(maybe_number),
        content=kept_content(kind),
        lease=draw(maybe_text),
        beneath=draw(maybe_text),
    )


manifests = st.builds(
    ManifestRecord,
    file=text,
    sha256=text,
    owner_uid=number,
    run_dir=text,
    run_dir_identity=st.tuples(number, number),
    version=text,
    run_id=text,
    task_branch=text,
    revision=text,
    expiries=st.lists(st.tuples(text, st.floats(allow_nan=False, allow_infinity=False)), max_size=3).map(tuple),
    leases=st.lists(
        st.builds(LeaseRecord, lease_id=text, scope=text, consumer=maybe_text, expires_at=maybe_text), max_size=3
    ).map(tuple),
    mounts=st.lists(st.builds(LeaseMount, lease_id=text, target=text, kind=text, source=maybe_text), max_size=3).map(
        tuple
    ),
    spools=st.lists(st.builds(Spool, lease_id=text, target=text, source=text), max_size=2).map(tuple),
    materializations=texts,
)

records = st.builds(
    SandboxRecord,
    id=text,
    profile=text,
    backend=st.sampled_from(["bwrap", "docker"]),
    state=text,
    created_at=text,
    owner_pid=maybe_number,
    owner_start=maybe_number,
    caller_uid=maybe_number,
    expires_at=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    idle_seconds=maybe_number,
    warm_profile=st.booleans(),
    consumed=st.booleans(),
    workspace_fs=st.none() | st.builds(WorkspaceFs, mib=number, enforced=st.booleans(), kind=maybe_text),
    work=st.none()
    | st.builds(
        WorkRecord,
        base=text,
        ref=text,
        repository=text,
        exported=st.lists(st.tuples(st.sampled_from(["commits", "tree"]), text), max_size=3).map(tuple),
    ),
    manifest=st.none() | manifests,
    bootstrap=st.none() | st.builds(BootstrapRecord, target=text, suspend_control=st.booleans()),
    limits=st.none()
    | st.builds(
        LimitsRecord,
        mechanism=text,
        groups=texts,
        procs_files=texts,
        rlimits=st.lists(st.tuples(number, number), max_size=3).map(tuple),
        memory_mib=number,
        pids=number,
    ),
    seccomp=st.none() | st.builds(SeccompRecord, allow_ptrace=st.booleans(), sha256=maybe_text),
    plan=st.none()
    | st.builds(
        PlanShare,
        uid=number,
        gid=number,
        host_uid=number,
        host_gid=number,
        env=st.lists(st.tuples(text, text), max_size=3).map(tuple),
        runtime_path=text,
        runtime_sha256=text,
        allow_ptrace=st.booleans(),
        mounts=st.lists(mounts(), max_size=4).map(tuple),
    ),
    processes=st.none()
    | st.builds(
        Processes,
        bwrap_pid=maybe_number,
        bwrap_start=maybe_number,
        init_pid=maybe_number,
        init_start=maybe_number,
        holder_pid=number,  # a record with processes always names its holder
        holder_start=maybe_number,
        pid_namespace=maybe_number,
    ),
    image=maybe_text,
    container_id=maybe_text,
    services=st.none()
    | st.builds(
        ServicesRecord,
        network=maybe_text,
        image_user=st.booleans(),
        sidecars=st.lists(
            st.builds(ServiceRecord, name=text, image=text, container_id=maybe_text, address=maybe_text), max_size=3
        ).map(tuple),
        proxy_image=maybe_text,
        proxies=st.lists(st.tuples(number, text), max_size=3).map(tuple),
        proxy_sockets=maybe_text,
    ),
    warm=st.none()
    | st.builds(
        WarmStamp,
        profile_sha256=text,
        extension_sha256=text,
        image=text,
        body_sha256=text,
        probe=st.dictionaries(text, number | texts.map(list), max_size=3),
        interfaces=texts,
        pid=maybe_number,
        started_at=maybe_text,
        since=number,
        workspace_refs=text,
    ),
)


def through_json(record: SandboxRecord) -> Any:
    return json.loads(json.dumps(record.to_json()))


@settings(max_examples=300)
@given(records)
def test_a_record_read_back_from_its_json_is_the_same_record(record: SandboxRecord) -> None:
    assert read_record(through_json(record)) == record


@settings(max_examples=200)
@given(records)
def test_the_exec_paths_view_reads_what_the_record_says(record: SandboxRecord) -> None:
    view = ExecView(through_json(record))
    assert (view.state, view.backend) == (record.state, record.backend)
    assert view.env == (dict(record.plan.env) if record.plan else {})
    assert view.expiries == (list(record.manifest.expiries) if record.manifest else [])
    assert view.container_id == record.container_id
    assert view.workspace_sized == (record.workspace_fs is not None and record.workspace_fs.enforced)
    assert view.has_manifest == (record.manifest is not None)
    if record.plan is not None:
        assert (view.uid, view.gid, view.host_uid, view.host_gid) == (
            record.plan.uid,
            record.plan.gid,
            record.plan.host_uid,
            record.plan.host_gid,
        )
    if record.processes is not None:
        processes = record.processes
        assert (view.holder_pid, view.holder_start) == (processes.holder_pid, processes.holder_start)
        assert (view.init_pid, view.init_start) == (processes.init_pid, processes.init_start)
    if record.limits is not None:
        assert view.limits_mechanism == record.limits.mechanism
        assert view.cgroups == record.limits.groups
        assert view.procs_files == record.limits.procs_files
        assert view.rlimits == record.limits.rlimits


def a_record() -> dict[str, Any]:
    plan = PlanShare(
        uid=1000,
        gid=1000,
        host_uid=1000,
        host_gid=1000,
        env=(("PATH", "/usr/bin"),),
        runtime_path="/opt/runtime",
        runtime_sha256="0" * 64,
        allow_ptrace=False,
        mounts=(Mount(kind=MountKind.RO_BIND, target="/usr", source="/usr"),),
    )
    record = SandboxRecord(
        id="0" * 24,
        profile="p",
        backend="bwrap",
        state="ready",
        created_at="2026-11-30T00:00:00Z",
        limits=LimitsRecord(mechanism="rlimits", memory_mib=512, pids=256),
        plan=plan,
    )
    data: dict[str, Any] = through_json(record)
    return data


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda r: r.update(format=2), "format"),
        (lambda r: r.update(backend="lxc"), "backend"),
        (lambda r: r.update(state=None), "state"),
        (lambda r: r["limits"].update(pids="256"), "limits.pids"),
        (lambda r: r["limits"].update(memory_mib=True), "limits.memory_mib"),
        (lambda r: r.update(surprise=1), "surprise"),
        (lambda r: r["mounts"][0].update(kind="overlay"), "mounts[0].kind"),
        (lambda r: r.update(env=[["PATH"]]), "env"),
        (lambda r: r.update(limits=[]), "limits"),
    ],
    ids=["format", "backend", "state", "pids-text", "memory-bool", "unknown-key", "mount-kind", "env-pair", "limits"],
)
def test_a_record_out_of_shape_is_refused_naming_the_field(change: Any, path: str) -> None:
    data = a_record()
    change(data)
    with pytest.raises(RecordShapeError) as refused:
        read_record(data)
    assert refused.value.path == path


def test_the_plan_a_record_keeps_is_the_plan_it_was_made_from() -> None:
    record = read_record(a_record())
    plan = record.plan_for("/state/sandboxes/x/workspace")
    assert plan.mounts == (Mount(kind=MountKind.RO_BIND, target="/usr", source="/usr"),)
    assert (plan.uid, plan.host_uid, plan.env) == (1000, 1000, (("PATH", "/usr/bin"),))
    assert (plan.limits.memory_mib, plan.limits.pids) == (512, 256)
    assert PlanShare.of(plan) == record.plan
