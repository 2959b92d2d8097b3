"""What teardown and gc remove of a sandbox's lease manifest: its request spools (each through
the sandbox's backend) and, once the sandbox had consumed its assignment, the run's recorded
materialization sources, removed only below the very run directory create saw."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend
    from sandboxer.core.record import ManifestRecord


def remove(
    manifest_record: ManifestRecord, *, backend: Backend, sandbox_id: str, materializations: bool
) -> tuple[list[str], list[str]]:
    """Remove the spools (each by its backend) and, when the sandbox had consumed its assignment
    (`materializations`), every recorded materialization source: (removed, residue)."""
    removed: list[str] = []
    residue: list[str] = []
    for spool in manifest_record.spools:
        spool_removed, spool_residue = backend.remove_spool(spool.source, sandbox_id=sandbox_id)
        removed += spool_removed
        residue += spool_residue
    if materializations:
        more_removed, more_residue = _remove_materializations(manifest_record)
        removed += more_removed
        residue += more_residue
    return removed, residue


def _remove_materializations(manifest_record: ManifestRecord) -> tuple[list[str], list[str]]:
    """Remove the run's recorded sources, relative to the run directory opened without following
    symlinks and checked to be the very directory create saw: a run directory swapped (or a
    parent made a symlink) since is left alone and reported."""
    import shutil

    from sandboxer.host.fsutil import open_dir_nofollow

    sources = list(manifest_record.materializations)
    directory = manifest_record.run_dir
    identity = manifest_record.run_dir_identity
    try:
        run_fd = open_dir_nofollow(directory)
    except OSError:
        return [], [f"materialization {source}: the run directory cannot be reached safely" for source in sources]
    removed: list[str] = []
    residue: list[str] = []
    try:
        info = os.fstat(run_fd)
        if (info.st_dev, info.st_ino) != identity or info.st_uid != manifest_record.owner_uid:
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
