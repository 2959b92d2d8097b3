"""Parsing the leases of a manifest document, each by its scope, and the rules between them.

Each lease's keys are exactly its scope's (for the document's version), its materializations
have the scope's count, keys and targets, and the leases then agree with each other: unique ids,
one model identity per consumer, no environment name twice, each tool request linked to an
endpoint of its own. `targets_apart` is the mount-target rule create applies on top.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from sandboxer.core.manifest.fields import Reader, clean_absolute, env_name, expiry, label, nested
from sandboxer.core.manifest.schema import (
    ENDPOINT_NAMESPACE,
    EXPIRING,
    ID,
    LEASE_KEYS,
    MATERIAL_RULES,
    MAX_INHERITED,
    MAX_PROVIDER_VALUES,
    MODEL_IDENTITY,
    NAMESPACE,
    PROJECT_ENV_TARGET,
    PROJECT_ENVIRONMENT,
    PROVIDER_CREDENTIAL,
    PROVIDER_ENVIRONMENT,
    REPLAY_POLICY,
    REQUEST_NAMESPACE,
    SCOPE_KEYS,
    SCOPES,
    SHA256,
    SHARED_DIRECTORY,
    SHARED_NAMESPACE,
    TOOL_ENDPOINT,
    TOOL_REQUEST,
    UID_MAX,
    V1_REFUSED_SCOPES,
    Lease,
    Manifest,
    Materialization,
)
from sandboxer.core.strictjson import JsonObject


def parse_lease(r: Reader, value: Any, index: int, version: str) -> Lease:
    path = f"leases[{index}]"
    scope = _lease_keys(r, value, path, version)
    lease_id = r.string(value["lease_id"], f"{path}.lease_id", ID, "must be 1-128 of [A-Za-z0-9._:-]")
    consumer = label(r, value["consumer"], f"{path}.consumer")
    expires = None
    if "expires_at" in value:
        expires = expiry(r.string(value["expires_at"], f"{path}.expires_at"))
        if expires is None:
            r.fail(f"{path}.expires_at", "must be an RFC 3339 time with an offset")
    lease = Lease(
        index=index,
        lease_id=lease_id,
        scope=scope,
        consumer=consumer,
        expires_at=expires,
        materializations=_materializations(r, value["materializations"], path, scope),
    )
    if scope == MODEL_IDENTITY and version != "1":
        lease = _model_identity(r, value, lease)
    if scope == TOOL_REQUEST:
        lease = _request_fields(r, value, lease)
    return lease


def _lease_keys(r: Reader, value: Any, path: str, version: str) -> str:
    """A lease's keys are exactly its scope's (for its version); returns the scope."""
    if not isinstance(value, JsonObject):
        r.fail(path, "must be a JSON object")
    if value.duplicates:
        r.fail(f"{path}.{value.duplicates[0]}", "duplicate key")
    if "scope" not in value:
        r.fail(f"{path}.scope", "missing required field")
    scope = r.string(value["scope"], f"{path}.scope")
    if scope not in SCOPES:
        r.fail(f"{path}.scope", "unknown scope")
    if version == "1" and scope in V1_REFUSED_SCOPES:
        r.fail(f"{path}.scope", "version 1 does not have this scope")
    extra = SCOPE_KEYS.get(scope, ())
    every_extra = {key for keys in SCOPE_KEYS.values() for key in keys}
    for key in value:
        if key in every_extra and key not in extra:
            r.fail(f"{path}.{key}", "belongs to another scope")
        if key in extra and scope == MODEL_IDENTITY and version == "1":
            r.fail(f"{path}.{key}", "version 1 does not have it")
    required = list(LEASE_KEYS)
    if scope in EXPIRING or (scope == MODEL_IDENTITY and version != "1"):
        required.append("expires_at")
    optional = ["expires_at"]
    if scope == MODEL_IDENTITY and version != "1":
        required.append("executable")
        optional.append("inherited_environment")
    elif scope == TOOL_REQUEST:
        required += ["consumer_uid", "endpoint_lease_id", "request_spool_target"]
        optional.append("replay_policy")
    r.obj(value, path, required=required, optional=optional)
    return scope


def _model_identity(r: Reader, value: JsonObject, lease: Lease) -> Lease:
    path = lease.field
    executable = label(r, value["executable"], f"{path}.executable")
    names = r.array(value.get("inherited_environment", []), f"{path}.inherited_environment", MAX_INHERITED)
    inherited: list[str] = []
    for j, name in enumerate(names):
        where = f"{path}.inherited_environment[{j}]"
        env_name(r, name, where, project=False)
        if inherited and name <= inherited[-1]:
            r.fail(where, "names must be unique and strictly ascending")
        inherited.append(name)
    return replace(lease, executable=executable, inherited_environment=tuple(inherited))


def _request_fields(r: Reader, value: JsonObject, lease: Lease) -> Lease:
    path = lease.field
    uid = r.integer(value["consumer_uid"], f"{path}.consumer_uid", 1, UID_MAX)
    endpoint = r.string(value["endpoint_lease_id"], f"{path}.endpoint_lease_id", ID, "must be a lease id")
    spool = clean_absolute(r, value["request_spool_target"], f"{path}.request_spool_target")
    if not spool.startswith(REQUEST_NAMESPACE) or spool == REQUEST_NAMESPACE:
        r.fail(f"{path}.request_spool_target", f"must be strictly below {REQUEST_NAMESPACE}")
    policy = value.get("replay_policy")
    if "replay_policy" in value and r.string(policy, f"{path}.replay_policy") != REPLAY_POLICY:
        r.fail(f"{path}.replay_policy", f'must be "{REPLAY_POLICY}" or absent')
    if lease.materializations[0].target_path != spool + "/.capability":
        r.fail(f"{path}.materializations[0].target_path", "must be <request_spool_target>/.capability")
    return replace(
        lease, consumer_uid=uid, endpoint_lease_id=endpoint, request_spool_target=spool, replay_policy=policy
    )


def _materializations(r: Reader, value: Any, path: str, scope: str) -> tuple[Materialization, ...]:
    fewest, most, required = MATERIAL_RULES[scope]
    items = r.array(value, f"{path}.materializations")
    if not fewest <= len(items) <= most:
        count = "none" if most == 0 else f"exactly {most}" if fewest == most else f"{fewest} to {most}"
        r.fail(f"{path}.materializations", f"a {scope} lease has {count}")
    found = []
    for j, item in enumerate(items):
        where = f"{path}.materializations[{j}]"
        obj = r.obj(item, where, required=("source_path", *required))
        source = clean_absolute(r, obj["source_path"], f"{where}.source_path")
        target = None
        if "target_path" in obj:
            target = clean_absolute(r, obj["target_path"], f"{where}.target_path")
            _target_rule(r, target, f"{where}.target_path", scope)
        name = None
        if "environment_name" in obj:
            name = env_name(r, obj["environment_name"], f"{where}.environment_name", project=False)
        digest = None
        if "sha256" in obj:
            digest = r.string(obj["sha256"], f"{where}.sha256", SHA256, "must be 64 lowercase hex digits")
        found.append(Materialization(source_path=source, target_path=target, environment_name=name, sha256=digest))
    return tuple(found)


def _target_rule(r: Reader, target: str, path: str, scope: str) -> None:
    namespace = {SHARED_DIRECTORY: SHARED_NAMESPACE, TOOL_ENDPOINT: ENDPOINT_NAMESPACE}.get(scope)
    if namespace is not None and (not target.startswith(namespace) or target == namespace.rstrip("/")):
        r.fail(path, f"must be strictly below {namespace}")
    if scope == PROJECT_ENVIRONMENT and target != PROJECT_ENV_TARGET:
        r.fail(path, f"must be exactly {PROJECT_ENV_TARGET}")
    if scope == PROVIDER_CREDENTIAL:
        if target == NAMESPACE or target.startswith(NAMESPACE + "/"):
            r.fail(path, f"must not be under {NAMESPACE}")
        if os.path.dirname(target) == "/":
            r.fail(path, "must not be directly in /")


def between_leases(r: Reader, manifest: Manifest) -> None:
    """The rules that relate leases to each other; the later of two places is named."""
    identities = _identities(r, manifest)
    names: dict[str, set[str]] = {}
    values = 0
    projects = 0
    spooled: set[str] = set()
    for lease in manifest.leases:
        if lease.scope in (PROVIDER_ENVIRONMENT, TOOL_REQUEST) and lease.consumer not in identities:
            r.fail(f"{lease.field}.consumer", "this consumer has no model-identity lease")
        if lease.scope == MODEL_IDENTITY:  # in document order: a clash names the later place
            taken = names.setdefault(lease.consumer, set())
            for j, name in enumerate(lease.inherited_environment):
                if name in taken:
                    r.fail(f"{lease.field}.inherited_environment[{j}]", "this consumer already has this name")
                taken.add(name)
        if lease.scope == PROVIDER_ENVIRONMENT:
            values = _provider_values(r, lease, names.setdefault(lease.consumer, set()), values)
        if lease.scope == PROJECT_ENVIRONMENT:
            projects += 1
            if projects > 1:
                r.fail(f"{lease.field}.scope", "at most one project-environment lease")
        if lease.scope == TOOL_REQUEST:
            _tool_request(r, manifest, lease, spooled)


def _provider_values(r: Reader, lease: Lease, taken: set[str], values: int) -> int:
    """Checks one provider-environment lease's names; returns the running count of values."""
    for j, item in enumerate(lease.materializations):
        values += 1
        where = f"{lease.field}.materializations[{j}]"
        if values > MAX_PROVIDER_VALUES:
            r.fail(where, f"at most {MAX_PROVIDER_VALUES} provider-environment values in all")
        if item.environment_name in taken:
            r.fail(f"{where}.environment_name", "this consumer already has this name")
        taken.add(str(item.environment_name))
    return values


