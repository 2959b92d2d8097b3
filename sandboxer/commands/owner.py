"""Owner commands: check, approve, revoke and list configuration; digest a runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator
from typing import Any

from ruamel.yaml import YAML

from sandboxer.api import results
from sandboxer.backends import Backends
from sandboxer.commands.making import backend_name, require_routes, verify_pin
from sandboxer.core import approvals
from sandboxer.core.approvals import Approval, Ledger, Status
from sandboxer.core.config import parse_owner_file, validate_name
from sandboxer.core.config_types import EXTENSIONS, GRANTS_NAME, ExtensionConfig, OwnerFile, Profile, meaning
from sandboxer.core.configdir import load_owner_file, present_names, read_file, read_owner_file
from sandboxer.core.egress.policy import Route
from sandboxer.dirs import Dirs
from sandboxer.errors import PolicyError, SandboxerError, UsageError
from sandboxer.host.digest_cache import digest_runtime
from sandboxer.host.fsutil import atomic_write, locked
from sandboxer.host.workspace import check_repository


def describe(item: OwnerFile) -> dict[str, Any]:
    """The normalized meaning of a valid owner file, shaped like the file, defaults filled in."""
    return meaning(item)


def check(path: str) -> results.OwnerCheck:
    """Validate one owner file given by path: its digest and what it means."""
    data = read_file(path, path)
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = os.path.basename(path).removesuffix(".yaml")
    expected = stem if parent in ("extensions", "profiles") and path.endswith(".yaml") else None
    item = parse_owner_file(data, path, expected_name=expected)
    described = describe(item)
    kind = described.pop("kind")
    return results.OwnerCheck(file=path, sha256=item.file_sha256, kind=kind, meaning=results.frozen(described))


def approve(dirs: Dirs, name: str, *, backends: Backends) -> results.Approval:
    """Approve the exact current bytes of an owner file, after checking it is valid.

    What a create would trip on is checked now, so that an owner learns it at approval, not at
    the first create: an extension config's runtime matches its pin (3 otherwise) and its
    backend can honour it (a Docker image present in the Engine: 2), and each of its routes'
    secret file is owner-only (3); a profile's repository is a Git repository with its ref and
    the refs it lists (2), and its network.routes are routes of its extension config for hosts
    its network.egress lists (3).
    """
    raw = read_owner_file(dirs.config, name)
    item = load_owner_file(raw)
    if isinstance(item, ExtensionConfig):
        verify_pin(item.runtime, state_dir=dirs.state, others={"config dir": dirs.config, "state dir": dirs.state})

        backends.backend(backend_name(item)).check_extension(item, raw.path)
        owner = os.stat(dirs.config).st_uid
        for route in item.routes.values():
            check_secret_file(route, file=raw.path, owners=(0, owner))
    elif isinstance(item, Profile):
        workspace = item.workspace
        check_repository(workspace.repository, (workspace.ref, *workspace.refs), raw.path)
        if item.routes:  # checked again at create: the extension config may change meanwhile
            extension = load_owner_file(read_owner_file(dirs.config, item.extension))
            if isinstance(extension, ExtensionConfig):
                require_routes(item, extension)
    given = approvals.approval(name, item.file_sha256)
    with _edit_ledger(Ledger(dirs.config)) as entries:
        entries[name] = given
    return results.Approval(name=name, file=raw.path, status=Status.APPROVED.value, sha256=given.sha256)


def check_secret_file(route: Route, *, file: str, owners: tuple[int, ...]) -> None:
    """A route's secret file as the proxy will read it per request: there, a regular file (not a
    link: the proxy opens it with O_NOFOLLOW), owned by root or the config dir's owner, readable
    by nobody else. Opened to be checked, never read: no error can carry its content."""
    field = f"config.routes.{route.name}.secret_file"

    def refuse(rule: str) -> PolicyError:
        return PolicyError(f"{file}: {field}: {rule}", hint="chmod 600 it, owned by the owner of the config dir")

    try:
        fd = os.open(route.secret_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise refuse("no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse("must be a regular file, not a symbolic link") from None
        raise refuse(f"cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        raise refuse("must be a regular file")
    if info.st_uid not in owners:
        raise refuse(f"must be owned by root or by the config dir's owner (uid {owners[-1]})")
    if info.st_mode & 0o077:
        raise refuse("must be readable by its owner only (no group or other permissions)")


def revoke(dirs: Dirs, name: str) -> results.Approval:
    """Withdraw an approval; revoking what is not approved is not an error (it stays unapproved)."""
    relpath = validate_name(name)  # the file itself may already be gone
    with _edit_ledger(Ledger(dirs.config)) as entries:
        removed = entries.pop(name, None)
    return results.Approval(
        name=name, file=os.path.join(dirs.config, relpath), status=Status.UNAPPROVED.value, revoked=removed is not None
    )


@contextlib.contextmanager
def _edit_ledger(ledger: Ledger) -> Iterator[dict[str, Approval]]:
    """The ledger's approvals to change in the block, written back atomically when it ends; under
    the ledger's lock throughout, so that concurrent approvers never lose an entry."""
    approvals.check_owner_dir(ledger.config_dir)
    with locked(ledger.lock_path):
        entries = ledger.read()
        yield entries
        atomic_write(ledger.path, approvals.render(entries), mode=0o600)


