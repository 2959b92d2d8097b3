"""The runtime pin: a runtime directory must have the owner's digest and stand apart from the rest.

Its digest is computed on the host through the state dir's cache (host/digest_cache.py:
digest_runtime); commands/making.py: verify_pin puts the checks together."""

from __future__ import annotations

import os
from collections.abc import Mapping

from sandboxer.core.config_types import RuntimePin
from sandboxer.core.digest import TreeDigest
from sandboxer.errors import PolicyError


def check_overlap(runtime: str, others: Mapping[str, str]) -> None:
    """Refuse a runtime that is, contains or lies inside any of `others` (label → path)."""
    mine = os.path.realpath(runtime)
    for label, other in others.items():
        theirs = os.path.realpath(other)
        if mine == theirs or mine.startswith(theirs.rstrip("/") + "/") or theirs.startswith(mine + "/"):
            raise PolicyError(f"runtime {runtime}: overlaps the {label} {other}")


def check_digest(pin: RuntimePin, result: TreeDigest) -> None:
    """Refuse a runtime whose tree digest is not its pin's."""
    if result.sha256 != pin.sha256:
        raise PolicyError(
            f"runtime {pin.path}: tree digest {result.sha256} does not match the pinned config.runtime.sha256 "
            f"{pin.sha256}",
            hint="rebuild the runtime or re-pin it with `sandboxer runtime digest` and approve again",
        )
