"""The owner's config directory: reading its YAML files by name, and listing what is there."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Any, Protocol

from sandboxer.core.config import PROFILE_NAME, parse_owner_file
from sandboxer.core.config import validate_name as file_for_name
from sandboxer.core.config_types import (
    EXTENSIONS,
    GRANTS_NAME,
    ExtensionConfig,
    GrantsFile,
    OwnerFile,
    Profile,
    from_meaning,
    meaning,
    owner_file_name,
)
from sandboxer.core.yamlstrict import MAX_FILE_BYTES
from sandboxer.errors import PolicyError, UsageError


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerFileBytes:
    """The exact bytes of one owner file, read once; approval and parsing both use these."""

    name: str
    relpath: str
    path: str
    data: bytes


def read_file(path: str, display: str) -> bytes:
    """Read a regular file (never through a symlink) of bounded size in one go."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise UsageError(f"{display}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{display}: must be a regular file, not a symlink") from None
        raise UsageError(f"{display}: cannot be read ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{display}: must be a regular file")
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_FILE_BYTES and (chunk := os.read(fd, 65536)):
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_owner_file(config_dir: str, name: str) -> OwnerFileBytes:
    """Read `extensions/NAME.yaml` or `profiles/NAME.yaml` from the config directory."""
    relpath = file_for_name(name)
    path = os.path.join(config_dir, relpath)
    return OwnerFileBytes(name=name, relpath=relpath, path=path, data=read_file(path, path))


class ParseCache(Protocol):
    """The meanings of owner files parsed before, by the sha256 of their bytes (the broker keeps
    them in its state dir: host/parse_cache.py)."""

    def get(self, digest: str) -> dict[str, Any] | None:
        """The meaning cached for these bytes, if any can be trusted."""

    def put(self, digest: str, meaning: dict[str, Any]) -> None:
        """Keep the meaning of valid bytes (never failing the caller)."""


def load_owner_file(raw: OwnerFileBytes, *, cache: ParseCache | None = None) -> OwnerFile:
    """Parse an owner file read by name; its declared name must match its path.

    With a `cache`, the meaning of bytes parsed before is reused, keyed by their sha256: the same
    bytes always mean the same thing, and `create` then need not load the YAML parser at all.
    Only valid files are ever cached.
    """
    digest = hashlib.sha256(raw.data).hexdigest()
    if cache is not None:
        cached = cache.get(digest)
        item: OwnerFile | None = None
        if cached is not None:
            with contextlib.suppress(KeyError, TypeError, ValueError):  # written by an older broker
                item = from_meaning(cached, digest)
        if item is not None and owner_file_name(item) == raw.name:
            return item
    item = parse_owner_file(raw.data, raw.path, expected_name=raw.name)
    if cache is not None:
        cache.put(digest, meaning(item))
    return item


def load_profile(config_dir: str, name: str, *, cache: ParseCache | None = None) -> tuple[OwnerFileBytes, Profile]:
    """Read and parse a profile by name."""
    if name in EXTENSIONS or name == GRANTS_NAME or not PROFILE_NAME.fullmatch(name):
        raise UsageError(f"--profile: {name!r} is not a profile name (a-z 0-9 _ -)")
    raw = read_owner_file(config_dir, name)
    parsed = load_owner_file(raw, cache=cache)
    if not isinstance(parsed, Profile):
        raise UsageError(f"{raw.path}: is not a profile")
    return raw, parsed


def load_extension(
    config_dir: str, name: str, *, cache: ParseCache | None = None
) -> tuple[OwnerFileBytes, ExtensionConfig]:
    """Read and parse an extension config by name."""
    raw = read_owner_file(config_dir, name)
    parsed = load_owner_file(raw, cache=cache)
    if not isinstance(parsed, ExtensionConfig):
        raise UsageError(f"{raw.path}: is not an extension configuration")
    return raw, parsed


def load_grants(config_dir: str, *, cache: ParseCache | None = None) -> tuple[OwnerFileBytes, GrantsFile] | None:
    """Read and parse grants.yaml; None when there is none."""
    if not os.path.lexists(os.path.join(config_dir, f"{GRANTS_NAME}.yaml")):
        return None
    raw = read_owner_file(config_dir, GRANTS_NAME)
    parsed = load_owner_file(raw, cache=cache)
    if not isinstance(parsed, GrantsFile):
        raise UsageError(f"{raw.path}: is not a grants file")
    return raw, parsed


def present_names(config_dir: str) -> list[str]:
    """Names of the owner files present: extensions, grants, then profiles, each sorted."""
    names: list[str] = []
    for sub in ("extensions", "profiles"):
        try:
            files = sorted(os.listdir(os.path.join(config_dir, sub)))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise PolicyError(f"{config_dir}/{sub}: cannot be listed ({exc.strerror})") from None
        stems = [f.removesuffix(".yaml") for f in files if f.endswith(".yaml")]
        names.extend(stem for stem in stems if (stem in EXTENSIONS) == (sub == "extensions") and _is_name(stem))
        if sub == "extensions" and os.path.lexists(os.path.join(config_dir, f"{GRANTS_NAME}.yaml")):
            names.append(GRANTS_NAME)
    return names


def _is_name(stem: str) -> bool:
    return stem in EXTENSIONS or (stem != GRANTS_NAME and PROFILE_NAME.fullmatch(stem) is not None)
