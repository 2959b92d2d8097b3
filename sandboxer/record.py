"""A sandbox's record (`<state>/sandboxes/ID/record.json`) and the plan it keeps.

The record is the registry's truth about a sandbox: what create made, what exec enters, what
inspect compares and teardown removes. The plan's share of it is written and read back here, so
that both directions stay one pair.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sandboxer.config_types import DEFAULT_WORKSPACE_MIB, Limits
from sandboxer.plan import Mount, MountKind, Plan


def plan_fields(plan: Plan) -> dict[str, Any]:
    """The plan as the record keeps it: what exec, inspect and teardown read back."""
    return {
        "uid": plan.uid,
        "gid": plan.gid,
        "host_uid": plan.host_uid,
        "host_gid": plan.host_gid,
        "env": [list(pair) for pair in plan.env],
        "runtime_path": plan.runtime_path,
        "runtime_sha256": plan.runtime_sha256,
        "allow_ptrace": plan.allow_ptrace,
        "mounts": [
            {
                "target": m.target,
                "kind": m.kind.value,
                "source": m.source,
                "read_only": m.read_only,
                "mode": m.mode,
                "size_bytes": m.size_bytes,
                "lease": m.lease,
                "beneath": m.beneath,
            }
            for m in plan.mounts
        ],
    }


def plan_from_record(record: dict[str, Any], workspace_source: str) -> Plan:
    """The plan a sandbox was made from, as its record keeps it (what verification compares)."""
    return Plan(
        sandbox_id=record["id"],
        profile=record["profile"],
        backend=record["backend"],
        runtime_path=record["runtime_path"],
        runtime_sha256=record["runtime_sha256"],
        workspace_source=workspace_source,
        uid=record["uid"],
        gid=record["gid"],
        host_uid=record["host_uid"],
        host_gid=record["host_gid"],
        user="sandbox",
        hostname="sandbox",
        mounts=tuple(
            Mount(
                kind=MountKind(m["kind"]),
                target=m["target"],
                source=m.get("source"),
                mode=m.get("mode"),
                size_bytes=m.get("size_bytes"),
                content=b"" if m["kind"] == "file" else None,
                lease=m.get("lease"),
                beneath=m.get("beneath"),
            )
            for m in record["mounts"]
        ),
        env=tuple((k, v) for k, v in record["env"]),
        limits=Limits(
            memory_mib=record["limits"]["memory_mib"],
            pids=record["limits"]["pids"],
            workspace_mib=(record.get("workspace_fs") or {}).get("mib", DEFAULT_WORKSPACE_MIB),
        ),
        allow_ptrace=bool(record.get("allow_ptrace", False)),
    )


def now_text() -> str:
    """A record's time stamp: UTC, to the second (`created_at`)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
