"""Owner configuration: every rule has a bad file, and each bad file has its exact error."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxer.core.config import parse_owner_file, validate_name
from sandboxer.core.config_types import ExtensionConfig, Limits, Profile, from_meaning, meaning
from sandboxer.errors import ConfigError, ForbiddenSettingError, UsageError
from tests.samples import profile_yaml

HEX = "ab" * 32

EXT = f"""extension: ext.bwrap
config:
  runtime:
    path: /srv/runtimes/demo
    sha256: {HEX}
"""

DOCKER = f"""extension: ext.docker
config:
  image: sha256:{HEX}
  runtime:
    path: /srv/runtimes/demo
    sha256: {HEX}
"""

PROFILE = profile_yaml("dev")


def parse(text: str, name: str | None = None) -> ExtensionConfig | Profile:
    return parse_owner_file(text.encode(), "f.yaml", expected_name=name)


def test_valid_extension_config_is_normalized() -> None:
    item = parse(EXT, "ext.bwrap")
    assert isinstance(item, ExtensionConfig)
    assert item.extension == "ext.bwrap"
    assert item.runtime.path == "/srv/runtimes/demo"
    assert item.runtime.sha256 == HEX
    assert item.image is None


def test_valid_docker_config_keeps_its_image() -> None:
    item = parse(DOCKER, "ext.docker")
    assert isinstance(item, ExtensionConfig)
    assert item.image == f"sha256:{HEX}"


def test_profile_gets_default_limits_when_none_are_given() -> None:
    item = parse(PROFILE, "dev")
    assert isinstance(item, Profile)
    assert item.limits == Limits(memory_mib=2048, pids=512, best_effort=False)
    assert item.workspace.repository == "/srv/repos/demo"
    assert item.workspace.ref == "main"


def test_profile_limits_are_read() -> None:
    item = parse(PROFILE + "limits:\n  memory_mib: 512\n  pids: 64\n  best_effort: true\n")
    assert isinstance(item, Profile)
    assert item.limits == Limits(memory_mib=512, pids=64, best_effort=True)
    assert item.limits.workspace_mib == 4096
    assert item.security.allow_ptrace is False


def test_profile_caller_env_is_read() -> None:
    item = parse(PROFILE + "exec:\n  caller_env: [TASK_ID, hint_2]\n")
    assert isinstance(item, Profile)
    assert item.caller_env == ("TASK_ID", "hint_2")
    default = parse(PROFILE)
    assert isinstance(default, Profile)
    assert default.caller_env == ()


def test_profile_tmpfs_sizes_are_read() -> None:
    default = parse(PROFILE)
    assert isinstance(default, Profile)
    assert (default.limits.state_mib, default.limits.tmp_mib) == (256, 256)
    item = parse(PROFILE + "limits:\n  state_mib: 64\n  tmp_mib: 1024\n")
    assert isinstance(item, Profile)
    assert (item.limits.state_mib, item.limits.tmp_mib) == (64, 1024)


def test_profile_workspace_size_and_ptrace_switch_are_read() -> None:
    item = parse(PROFILE + "limits:\n  workspace_mib: 16\nsecurity:\n  allow_ptrace: true\n")
    assert isinstance(item, Profile)
    assert item.limits.workspace_mib == 16
    assert item.security.allow_ptrace is True


def test_profile_idle_timeout_is_read_and_absent_by_default() -> None:
    item = parse(PROFILE + "lifetime:\n  idle_seconds: 3600\n")
    assert isinstance(item, Profile)
    assert item.lifetime.idle_seconds == 3600
    plain = parse(PROFILE)
    assert isinstance(plain, Profile)
    assert plain.lifetime.idle_seconds is None


def test_file_hash_covers_exact_bytes() -> None:
    first = parse(PROFILE)
    second = parse(PROFILE + "\n")
    assert first.file_sha256 != second.file_sha256


# (description, text, exact error message)
BAD_FILES = [
    ("unknown top-level key", EXT + "extra: 1\n", "f.yaml:6:1: extra: unknown key"),
    (
        "unknown nested key",
        EXT.replace("  runtime:", "  colour: red\n  runtime:"),
        "f.yaml:3:3: config.colour: unknown key",
    ),
    ("missing runtime", "extension: ext.bwrap\nconfig: {}\n", "f.yaml:2:9: config.runtime: missing required key"),
    (
        "missing sha256",
        EXT.replace(f"    sha256: {HEX}\n", ""),
        "f.yaml:4:5: config.runtime.sha256: missing required key",
    ),
    ("duplicate key", EXT + "extension: ext.bwrap\n", "f.yaml:6:1: extension: duplicate key"),
    (
        "duplicate nested key",
        EXT.replace("    path: /srv/runtimes/demo\n", "    path: /srv/runtimes/demo\n    path: /srv/other\n"),
        "f.yaml:5:5: config.runtime.path: duplicate key",
    ),
    (
        "unknown extension",
        EXT.replace("ext.bwrap", "ext.chroot"),
        "f.yaml:1:12: extension: must be one of ext.bwrap, ext.docker",
    ),
    (
        "sha256 uppercase",
        EXT.replace(HEX, HEX.upper()),
        "f.yaml:5:13: config.runtime.sha256: must be 64 lowercase hex digits",
    ),
    ("sha256 short", EXT.replace(HEX, HEX[:63]), "f.yaml:5:13: config.runtime.sha256: must be 64 lowercase hex digits"),
    ("sha256 number", EXT.replace(HEX, "12"), "f.yaml:5:13: config.runtime.sha256: must be a string"),
    (
        "relative runtime path",
        EXT.replace("/srv/runtimes/demo", "srv/runtimes"),
        "f.yaml:4:11: config.runtime.path: must be a normalized absolute path other than /, without control characters",
    ),
    (
        "runtime path with ..",
        EXT.replace("/srv/runtimes/demo", "/srv/../etc"),
        "f.yaml:4:11: config.runtime.path: must be a normalized absolute path other than /, without control characters",
    ),
    (
        "runtime path with trailing slash",
        EXT.replace("/srv/runtimes/demo", "/srv/runtimes/"),
        "f.yaml:4:11: config.runtime.path: must be a normalized absolute path other than /, without control characters",
    ),
    ("config is a list", "extension: ext.bwrap\nconfig: [1]\n", "f.yaml:2:9: config: must be a mapping"),
    ("document is a list", "- 1\n", "f.yaml:1:1: (document): must be a mapping"),
    ("empty file", "", "f.yaml:1:1: file is empty"),
    (
        "anchor",
        EXT.replace("path: /srv", "path: &p /srv"),
        "f.yaml:4:11: config.runtime.path: anchors and aliases are not allowed",
    ),
    (
        "python tag",
        EXT.replace("path: /srv", "path: !!python/str /srv"),
        "f.yaml:4:11: config.runtime.path: unsupported YAML tag",
    ),
    (
        "image on ext.bwrap",
        EXT.replace("  runtime:", f"  image: sha256:{HEX}\n  runtime:"),
        "f.yaml:3:3: config.image: unknown key",
    ),
    (
        "docker without image",
        DOCKER.replace(f"  image: sha256:{HEX}\n", ""),
        "f.yaml:3:3: config.image: missing required key",
    ),
    (
        "docker tag-only image",
        DOCKER.replace(f"sha256:{HEX}", "debian:12"),
        "f.yaml:3:10: config.image: must be an immutable image reference"
        " (sha256:<64 hex> or repository@sha256:<64 hex>)",
    ),
    ("profile unknown key", PROFILE + "mounts: []\n", "f.yaml:11:1: mounts: unknown key"),
    (
        "profile missing setup",
        PROFILE.replace("setup:\n  secrets: []\n", ""),
        "f.yaml:1:1: setup: missing required key",
    ),
    (
        "profile bad name",
        PROFILE.replace("profile: dev", "profile: Dev/x"),
        "f.yaml:1:10: profile: must be 1-63 of a-z 0-9 _ - starting with a letter or digit",
    ),
    ("egress not a list", PROFILE.replace("egress: []", "egress: none"), "f.yaml:8:11: network.egress: must be a list"),
    (
        "secret of wrong type",
        PROFILE.replace("secrets: []", "secrets: [{a: 1}]"),
        "f.yaml:10:13: setup.secrets[0]: must be a string",
    ),
    (
        "network default other",
        PROFILE.replace("default: deny", "default: maybe"),
        "f.yaml:7:12: network.default: must be deny or allow",
    ),
    ("pids as string", PROFILE + "limits:\n  pids: many\n", "f.yaml:12:9: limits.pids: must be an integer"),
    ("pids as bool", PROFILE + "limits:\n  pids: true\n", "f.yaml:12:9: limits.pids: must be an integer"),
    ("pids too small", PROFILE + "limits:\n  pids: 1\n", "f.yaml:12:9: limits.pids: must be between 16 and 65536"),
    (
        "memory hex",
        PROFILE + "limits:\n  memory_mib: 0x400\n",
        "f.yaml:12:15: limits.memory_mib: integers must be decimal, at most 18 digits",
    ),
    (
        "best_effort string",
        PROFILE + "limits:\n  best_effort: yes\n",
        "f.yaml:12:16: limits.best_effort: must be true or false",
    ),
    ("cpus as string", PROFILE + "limits:\n  cpus: half\n", "f.yaml:12:9: limits.cpus: must be a number"),
    ("cpus as bool", PROFILE + "limits:\n  cpus: true\n", "f.yaml:12:9: limits.cpus: must be a number"),
    ("cpus zero", PROFILE + "limits:\n  cpus: 0\n", "f.yaml:12:9: limits.cpus: must be between 0.01 and 1024"),
    ("cpus not a number", PROFILE + "limits:\n  cpus: .nan\n", "f.yaml:12:9: limits.cpus: not a plain number"),
    (
        "max lifetime too short",
        PROFILE + "lifetime:\n  max_seconds: 5\n",
        "f.yaml:12:16: lifetime.max_seconds: must be between 60 and 31536000",
    ),
    (
        "max lifetime decimal",
        PROFILE + "lifetime:\n  max_seconds: 90.5\n",
        "f.yaml:12:16: lifetime.max_seconds: must be an integer",
    ),
    ("unknown limit", PROFILE + "limits:\n  cores: 2\n", "f.yaml:12:3: limits.cores: unknown key"),
    (
        "a misspelt limit",
        PROFILE + "limits:\n  memory_mb: 512\n",
        "f.yaml:12:3: limits.memory_mb: unknown key (did you mean memory_mib?)",
    ),
    (
        "a misspelt top-level key",
        PROFILE + "lifetme:\n  idle_seconds: 60\n",
        "f.yaml:11:1: lifetme: unknown key (did you mean lifetime?)",
    ),
    (
        "a git email that is no address",
        PROFILE.replace("  ref: main\n", "  ref: main\n  git:\n    user:\n      email: nobody\n"),
        "f.yaml:8:14: workspace.git.user.email: must be an address like a@b",
    ),
    (
        "a git name with a control character",
        PROFILE.replace("  ref: main\n", '  ref: main\n  git:\n    user:\n      name: "a\\x07b"\n'),
        "f.yaml:8:13: workspace.git.user.name: must be 1-100 printable characters",
    ),
    (
        "a caller_env name the sandbox sets itself",
        PROFILE + "exec:\n  caller_env: [TASK, PATH]\n",
        "f.yaml:12:22: exec.caller_env[1]: PATH is set by the sandbox itself, not by a caller",
    ),
    (
        "a caller_env name that is no name",
        PROFILE + "exec:\n  caller_env: [1ABC]\n",
        "f.yaml:12:16: exec.caller_env[0]: must be an environment name: letters, digits, _; not a digit first",
    ),
    (
        "a tab in the indentation",
        PROFILE + "limits:\n\tpids: 64\n",
        "f.yaml:12:1: tab characters are not allowed for indentation",
    ),
    (
        "workspace too small",
        PROFILE + "limits:\n  workspace_mib: 8\n",
        "f.yaml:12:18: limits.workspace_mib: must be between 16 and 1048576",
    ),
    (
        "state too small",
        PROFILE + "limits:\n  state_mib: 8\n",
        "f.yaml:12:14: limits.state_mib: must be between 16 and 65536",
    ),
    (
        "tmp too large",
        PROFILE + "limits:\n  tmp_mib: 65537\n",
        "f.yaml:12:12: limits.tmp_mib: must be between 16 and 65536",
    ),
    (
        "allow_ptrace string",
        PROFILE + "security:\n  allow_ptrace: yes\n",
        "f.yaml:12:17: security.allow_ptrace: must be true or false",
    ),
    ("unknown security key", PROFILE + "security:\n  seccomp: off\n", "f.yaml:12:3: security.seccomp: unknown key"),
    (
        "idle timeout zero",
        PROFILE + "lifetime:\n  idle_seconds: 0\n",
        "f.yaml:12:17: lifetime.idle_seconds: must be between 1 and 2592000",
    ),
    (
        "idle timeout string",
        PROFILE + "lifetime:\n  idle_seconds: soon\n",
        "f.yaml:12:17: lifetime.idle_seconds: must be an integer",
    ),
    ("unknown lifetime key", PROFILE + "lifetime:\n  ttl: 5\n", "f.yaml:12:3: lifetime.ttl: unknown key"),
    (
        "git ref with ..",
        PROFILE.replace("ref: main", "ref: main..evil"),
        "f.yaml:5:8: workspace.ref: must be a Git branch, tag or commit name (letters, digits, . _ / -)",
    ),
    (
        "git ref option-like",
        PROFILE.replace("ref: main", "ref: --upload-pack=x"),
        "f.yaml:5:8: workspace.ref: must be a Git branch, tag or commit name (letters, digits, . _ / -)",
    ),
    ("integer key", EXT + "1: x\n", "f.yaml:6:1: keys must be plain strings"),
    ("bad yaml", "extension: [\n", "f.yaml:2:1: invalid YAML: expected the node content, but found '…'"),
    ("undefined alias", "extension: *SECRETALIAS\n", "f.yaml:1:12: invalid YAML: found undefined alias '…'"),
    (
        "huge integer",
        PROFILE + "limits:\n  pids: " + "9" * 5000 + "\n",
        "f.yaml:12:9: limits.pids: integers must be decimal, at most 18 digits",
    ),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in BAD_FILES], ids=[d for d, _, _ in BAD_FILES])
def test_bad_file_is_refused_with_exact_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert str(info.value) == message
    assert info.value.exit_status == 2


def test_file_must_declare_the_name_its_path_gives_it() -> None:
    with pytest.raises(ConfigError) as info:
        parse(PROFILE, "other")
    assert str(info.value) == "f.yaml:1:10: profile: must equal the file's name (other)"


def test_non_utf8_file_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"f\.yaml:1:1: file is not valid UTF-8"):
        parse_owner_file(b"extension: \xff\n", "f.yaml")


def test_oversized_file_is_refused() -> None:
    with pytest.raises(ConfigError, match="larger than"):
        parse_owner_file(b"#" * (256 * 1024 + 1), "f.yaml")


FORBIDDEN = [
    (
        PROFILE.replace("default: deny", "default: allow"),
        "f.yaml:7:12: network.default: must be deny for ext.bwrap: there is no allow-everything;"
        " list hosts in network.egress",
    ),
    (
        PROFILE.replace("secrets: []", "secrets: [token]"),
        "f.yaml:10:12: setup.secrets: must be empty for ext.bwrap (secrets never enter a sandbox: use network.routes)",
    ),
    (
        PROFILE.replace("ext.bwrap", "ext.docker").replace("default: deny", "default: allow"),
        "f.yaml:7:12: network.default: must be deny for ext.docker: there is no allow-everything;"
        " list hosts in network.egress",
    ),
]


def test_egress_rules_are_accepted_on_both_backends() -> None:
    """Egress is enforced by the broker's proxy now (docs/egress.md): both backends take rules
    that were refused while nothing enforced them."""
    egress = "egress:\n    - {host: api.example.com, ports: [443]}"
    for text in (PROFILE, PROFILE.replace("ext.bwrap", "ext.docker")):
        item = parse(text.replace("egress: []", egress))
        assert isinstance(item, Profile)
        assert [(rule.host, rule.ports) for rule in item.egress] == [("api.example.com", (443,))]


@pytest.mark.parametrize(("text", "message"), FORBIDDEN)
def test_forbidden_setting_is_a_policy_refusal(text: str, message: str) -> None:
    with pytest.raises(ForbiddenSettingError) as info:
        parse(text)
    assert str(info.value) == message
    assert info.value.exit_status == 3


def test_structural_error_wins_over_forbidden_setting() -> None:
    text = PROFILE.replace("default: deny", "default: allow") + "extra: 1\n"
    with pytest.raises(ConfigError, match="extra: unknown key"):
        parse(text)


@given(secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=12, max_size=40))
@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_errors_never_quote_values(secret: str) -> None:
    texts = [
        PROFILE.replace("secrets: []", f"secrets: [{secret}]"),
        PROFILE.replace("secrets: []", f"secrets: {secret}"),
        PROFILE.replace("ref: main", f"ref: ..{secret}"),
        EXT.replace(HEX, secret),
        EXT.replace("ext.bwrap", secret),
        DOCKER.replace(f"sha256:{HEX}", f"{secret}:latest"),
        PROFILE + f"limits:\n  pids: {secret}\n",
        PROFILE.replace("default: deny", f"default: {secret}"),
    ]
    for text in texts:
        with pytest.raises((UsageError, ForbiddenSettingError)) as info:
            parse(text)
        assert secret not in str(info.value)


@pytest.mark.parametrize(
    "image",
    [
        f"sha256:{HEX}",
        f"debian@sha256:{HEX}",
        f"library/debian:12@sha256:{HEX}",
        f"registry.local:5000/team/img:v1.2@sha256:{HEX}",
    ],
)
def test_immutable_image_references_are_accepted(image: str) -> None:
    item = parse(DOCKER.replace(f"sha256:{HEX}", image, 1))
    assert isinstance(item, ExtensionConfig)
    assert item.image == image


@pytest.mark.parametrize(
    "image",
    [
        "debian",
        "debian:12",
        f"sha256:{HEX.upper()}",
        f"sha256:{HEX[:40]}",
        f"debian@sha256:{HEX[:63]}",
        f"https://registry/debian@sha256:{HEX}",
        f"${{IMAGE}}@sha256:{HEX}",
        f"Debian@sha256:{HEX}",
    ],
)
def test_mutable_or_malformed_image_references_are_refused(image: str) -> None:
    with pytest.raises(ConfigError, match=r"config\.image: must be an immutable image reference"):
        parse(DOCKER.replace(f"sha256:{HEX}", image, 1))


def test_names_map_to_their_files() -> None:
    assert validate_name("ext.bwrap") == "extensions/ext.bwrap.yaml"
    assert validate_name("bwrap-local") == "profiles/bwrap-local.yaml"
    for bad in ("../x", "ext.other", "A", "", "a/b"):
        with pytest.raises(UsageError):
            validate_name(bad)


@pytest.mark.parametrize(("text", "name"), [(DOCKER, "ext.docker"), (EXT, "ext.bwrap")], ids=["docker", "bwrap"])
def test_an_extension_keeps_no_warm_sandboxes_unless_it_says_so(text: str, name: str) -> None:
    item = parse(text, name)
    assert isinstance(item, ExtensionConfig)
    assert item.warm == 0
    warm = parse(text + "  warm: 3\n", name)
    assert isinstance(warm, ExtensionConfig)
    assert warm.warm == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DOCKER + "  warm: 9\n", r"f\.yaml:7:9: config\.warm: must be between 0 and 8"),
        (DOCKER + "  warm: -1\n", r"f\.yaml:7:9: config\.warm: must be between 0 and 8"),
        (DOCKER + "  warm: true\n", r"f\.yaml:7:9: config\.warm: must be an integer"),
        (DOCKER + '  warm: "2"\n', r"f\.yaml:7:9: config\.warm: must be an integer"),
        (EXT + "  warm: 9\n", r"f\.yaml:6:9: config\.warm: must be between 0 and 8"),
    ],
    ids=["too-many", "negative", "boolean", "string", "bwrap-too-many"],
)
def test_bad_warm_counts_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(text)


def test_service_containers_run_as_the_sandbox_user_unless_the_owner_allows_the_images_own() -> None:
    plain = parse(DOCKER, "ext.docker")
    assert isinstance(plain, ExtensionConfig)
    assert plain.service_user == "sandbox"
    allowed = parse(DOCKER + "  service_user: image\n", "ext.docker")
    assert isinstance(allowed, ExtensionConfig)
    assert allowed.service_user == "image"
    assert from_meaning(meaning(allowed), allowed.file_sha256) == allowed  # the parse cache keeps it


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DOCKER + "  service_user: root\n", r"f\.yaml:7:17: config\.service_user: must be sandbox or image"),
        (EXT + "  service_user: image\n", r"f\.yaml:6:17: config\.service_user: only ext\.docker runs service"),
    ],
    ids=["unknown", "bwrap"],
)
def test_a_bad_service_user_is_refused_by_file_line_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(text)


@pytest.mark.parametrize("path", ["extensions/ext.bwrap.yaml", "extensions/ext.docker.yaml"])
def test_the_shipped_extension_templates_parse(path: str) -> None:

    name = Path(path).stem
    item = parse((Path(__file__).resolve().parents[2] / path).read_text(), name)
    assert isinstance(item, ExtensionConfig)
    assert item.extension == name
    assert item.warm == 0
