"""The source checks of a lease manifest: what its files are on the host, not what it says.

The assignment file itself (an absolute path, no symlink on the way, an owner-only regular
file), the run directory, and every materialization's source: its place, type, owner and mode;
for a file, its size, sha256 and the scope's content rules (provider values, capabilities,
project-env lines), read once through one descriptor. Errors are ManifestErrors naming the file,
the field path and the rule; they never carry a value read from a source, a capability or a
digest of either.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator, Sequence

from sandboxer.core.manifest.fields import Reader, nested
from sandboxer.core.manifest.schema import (
    CAPABILITY,
    ENV_NAME,
    FILE_SCOPES,
    MAX_DOCUMENT,
    PROJECT_ENV_MAX_BYTES,
    PROJECT_ENV_MAX_LINES,
    PROJECT_ENVIRONMENT,
    PROVIDER_CREDENTIAL,
    PROVIDER_ENVIRONMENT,
    PROVIDER_VALUE_BYTES,
    SHARED_DIRECTORY,
    TOOL_ENDPOINT,
    TOOL_REQUEST,
    Lease,
    Manifest,
    ManifestError,
    Materialization,
    denied_name,
    run_dir,
)
from sandboxer.core.reading import UnfitFile, open_beneath, open_dir_nofollow, read_owner_only


def read_assignment(path: str) -> tuple[bytes, os.stat_result]:
    """The assignment's bytes: an absolute path to an owner-only regular file, not a symlink."""
    if not path.startswith("/"):
        raise ManifestError(path, "", "the manifest must be given as an absolute path")
    try:
        # No symlink anywhere on its path: every source is named below this directory, and the
        # broker later removes them as root.
        os.close(open_dir_nofollow(os.path.dirname(path)))
    except OSError as exc:
        symlink = exc.errno in (errno.ELOOP, errno.ENOTDIR)
        rule = "must be reached without symlinks" if symlink else f"cannot be reached ({exc.strerror})"
        raise ManifestError(path, "", f"the manifest's directory {rule}") from None
    try:
        return read_owner_only(path, MAX_DOCUMENT)
    except UnfitFile as exc:
        raise ManifestError(path, "", f"the manifest {exc.reason}") from None


def _read_bounded(fd: int, limit: int) -> bytes | None:
    chunks, size = [], 0
    while chunk := os.read(fd, 65536):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def check_sources(manifest: Manifest, *, owner: int, forbidden: Sequence[str] = ()) -> None:
    """Every source rule that needs the filesystem."""
    r = Reader(manifest.file)
    directory = run_dir(manifest)
    if os.path.basename(directory) != manifest.run_id:
        r.fail("run_id", "the assignment's directory must be named after run_id")
    _private_dir(r, directory, owner, "run_id", "the run directory")
    sources: list[str] = []
    for lease, j, item, where in _each_material(manifest):
        source = item.source_path
        real = os.path.realpath(source)
        for f in forbidden:
            if nested(source, os.path.normpath(f)) or nested(real, os.path.realpath(f)):
                r.fail(where, "must not be the broker's own config or state")
        if any(nested(source, other) for other in sources):
            r.fail(where, "sources must not be equal or nested")
        sources.append(source)
        if lease.scope in FILE_SCOPES:
            read_material(manifest, lease, j, owner=owner)
        else:
            _run_owned(r, manifest, lease, source=source, where=where, owner=owner)
    for lease in manifest.by_scope(TOOL_REQUEST):
        endpoint = manifest.lease(str(lease.endpoint_lease_id))
        if endpoint is not None and not _is_socket(endpoint.materializations[0].source_path):
            r.fail(f"{lease.field}.endpoint_lease_id", "the linked endpoint's source must be a socket")


def _each_material(manifest: Manifest) -> Iterator[tuple[Lease, int, Materialization, str]]:
    for lease in manifest.leases:
        for j, item in enumerate(lease.materializations):
            yield lease, j, item, f"{lease.field}.materializations[{j}].source_path"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _private_dir(r: Reader, path: str, owner: int, field: str, what: str) -> None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        r.fail(field, f"{what} {path} cannot be read ({exc.strerror})")
    if not stat.S_ISDIR(info.st_mode):
        r.fail(field, f"{what} {path} must be a directory, not a symlink")
    if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != owner:
        r.fail(field, f"{what} {path} must be mode 0700 and owned by the assignment's owner")


