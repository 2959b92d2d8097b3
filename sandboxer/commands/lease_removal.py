"""What teardown and gc remove of a sandbox's lease manifest: its request spools (each through
the sandbox's backend) and, once the sandbox had consumed its assignment, the run's recorded
materialization sources, removed only below the very run directory create saw.

A record is not trusted with a path (a forged one could name anything): a spool is removed only
where the sandbox's backend puts the spool of that run and lease (below the sandbox's own
directory, or the volume of that name), and a materialization only strictly below the run
directory, by a clean relative path, in a run directory that is still what create admitted (its
identity, its owner, mode 0700, named after the run)."""

from __future__ import annotations

import os
import shutil
import stat
from typing import TYPE_CHECKING

from sandboxer.core.leases import spool_name
from sandboxer.core.reading import open_dir_nofollow
from sandboxer.core.removal import Removal

RUN_DIR_MODE = 0o700  # as create admitted it (core/manifest/sources.py)

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Spools
    from sandboxer.core.record import ManifestRecord


def remove(
    manifest_record: ManifestRecord, *, backend: Spools, sandbox_id: str, sandbox_dir: str, materializations: bool
) -> Removal:
    """Remove the spools (each by its backend) and, when the sandbox had consumed its assignment
    (`materializations`), every recorded materialization source."""

    done = Removal()
    for spool in manifest_record.spools:
        name = spool_name(manifest_record.run_id, spool.lease_id)
        if spool.source != backend.spool_place(name, sandbox_dir=sandbox_dir)[0]:
            done += Removal(residue=(f"spool {spool.source}: not where this sandbox's spool is, left alone",))
            continue
        done += backend.remove_spool(spool.source, sandbox_id=sandbox_id)
    if materializations:
        done += Removal.of(*_remove_materializations(manifest_record))
    return done


def _remove_materializations(manifest_record: ManifestRecord) -> tuple[list[str], list[str]]:
    """Remove the run's recorded sources, relative to the run directory opened without following
    symlinks and checked to be the very directory create saw: a run directory swapped (or a
    parent made a symlink) since is left alone and reported, and so is a source not strictly
    below it."""

    directory = manifest_record.run_dir
    sources = [source for source in manifest_record.materializations if _below(source, directory)]
    residue = [
        f"materialization {source}: not below the run directory, left alone"
        for source in manifest_record.materializations
        if source not in sources
    ]
    if not sources:
        return [], residue
    if os.path.basename(directory) != manifest_record.run_id:
        return [], residue + [f"materialization {source}: the run directory is not the run's" for source in sources]
    try:
        run_fd = open_dir_nofollow(directory)
    except OSError:
        unreached = [f"materialization {source}: the run directory cannot be reached safely" for source in sources]
        return [], residue + unreached
    removed: list[str] = []
    try:
        info = os.fstat(run_fd)
        if (
            (info.st_dev, info.st_ino) != manifest_record.run_dir_identity
            or info.st_uid != manifest_record.owner_uid
            or stat.S_IMODE(info.st_mode) != RUN_DIR_MODE
        ):
            changed = [f"materialization {source}: the run directory changed since create" for source in sources]
            return [], residue + changed
        for source in sources:
            outcome = _remove_below(run_fd, os.path.relpath(source, directory))
            if outcome is True:
                removed.append(f"materialization {source}")
            elif outcome is False:
                residue.append(f"materialization {source}")
    finally:
        os.close(run_fd)
    return removed, residue


def _remove_below(run_fd: int, relative: str) -> bool | None:
    """Remove `relative` below the run directory, symlink-free: True when removed, None when it
    was not there, False when it could not be."""

    parent, name = os.path.split(relative)
    try:
        parent_fd = _walk(run_fd, parent)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        seen = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISDIR(seen.st_mode):
            shutil.rmtree(name, dir_fd=parent_fd)
        else:
            os.unlink(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    finally:
        os.close(parent_fd)
    return True


def _below(path: str, directory: str) -> bool:
    """Whether `path` lies strictly below `directory`, both clean absolute paths (no `.`, `..` or
    empty part: nothing that climbs out once walked)."""

    def clean(value: str) -> bool:
        return value.startswith("/") and all(part not in ("", ".", "..") for part in value.split("/")[1:])

    return clean(path) and clean(directory) and path.startswith(directory + "/")


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
