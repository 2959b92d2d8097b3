"""Parsing a lease manifest: its strict-JSON bytes to a `Manifest`, or the first rule broken.

Pure (no filesystem, no clock): JSON syntax, structure, grammars, bounds and version gating of
the document's top level here; each lease and the rules between leases in lease_parsing.py. A
refusal is a ManifestError naming the file, the field path and the rule.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sandboxer.core import strictjson
from sandboxer.core.manifest.fields import Reader, absolute
from sandboxer.core.manifest.lease_parsing import between_leases, parse_lease
from sandboxer.core.manifest.schema import (
    ID,
    IMAGE,
    MAX_DOCUMENT,
    OMITTED,
    REVISION,
    SEGMENT,
    SERVICE,
    TOP_OPTIONAL,
    TOP_REQUIRED,
    UID_MAX,
    Manifest,
    ManifestError,
)
from sandboxer.core.strictjson import JsonObject


def _decode(data: bytes, file: str) -> Any:
    try:
        return strictjson.document(data, max_bytes=MAX_DOCUMENT)
    except strictjson.Malformed as exc:  # the position only, never the text
        rules = {
            "size": f"larger than {MAX_DOCUMENT} bytes",
            "utf8": "not UTF-8",
            "depth": "nested too deeply",
            "constant": "NaN and Infinity are not JSON (one JSON object and nothing after it)",
            "syntax": f"not valid JSON at line {exc.line} column {exc.column} (one JSON object and nothing after it)",
        }
        raise ManifestError(file, "", rules[exc.kind]) from None


def parse(data: bytes, *, file: str) -> Manifest:
    """The manifest `data` means, or ManifestError naming the first rule it breaks."""
    r = Reader(file)
    document = _decode(data, file)
    if not isinstance(document, JsonObject):
        r.fail("", "the manifest must be one JSON object")
    if document.duplicates:
        r.fail(document.duplicates[0], "duplicate key")
    version = _version(r, document)
    r.obj(document, "", required=TOP_REQUIRED, optional=TOP_OPTIONAL)
    _version_gates(r, document, version)

    run_id = r.string(document["run_id"], "run_id", ID, "must be 1-128 of [A-Za-z0-9._:-]")
    lease_id = r.string(document["lease_id"], "lease_id", ID, "must be 1-128 of [A-Za-z0-9._:-]")
    outer = r.string(document["outer_runtime_id"], "outer_runtime_id", ID, "must be 1-128 of [A-Za-z0-9._:-]")
    workspace = absolute(r, document["workspace"], "workspace")
    repository = r.obj(document["repository"], "repository", required=("path", "revision"))
    repository_path = absolute(r, repository["path"], "repository.path")
    revision = r.string(repository["revision"], "repository.revision", REVISION, "must be 40 or 64 hex digits")
    branch = r.string(document["task_branch"], "task_branch")
    if not _valid_branch(branch):
        r.fail("task_branch", "must be a valid Git branch name")
    if r.string(document["tunnel_placement"], "tunnel_placement") != "outer":
        r.fail("tunnel_placement", 'must be "outer"')
    ports = _ports(r, document.get("published_ports", []))
    images = _images(r, document["service_images"]) if "service_images" in document else ()
    proxy = document.get("port_proxy_image")
    if proxy is not None or "port_proxy_image" in document:
        proxy = _image(r, proxy, "port_proxy_image")
    if images and ports and proxy is None:
        r.fail("port_proxy_image", "required when service_images and published_ports are both non-empty")
    consumer = None
    if "workspace_consumer" in document:
        pair = r.obj(document["workspace_consumer"], "workspace_consumer", required=("uid", "gid"))
        consumer = (
            r.integer(pair["uid"], "workspace_consumer.uid", 1, UID_MAX),
            r.integer(pair["gid"], "workspace_consumer.gid", 1, UID_MAX),
        )
    folder, omitted = _folder(r, document, has_images=bool(images))
    leases = tuple(
        parse_lease(r, value, i, version) for i, value in enumerate(r.array(document.get("leases", []), "leases"))
    )
    manifest = Manifest(
        file=file,
        version=version,
        run_id=run_id,
        lease_id=lease_id,
        outer_runtime_id=outer,
        workspace=workspace,
        repository_path=repository_path,
        repository_revision=revision,
        task_branch=branch,
        tunnel_placement="outer",
        published_ports=ports,
        leases=leases,
        service_images=images,
        port_proxy_image=proxy,
        workspace_consumer=consumer,
        workspace_folder=folder,
        omitted_services=omitted,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    between_leases(r, manifest)
    return manifest


def _version(r: Reader, document: JsonObject) -> str:
    if "version" not in document:
        r.fail("version", "missing required field")
    version = document["version"]
    if not isinstance(version, str):
        r.fail("version", 'must be a JSON string: "1", "2" or "3"')
    if version not in ("1", "2", "3"):
        r.fail("version", 'must be "1", "2" or "3"')
    return version


def _version_gates(r: Reader, document: JsonObject, version: str) -> None:
    for key in ("service_images", "port_proxy_image") if version == "1" else ():
        if key in document:
            r.fail(key, "version 1 allows no images")
    if "workspace_consumer" in document and version != "3":
        r.fail("workspace_consumer", "only version 3 has a workspace consumer")
    if version == "3" and "workspace_consumer" not in document:
        r.fail("workspace_consumer", "missing required field (version 3)")
    for key in ("workspace_folder", "omitted_services"):
        if key in document and version != "3":
            r.fail(key, "only version 3 has it")


def _valid_branch(name: str) -> bool:
    if not name or len(name) > 255 or name == "@" or name.startswith(("-", "/")) or name.endswith(("/", ".", ".lock")):
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F or c in " ~^:?*[\\" for c in name):
        return False
    if ".." in name or "@{" in name or "//" in name:
        return False
    return not any(part.startswith(".") or part.endswith(".lock") for part in name.split("/"))


def _ports(r: Reader, value: Any) -> tuple[tuple[int, int], ...]:
    ports: list[tuple[int, int]] = []
    hosts: set[int] = set()
    runtimes: set[int] = set()
    for i, entry in enumerate(r.array(value, "published_ports")):
        path = f"published_ports[{i}]"
        pair = r.obj(entry, path, required=("host", "runtime"))
        host = r.integer(pair["host"], f"{path}.host", 1, 65535)
        runtime = r.integer(pair["runtime"], f"{path}.runtime", 1, 65535)
        if host in hosts:
            r.fail(f"{path}.host", "host ports must be unique")
        if runtime in runtimes:
            r.fail(f"{path}.runtime", "runtime ports must be unique")
        hosts.add(host)
        runtimes.add(runtime)
        ports.append((host, runtime))
    return tuple(ports)


def _image(r: Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if len(text) > 512 or not IMAGE.fullmatch(text) or "//" in text:
        r.fail(path, "must be an immutable image reference (repository@sha256:<64 hex> or sha256:<64 hex>)")
    return text


def _images(r: Reader, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, JsonObject):
        r.fail("service_images", "must be a JSON object")
    if value.duplicates:
        r.fail(f"service_images.{value.duplicates[0]}", "duplicate key")
    if len(value) > 64:
        r.fail("service_images", "at most 64 entries")
    images = []
    for name, image in value.items():
        if not SERVICE.fullmatch(name):
            r.fail(f"service_images.{name}", "service names are 1-128 of [A-Za-z0-9._-], starting alphanumeric")
        images.append((name, _image(r, image, f"service_images.{name}")))
    return tuple(images)


def _folder(r: Reader, document: JsonObject, *, has_images: bool) -> tuple[str | None, tuple[str, ...]]:
    if "workspace_folder" not in document and "omitted_services" not in document:
        return None, ()
    for key, other in (("workspace_folder", "omitted_services"), ("omitted_services", "workspace_folder")):
        if key in document and other not in document:
            r.fail(other, f"required together with {key}")
    if not has_images:
        r.fail("workspace_folder", "only with service_images")
    folder = r.string(document["workspace_folder"], "workspace_folder")
    segments = folder.removeprefix("/workspaces/").split("/")
    if (
        not folder.startswith("/workspaces/")
        or not 1 <= len(segments) <= 4
        or not all(SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments)
        or folder == "/workspaces/main"
    ):
        r.fail("workspace_folder", "must be /workspaces/ and 1-4 clean segments, not /workspaces/main")
    names = r.array(document["omitted_services"], "omitted_services", 32)
    for i, name in enumerate(names):
        r.string(name, f"omitted_services[{i}]", OMITTED, "names are 1-64 of [A-Za-z0-9._-], starting alphanumeric")
    return folder, tuple(names)