def _identities(r: Reader, manifest: Manifest) -> dict[str, Lease]:
    """Unique lease ids; at most one model identity per consumer; unique executables."""
    seen_ids: set[str] = set()
    identities: dict[str, Lease] = {}
    executables: set[str] = set()
    for lease in manifest.leases:
        if lease.lease_id in seen_ids:
            r.fail(f"{lease.field}.lease_id", "lease ids must be unique")
        seen_ids.add(lease.lease_id)
        if lease.scope == MODEL_IDENTITY:
            if lease.consumer in identities:
                r.fail(f"{lease.field}.consumer", "at most one model-identity lease per consumer")
            identities[lease.consumer] = lease
            if lease.executable is not None:
                if lease.executable in executables:
                    r.fail(f"{lease.field}.executable", "executables must be unique across leases")
                executables.add(lease.executable)
    return identities


def _tool_request(r: Reader, manifest: Manifest, lease: Lease, spooled: set[str]) -> None:
    endpoint = manifest.lease(str(lease.endpoint_lease_id))
    where = f"{lease.field}.endpoint_lease_id"
    if endpoint is None or endpoint.scope != TOOL_ENDPOINT or endpoint.consumer != lease.consumer:
        r.fail(where, "must name a tool-endpoint lease of the same consumer")
    if endpoint.lease_id in spooled:
        r.fail(where, "each endpoint backs one request spool")
    spooled.add(endpoint.lease_id)
    if lease.expires_at and endpoint.expires_at and lease.expires_at > endpoint.expires_at:
        r.fail(f"{lease.field}.expires_at", "must not be later than its endpoint's")
    if manifest.workspace_consumer is not None and lease.consumer_uid != manifest.workspace_consumer[0]:
        r.fail(f"{lease.field}.consumer_uid", "must equal workspace_consumer.uid")


def targets_apart(manifest: Manifest) -> str | None:
    """The field of the first mount target equal to or nested in an earlier one (a capability
    sits inside its own spool), or None."""
    suppressed = manifest.linked_endpoints()
    taken: list[str] = []
    for lease in manifest.leases:
        if lease.lease_id in suppressed:
            continue
        targets = [(f"{lease.field}.request_spool_target", lease.request_spool_target)]
        if lease.scope != TOOL_REQUEST:
            targets = [
                (f"{lease.field}.materializations[{j}].target_path", m.target_path)
                for j, m in enumerate(lease.materializations)
            ]
        for where, target in targets:
            if target is None:
                continue
            if any(nested(target, other) for other in taken):
                return where
            taken.append(target)
    return None
