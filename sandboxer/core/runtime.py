"""The runtime pin: a runtime directory must have the owner's digest and stand apart from the rest."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from sandboxer.core.config_types import RuntimePin
from sandboxer.core.digest import RuntimeArtifactError, TreeDigest, tree_digest
from sandboxer.core.digest_cache import StatCache
from sandboxer.errors import PolicyError, SandboxerError
from sandboxer.host.fsutil import ensure_private_dir


def digest_runtime(path: str, *, state_dir: str | None, full: bool = False) -> TreeDigest:
    """Tree digest v1 of `path`, reusing the verified-stat cache in `state_dir` unless `full`.

    A `full` digest re-reads every byte and then refreshes the cache. Without a usable state
    directory the digest is computed without a cache: slower, never different.
    """
    cache: StatCache | None = None
    if state_dir is not None:
        cache = StatCache.for_root(state_dir, path, load=not full)
    result = tree_digest(path, cache=cache)
    if cache is not None and state_dir is not None:
        try:
            ensure_private_dir(state_dir, "state dir", traversable=os.geteuid() == 0)
            cache.save()
        except (OSError, SandboxerError) as exc:
            print(f"sandboxer: warning: digest cache not saved ({exc})", file=sys.stderr)
    return result


def check_overlap(runtime: str, others: Mapping[str, str]) -> None:
    """Refuse a runtime that is, contains or lies inside any of `others` (label → path)."""
    mine = os.path.realpath(runtime)
    for label, other in others.items():
        theirs = os.path.realpath(other)
        if mine == theirs or mine.startswith(theirs.rstrip("/") + "/") or theirs.startswith(mine + "/"):
            raise PolicyError(f"runtime {runtime}: overlaps the {label} {other}")


def verify_pin(pin: RuntimePin, *, state_dir: str, others: Mapping[str, str], full: bool = False) -> TreeDigest:
    """Check the runtime against its pin: artifact rules, no overlap, the exact tree digest."""
    try:
        check_overlap(pin.path, others)
        result = digest_runtime(pin.path, state_dir=state_dir, full=full)
    except RuntimeArtifactError as exc:
        raise PolicyError(exc.message) from exc
    if result.sha256 != pin.sha256:
        raise PolicyError(
            f"runtime {pin.path}: tree digest {result.sha256} does not match the pinned config.runtime.sha256 "
            f"{pin.sha256}",
            hint="rebuild the runtime or re-pin it with `sandboxer runtime digest` and approve again",
        )
    return result
