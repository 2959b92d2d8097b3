"""The parse cache create uses: same bytes, same meaning; an untrusted cache file is ignored."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sandboxer.core.config import parse_owner_file
from sandboxer.core.config_types import from_meaning, meaning
from sandboxer.core.configdir import OwnerFileBytes, load_owner_file
from sandboxer.errors import ConfigError
from sandboxer.host.parse_cache import ParseCache
from tests.samples import profile_yaml

PROFILE = profile_yaml("dev", extra="limits:\n  pids: 99\n").encode()
EXT = (
    b"extension: ext.docker\nconfig:\n  image: sha256:"
    + b"a" * 64
    + b"\n  runtime:\n    path: /srv/rt\n    sha256: "
    + b"b" * 64
    + b"\n"
)


EVERY_KEY = profile_yaml(
    "full",
    extra=(
        "limits:\n  memory_mib: 512\n  pids: 99\n  workspace_mib: 64\n  state_mib: 32\n  tmp_mib: 48\n"
        "  best_effort: true\nsecurity:\n  allow_ptrace: true\nlifetime:\n  idle_seconds: 60\n"
    ),
).replace("  ref: main\n", "  ref: main\n  git:\n    user:\n      name: Ada L\n      email: ada@example.test\n")


def test_meaning_round_trips_for_profiles_and_extensions() -> None:
    assert b"email: ada@example.test" in EVERY_KEY.encode()  # the sample's workspace took the git key
    for data in (PROFILE, EVERY_KEY.encode(), EXT, EXT + b"  warm: 2\n"):
        item = parse_owner_file(data, "f.yaml")
        assert from_meaning(json.loads(json.dumps(meaning(item))), item.file_sha256) == item


def raw(data: bytes, name: str) -> OwnerFileBytes:
    return OwnerFileBytes(name=name, relpath=f"profiles/{name}.yaml", path=f"/c/profiles/{name}.yaml", data=data)


def test_cache_is_written_and_then_used(tmp_path: Path) -> None:
    cache = tmp_path / "parsed"
    first = load_owner_file(raw(PROFILE, "dev"), cache=ParseCache(str(cache)))
    entry = cache / f"{hashlib.sha256(PROFILE).hexdigest()}.json"
    assert entry.stat().st_mode & 0o777 == 0o600
    document = json.loads(entry.read_text())
    document["limits"]["pids"] = 77  # prove the cache, not the YAML, is what the second load reads
    entry.write_text(json.dumps(document))
    second = load_owner_file(raw(PROFILE, "dev"), cache=ParseCache(str(cache)))
    assert first.limits.pids == 99  # type: ignore[union-attr]
    assert second.limits.pids == 77  # type: ignore[union-attr]


def test_cache_file_open_to_others_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "parsed"
    load_owner_file(raw(PROFILE, "dev"), cache=ParseCache(str(cache)))
    entry = cache / f"{hashlib.sha256(PROFILE).hexdigest()}.json"
    document = json.loads(entry.read_text())
    document["limits"]["pids"] = 77
    entry.write_text(json.dumps(document))
    entry.chmod(0o644)
    assert load_owner_file(raw(PROFILE, "dev"), cache=ParseCache(str(cache))).limits.pids == 99  # type: ignore[union-attr]


def test_cached_meaning_under_another_name_is_not_used(tmp_path: Path) -> None:
    cache = tmp_path / "parsed"
    load_owner_file(raw(PROFILE, "dev"), cache=ParseCache(str(cache)))
    with pytest.raises(ConfigError, match=r"must equal the file's name \(other\)"):
        load_owner_file(raw(PROFILE, "other"), cache=ParseCache(str(cache)))
