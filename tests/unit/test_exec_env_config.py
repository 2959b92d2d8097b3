"""exec.env: variables the owner sets in every exec (hints such as PIP_NO_INDEX), on top of the
environment built from nothing and below a manifest's project variables; never one of the
sandbox's own names."""

from __future__ import annotations

import pytest

from sandboxer.core.config import parse_owner_file
from sandboxer.core.config_types import ExtensionConfig, Profile, RuntimePin, from_meaning, meaning
from sandboxer.core.plan import Grants, build_plan
from sandboxer.errors import ConfigError
from tests.samples import profile_yaml


def _profile(exec_section: str) -> Profile:
    parsed = parse_owner_file(profile_yaml("p", extra=exec_section).encode(), "p.yaml", expected_name="p")
    assert isinstance(parsed, Profile)
    return parsed


def test_owner_hints_reach_every_exec_between_the_base_and_a_manifest() -> None:
    profile = _profile('exec:\n  env:\n    PIP_NO_INDEX: "1"\n    PIP_FIND_LINKS: /workspace/wheels\n')
    assert profile.exec_env == (("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", "/workspace/wheels"))
    assert from_meaning(meaning(profile), profile.file_sha256) == profile
    extension = ExtensionConfig(
        extension="ext.bwrap", runtime=RuntimePin(path="/opt/rt", sha256="0" * 64), image=None, file_sha256=""
    )
    plain = dict(build_plan(sandbox_id="a" * 24, profile=profile, extension=extension, workspace_source="/w").env)
    assert (plain["PIP_NO_INDEX"], plain["PATH"].startswith("/opt/sandboxer")) == ("1", True)
    manifest = Grants(env=(("PIP_FIND_LINKS", "/workspace/other"),))
    planned = dict(
        build_plan(
            sandbox_id="a" * 24, profile=profile, extension=extension, workspace_source="/w", grants=manifest
        ).env
    )
    assert planned["PIP_FIND_LINKS"] == "/workspace/other"


@pytest.mark.parametrize(
    ("section", "rule"),
    [
        ("exec:\n  env:\n    PATH: /evil\n", "p.yaml:13:5: exec.env.PATH: PATH is set by the sandbox itself"),
        (
            "exec:\n  env:\n    SANDBOXER_NETWORK: open\n",
            "exec.env.SANDBOXER_NETWORK: SANDBOXER_NETWORK is set by the sandbox itself",
        ),
        ("exec:\n  env:\n    PIP_NO_INDEX: 1\n", "exec.env.PIP_NO_INDEX: must be a string (quote numbers)"),
        ("exec:\n  env:\n    9LIVES: x\n", "exec.env.9LIVES: must be an environment name"),
        ('exec:\n  env:\n    X: "a\\nb"\n', "exec.env.X: must be at most 4096 printable characters"),
        ("exec:\n  env: [X]\n", "exec.env: must be a mapping of names to values"),
    ],
)
def test_what_exec_env_refuses(section: str, rule: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _profile(section)
    assert rule in str(refused.value)
    assert "/evil" not in str(refused.value)  # a value is never echoed
