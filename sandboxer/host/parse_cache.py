"""The parse cache: the meaning of each owner file parsed before, by the sha256 of its bytes, in
the broker's owner-only state dir (`<state>/parsed/<sha256>.json`). The same bytes always mean the
same thing, so a create that finds them need not load the YAML parser at all."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from typing import Any

from sandboxer.errors import SandboxerError
from sandboxer.host.fsutil import atomic_write, ensure_private_dir


class ParseCache:
    """The parse cache in one directory (sandboxer.core.configdir.ParseCache)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @classmethod
    def of_state(cls, state_dir: str) -> ParseCache:
        """The state dir's parse cache."""
        return cls(os.path.join(state_dir, "parsed"))

    def get(self, digest: str) -> dict[str, Any] | None:
        """The cached meaning, only from a regular file of ours that nobody else may write."""
        try:
            fd = os.open(os.path.join(self.directory, f"{digest}.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as stream:
            st = os.fstat(stream.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                return None
            try:
                document = json.loads(stream.read(1 << 16))
            except ValueError:
                return None
        return document if isinstance(document, dict) else None

    def put(self, digest: str, meaning: dict[str, Any]) -> None:
        """Keep a valid file's meaning; a cache that cannot be written is only slower."""
        with contextlib.suppress(OSError, SandboxerError):
            ensure_private_dir(self.directory, "parse cache")
            path = os.path.join(self.directory, f"{digest}.json")
            atomic_write(path, json.dumps(meaning).encode(), durable=False)
