"""exec's view of a sandbox record: the few fields `sandboxer exec` needs, read on every exec.

sandboxer.core.record is the record's typed form; reading all of it for every exec is needless
work when exec needs a dozen fields, so exec reads record.json through this class: plain
attributes, each checked for its type as sandboxer.core.record_reading checks it.
tests/unit/test_record_roundtrip.py holds the two to the same reading of every record.
"""

from __future__ import annotations


class ExecViewError(ValueError):
    """The record lacks a field exec needs, or has it in the wrong type: the field's name."""


def _text(data: dict[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ExecViewError(key)
    return value


def _number(data: dict[str, object], key: str) -> int | None:
    value = data.get(key)
    if value is not None and type(value) is not int:
        raise ExecViewError(key)
    return value


def _texts(data: dict[str, object], key: str) -> tuple[str, ...]:
    values = data.get(key)
    if values is None:
        return ()
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        raise ExecViewError(key)
    return tuple(values)


def _int_pairs(values: object, key: str) -> list[tuple[int, int]]:
    if not isinstance(values, list):
        raise ExecViewError(key)
    pairs = []
    for item in values:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise ExecViewError(key)
        pairs.append((item[0], item[1]))
    return pairs


def _environment(pairs: object) -> dict[str, str]:
    if not isinstance(pairs, list):
        raise ExecViewError("env")
    env: dict[str, str] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair)):
            raise ExecViewError("env")
        env[pair[0]] = pair[1]
    return env


def _expiries(pairs: object) -> list[tuple[str, float]]:
    if not isinstance(pairs, list):
        raise ExecViewError("manifest.expiries")
    expiries = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ExecViewError("manifest.expiries")
        if not isinstance(pair[1], int | float) or isinstance(pair[1], bool):
            raise ExecViewError("manifest.expiries")
        expiries.append((pair[0], float(pair[1])))
    return expiries


class ExecView:
    """What exec reads of a record: its state and backend, the environment, the lease expiries,
    and how to enter it (bwrap: the holder's namespaces, limits; Docker: the container, user)."""

    __slots__ = (
        "backend",
        "caller_env",
        "cgroups",
        "container_id",
        "env",
        "expiries",
        "gid",
        "has_manifest",
        "holder_pid",
        "holder_start",
        "host_gid",
        "host_uid",
        "init_pid",
        "init_start",
        "limits_mechanism",
        "memory_mib",
        "pids",
        "procs_files",
        "rlimits",
        "state",
        "uid",
        "workspace_sized",
    )

    def __init__(self, data: object) -> None:
        if not isinstance(data, dict):
            raise ExecViewError("record")
        self.state = _text(data, "state")
        self.backend = _text(data, "backend")
        self.env = _environment(data.get("env") or [])
        self.caller_env = frozenset(_texts(data, "caller_env"))
        manifest = data.get("manifest")
        self.has_manifest = isinstance(manifest, dict)
        self.expiries = _expiries(manifest.get("expiries", []) if isinstance(manifest, dict) else [])
        self.uid = _number(data, "uid")
        self.gid = _number(data, "gid")
        self.host_uid = _number(data, "host_uid")
        self.host_gid = _number(data, "host_gid")
        self.holder_pid = _number(data, "holder_pid")
        self.holder_start = _number(data, "holder_start")
        self.init_pid = _number(data, "init_pid")
        self.init_start = _number(data, "init_start")
        self.container_id = _text(data, "container_id")
        workspace_fs = data.get("workspace_fs") or {}
        if not isinstance(workspace_fs, dict) or not isinstance(workspace_fs.get("enforced", False), bool):
            raise ExecViewError("workspace_fs")
        self.workspace_sized = bool(workspace_fs.get("enforced", False))  # a filesystem of limits.workspace_mib
        limits = data.get("limits") or {}
        if not isinstance(limits, dict):
            raise ExecViewError("limits")
        self.limits_mechanism = _text(limits, "mechanism")
        self.cgroups = _texts(limits, "groups")
        self.procs_files = _texts(limits, "procs_files")
        self.rlimits = tuple(_int_pairs(limits.get("rlimits", []), "rlimits"))
        self.memory_mib = _number(limits, "memory_mib")
        self.pids = _number(limits, "pids")
