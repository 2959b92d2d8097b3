"""The relay forked into a sandbox keeps only the descriptors it uses: a sandbox's lock (or any
other descriptor of the broker) never outlives a killed broker in a relay that is slow to die."""

from __future__ import annotations

import json
import os

from sandboxer.backends.bwrap.joiner import _keep_only


def _open_after_keep_only(kept: set[int], candidates: list[int]) -> set[int]:
    """Fork, keep only `kept` in the child, and return which of `candidates` it still has open."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            _keep_only({*kept, write_end})
            still = []
            for fd in candidates:
                try:
                    os.fstat(fd)
                except OSError:
                    continue
                still.append(fd)
            os.write(write_end, json.dumps(still).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        data = stream.read()
    os.waitpid(child, 0)
    return set(json.loads(data))


def test_keep_only_closes_everything_else_however_high() -> None:
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(6)]
    high = os.dup2(opened[0], 900)
    try:
        kept = {opened[1], opened[4]}
        assert _open_after_keep_only(kept, [0, 1, 2, *opened, high]) == {0, 1, 2, *kept}
    finally:
        for fd in [*opened, high]:
            os.close(fd)