def _run_owned(r: Reader, manifest: Manifest, lease: Lease, *, source: str, where: str, owner: int) -> None:
    directory = run_dir(manifest)
    if not source.startswith(directory + "/"):
        r.fail(where, "must be inside the run directory")
    parent = os.path.dirname(source)
    while parent != directory:
        _private_dir(r, parent, owner, where, "the directory")
        parent = os.path.dirname(parent)
    try:
        info = os.lstat(source)
    except OSError as exc:
        r.fail(where, f"cannot be read ({exc.strerror})")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != owner:
        r.fail(where, "must belong to the assignment's owner")
    if lease.scope == SHARED_DIRECTORY and not (stat.S_ISDIR(info.st_mode) and mode == 0o755):
        r.fail(where, "a shared directory must be a directory of mode exactly 0755 (not a symlink)")
    if lease.scope == TOOL_ENDPOINT:
        directory_ok = stat.S_ISDIR(info.st_mode) and mode == 0o700
        socket_ok = stat.S_ISSOCK(info.st_mode) and not mode & 0o077
        if not (directory_ok or socket_ok):
            r.fail(where, "a tool endpoint must be a 0700 directory or an owner-only socket (not a symlink)")


def read_material(manifest: Manifest, lease: Lease, index: int, *, owner: int) -> bytes:
    """A file materialization's bytes, checked: place, type, owner, mode, size, sha256 and the
    scope's content rules. Read once through one descriptor; the caller uses exactly these bytes."""
    r = Reader(manifest.file)
    item = lease.materializations[index]
    where = f"{lease.field}.materializations[{index}].source_path"
    source = item.source_path
    materials = os.path.join(run_dir(manifest), "materializations")
    if os.path.dirname(source) != materials:
        r.fail(where, "must be directly in the run's materializations/ directory")
    _private_dir(r, materials, owner, where, "the directory")
    try:
        fd = open_beneath(run_dir(manifest), source, os.O_RDONLY | os.O_NONBLOCK, strict_root=True)
    except OSError as exc:
        r.fail(where, "is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})")
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            r.fail(where, "must be a regular file")
        if info.st_uid != owner:
            r.fail(where, "must belong to the assignment's owner")
        if lease.scope == PROVIDER_CREDENTIAL:
            if mode & 0o022 or mode & 0o444 != 0o444:
                r.fail(where, "a provider credential must be readable by all and writable by its owner only")
        elif mode & 0o077:
            r.fail(where, "must be owner-only (no group or other permissions)")
        data = _read_bounded(fd, MAX_DOCUMENT)
    finally:
        os.close(fd)
    if data is None:
        r.fail(where, f"larger than {MAX_DOCUMENT} bytes")
    if hashlib.sha256(data).hexdigest() != item.sha256:
        r.fail(f"{lease.field}.materializations[{index}].sha256", "does not match the file's bytes")
    _content_rule(r, lease.scope, data, where)
    return data


def _content_rule(r: Reader, scope: str, data: bytes, where: str) -> None:
    if scope == PROVIDER_ENVIRONMENT:
        low, high = PROVIDER_VALUE_BYTES
        if not low <= len(data) <= high:
            r.fail(where, f"a provider value is {low}-{high} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            r.fail(where, "a provider value must be UTF-8")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            r.fail(where, "a provider value must have no control characters (no trailing newline either)")
    elif scope == TOOL_REQUEST and not CAPABILITY.fullmatch(data):
        r.fail(where, "a capability is 32-128 of [A-Za-z0-9._-]")
    elif scope == PROJECT_ENVIRONMENT:
        project_variables(data, r, where)


def project_variables(data: bytes, r: Reader | None = None, where: str = "") -> list[tuple[str, str]]:
    """The variables of a project-env file: sorted unique NAME=value lines, each ending in \\n."""
    reader = r or Reader("project-env")
    if len(data) > PROJECT_ENV_MAX_BYTES:
        reader.fail(where, f"a project-env file is at most {PROJECT_ENV_MAX_BYTES} bytes")
    if b"\r" in data or b"\0" in data:
        reader.fail(where, "a project-env file has no CR or NUL")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        reader.fail(where, "a project-env file must be UTF-8")
    if text and not text.endswith("\n"):
        reader.fail(where, "every project-env line ends with a newline")
    lines = text.split("\n")[:-1] if text else []
    if len(lines) > PROJECT_ENV_MAX_LINES:
        reader.fail(where, f"at most {PROJECT_ENV_MAX_LINES} project-env lines")
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        name, equals, value = line.partition("=")
        if not equals or not ENV_NAME.fullmatch(name):
            reader.fail(where, f"project-env line {number} is not NAME=value")
        if denied_name(name, project=True):
            reader.fail(where, f"project-env line {number}: this name is refused")
        if pairs and name <= pairs[-1][0]:
            reader.fail(where, f"project-env line {number}: names must be unique and sorted")
        pairs.append((name, value))
    return pairs