def list_entries(dirs: Dirs) -> results.OwnerListing:
    """Every extension config and profile present, and every approval whose file is gone."""
    ledger = Ledger(dirs.config)
    approvals = ledger.read()
    entries: list[results.OwnerEntry] = []
    names = present_names(dirs.config)
    for name in names:
        raw = None
        file: str | None = None
        problem: str | None = None
        try:
            raw = read_owner_file(dirs.config, name)
            file = raw.path
            load_owner_file(raw)
        except SandboxerError as exc:
            file = file or os.path.join(dirs.config, validate_name(name))
            problem = exc.message
        sha = None if raw is None else _sha256(raw.data)
        approval = approvals.get(name)
        entries.append(
            results.OwnerEntry(
                name=name,
                kind=_kind(name),
                file=file,
                valid=problem is None,
                problem=problem,
                present=True,
                sha256=sha,
                approved_sha256=approval.sha256 if approval else None,
                status=_status(approval is not None, approval.sha256 == sha if approval else False).value,
            )
        )
    for name in sorted(set(approvals) - set(names)):
        entries.append(
            results.OwnerEntry(
                name=name,
                kind=_kind(name),
                file=None,
                valid=False,
                problem="file is missing",
                present=False,
                sha256=None,
                approved_sha256=approvals[name].sha256,
                status=Status.CHANGED.value,
            )
        )
    return results.OwnerListing(config_dir=dirs.config, entries=tuple(entries))


def status_of(dirs: Dirs, name: str) -> str:
    """Where one owner file stands now: approved, unapproved, changed-since-approval (its bytes
    differ from the approved ones), or missing (no such file)."""
    try:
        raw = read_owner_file(dirs.config, name)
    except SandboxerError:
        return "missing"
    approval = Ledger(dirs.config).read().get(name)
    return _status(approval is not None, approval is not None and approval.sha256 == _sha256(raw.data)).value


def _kind(name: str) -> results.OwnerKind:

    return "extension" if name.startswith("ext.") else "grants" if name == GRANTS_NAME else "profile"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _status(approved: bool, same: bool) -> Status:
    if not approved:
        return Status.UNAPPROVED
    return Status.APPROVED if same else Status.CHANGED


def runtime_digest(dirs: Dirs, path: str, *, full: bool) -> results.RuntimeDigest:
    """Tree digest v1 of a runtime directory, checked against the artifact rules."""
    result = digest_runtime(path, state_dir=dirs.state, full=full)
    return results.RuntimeDigest(path=path, full=full, **dataclasses.asdict(result))


def runtime_pin(dirs: Dirs, path: str, extension: str) -> results.RuntimePin:
    """Write the runtime directory `path` and its tree digest v1 into the extension config's
    config.runtime, keeping the rest of the file as the owner wrote it (comments included). The
    file's bytes change, so its approval no longer holds: the owner reviews the new file, then
    approves it (ext approve) — nothing is approved here."""

    if extension not in EXTENSIONS:
        raise UsageError(f"--extension: must be one of {', '.join(EXTENSIONS)}")
    absolute = os.path.abspath(path)
    raw = read_owner_file(dirs.config, extension)
    load_owner_file(raw)  # a file that is not valid now is the owner's to mend first
    digest = digest_runtime(absolute, state_dir=dirs.state, full=True).sha256
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True  # the rest of the file as the owner wrote it
    yaml.width = 4096
    document = yaml.load(raw.data.decode())
    runtime = document["config"]["runtime"]
    data = raw.data
    if (runtime["path"], runtime["sha256"]) != (absolute, digest):  # else the file stays as it is
        runtime["path"], runtime["sha256"] = absolute, digest
        text = io.StringIO()
        yaml.dump(document, text)
        data = text.getvalue().encode()
        parse_owner_file(data, raw.path, expected_name=extension)  # still valid, to the same strict rules
        if read_owner_file(dirs.config, extension).data != raw.data:
            raise UsageError(f"{raw.path}: changed while the runtime was digested; run runtime pin again")
        info = os.lstat(raw.path)
        atomic_write(raw.path, data, mode=info.st_mode & 0o777)
        os.chown(raw.path, info.st_uid, info.st_gid, follow_symlinks=False)  # never through a link put there
    status = Ledger(dirs.config).status(extension, hashlib.sha256(data).hexdigest())
    return results.RuntimePin(extension=extension, file=raw.path, path=absolute, sha256=digest, status=status.value)
