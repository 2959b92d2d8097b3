"""The owner's egress keys (docs/egress.md, "The owner's keys"): a profile's network.egress,
routes, limits and publish, and an extension config's config.routes. Every rule has a bad file
and its exact one-line error; a good file means what it says, through the parse cache too."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxer.core.config import parse_owner_file
from sandboxer.core.config_types import ExtensionConfig, OwnerFile, Profile, from_meaning, meaning
from sandboxer.core.egress.policy import EgressRule, Limits, Route
from sandboxer.errors import ConfigError, ForbiddenSettingError, SandboxerError
from tests.samples import profile_yaml

HEX = "ab" * 32
PROFILE = profile_yaml("dev")
EXT = f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: /srv/runtimes/demo\n    sha256: {HEX}\n"


def network(block: str, profile: str = PROFILE) -> str:
    """The sample profile with its `egress: []` line replaced by `block` (from line 8)."""
    return profile.replace("  egress: []\n", block)


def route(**fields: str | None) -> str:
    """The sample extension config with one route `model`; a field given as None is left out."""
    chosen: dict[str, str | None] = {"host": "api.model.test", "header": "x-api-key", "secret_file": "/etc/s/model"}
    chosen.update(fields)
    body = "".join(f"      {key}: {value}\n" for key, value in chosen.items() if value is not None)
    return EXT + "  routes:\n    model:\n" + body


def parse(text: str) -> OwnerFile:
    return parse_owner_file(text.encode(), "f.yaml")


def cached(item: OwnerFile) -> OwnerFile:
    """The item as the parse cache gives it back (its meaning, through JSON)."""
    return from_meaning(json.loads(json.dumps(meaning(item))), item.file_sha256)


GOOD_NETWORK = """  egress:
    - host: PyPI.org
      ports: [443]
    - host: api.model.test
      ports: [8443, 443]
      addresses: [127.0.0.1, "::1"]
    - host: "*.files.example"
      ports: [443]
    - host: 203.0.113.7
      ports: [80]
  routes: [model, other]
  limits: {connections: 8, seconds: 30}
  publish: none
"""


def test_egress_rules_routes_and_limits_are_parsed_into_the_proxys_types() -> None:
    item = parse(network(GOOD_NETWORK))
    assert isinstance(item, Profile)
    assert item.egress == (
        EgressRule(host="pypi.org", ports=(443,)),  # lower-cased, as the proxy compares
        EgressRule(host="api.model.test", ports=(8443, 443), addresses=("127.0.0.1", "::1")),
        EgressRule(host="*.files.example", ports=(443,)),
        EgressRule(host="203.0.113.7", ports=(80,)),
    )
    assert item.routes == ("model", "other")
    assert item.egress_limits == Limits(connections=8, mib=1024, seconds=30)
    assert item.has_egress
    assert cached(item) == item


def test_a_profile_without_the_new_keys_means_loopback_only_with_default_limits() -> None:
    item = parse(PROFILE)
    assert isinstance(item, Profile)
    assert (item.egress, item.routes, item.egress_limits, item.has_egress) == ((), (), Limits(), False)
    assert meaning(item)["network"] == {
        "default": "deny",
        "egress": [],
        "routes": [],
        "limits": {"connections": 64, "mib": 1024, "seconds": 600},
        "publish": "none",
    }
    assert cached(item) == item


def test_the_meaning_shows_every_rule_as_the_file_does() -> None:
    item = parse(network(GOOD_NETWORK))
    assert meaning(item)["network"] == {
        "default": "deny",
        "egress": [
            {"host": "pypi.org", "ports": [443], "addresses": []},
            {"host": "api.model.test", "ports": [8443, 443], "addresses": ["127.0.0.1", "::1"]},
            {"host": "*.files.example", "ports": [443], "addresses": []},
            {"host": "203.0.113.7", "ports": [80], "addresses": []},
        ],
        "routes": ["model", "other"],
        "limits": {"connections": 8, "mib": 1024, "seconds": 30},
        "publish": "none",
    }


def test_an_old_cache_entry_without_the_new_keys_reads_as_their_defaults() -> None:
    item = parse(PROFILE)
    document = json.loads(json.dumps(meaning(item)))
    document["network"] = {"default": "deny", "egress": []}  # as a broker before issue 33 cached it
    assert from_meaning(document, item.file_sha256) == item


PROFILE_REFUSALS = {
    "host *": (
        "  egress:\n    - {host: '*', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: there is no allow-everything: name each host (exact, or *.suffix)",
    ),
    "a suffix of one label": (
        "  egress:\n    - {host: '*.com', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: a *.suffix must keep at least two labels (*.example.com, not *.com)",
    ),
    "a wildcard inside": (
        "  egress:\n    - {host: 'a.*.com', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: must be a DNS name, *.suffix or canonical IP literal (malformed host)",
    ),
    "a wildcard over addresses": (
        "  egress:\n    - {host: '*.127.0.0.1', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: a *.suffix must be followed by a DNS name (here: an IP literal)",
    ),
    "a short IPv4 form": (
        "  egress:\n    - {host: '127.1', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: must be a DNS name, *.suffix or canonical IP literal"
        " (non-canonical IP literal)",
    ),
    "IPv6 in brackets": (
        "  egress:\n    - {host: '[::1]', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: an IP literal must be in canonical form (no brackets, zeros or zone)",
    ),
    "a v4-mapped address spelt the long way": (
        "  egress:\n    - {host: '::ffff:127.0.0.1', ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: an IP literal must be in canonical form (no brackets, zeros or zone)",
    ),
    "a numeric last label": (
        "  egress:\n    - {host: a.123, ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: must be a DNS name, *.suffix or canonical IP literal"
        " (non-canonical IP literal)",
    ),
    "a trailing dot": (
        "  egress:\n    - {host: a.example., ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: must be a DNS name, *.suffix or canonical IP literal (malformed host)",
    ),
    "a host as a number": (
        "  egress:\n    - {host: 127.1, ports: [443]}\n",
        "f.yaml:9:14: network.egress[0].host: must be a string",
    ),
    "no ports": (
        "  egress:\n    - {host: a.example, ports: []}\n",
        "f.yaml:9:32: network.egress[0].ports: must list at least one port",
    ),
    "port 0": (
        "  egress:\n    - {host: a.example, ports: [0]}\n",
        "f.yaml:9:33: network.egress[0].ports[0]: must be between 1 and 65535",
    ),
    "port 65536": (
        "  egress:\n    - {host: a.example, ports: [65536]}\n",
        "f.yaml:9:33: network.egress[0].ports[0]: must be between 1 and 65535",
    ),
    "a port as a string": (
        "  egress:\n    - {host: a.example, ports: ['443']}\n",
        "f.yaml:9:33: network.egress[0].ports[0]: must be an integer",
    ),
    "a port twice": (
        "  egress:\n    - {host: a.example, ports: [443, 80, 443]}\n",
        "f.yaml:9:42: network.egress[0].ports[2]: duplicate port",
    ),
    "ports left out": (
        "  egress:\n    - {host: a.example}\n",
        "f.yaml:9:7: network.egress[0].ports: missing required key",
    ),
    "an unknown key in a rule": (
        "  egress:\n    - {host: a.example, ports: [443], port: 1}\n",
        "f.yaml:9:39: network.egress[0].port: unknown key (did you mean ports?)",
    ),
    "a host twice, in other case": (
        "  egress:\n    - {host: a.example, ports: [443]}\n    - {host: A.Example, ports: [80]}\n",
        "f.yaml:10:14: network.egress[1].host: duplicate host (also in network.egress[0]): merge the ports",
    ),
    "a bare name as a rule": ("  egress: [a.example]\n", "f.yaml:8:12: network.egress[0]: must be a mapping"),
    "a name among addresses": (
        "  egress:\n    - {host: a.example, ports: [443], addresses: [localhost]}\n",
        "f.yaml:9:51: network.egress[0].addresses[0]: must be an IP address in canonical form"
        " (no brackets, zeros or zone)",
    ),
    "an address with zeros": (
        "  egress:\n    - {host: a.example, ports: [443], addresses: ['127.000.0.1']}\n",
        "f.yaml:9:51: network.egress[0].addresses[0]: must be an IP address in canonical form"
        " (no brackets, zeros or zone)",
    ),
    "no addresses": (
        "  egress:\n    - {host: a.example, ports: [443], addresses: []}\n",
        "f.yaml:9:50: network.egress[0].addresses: must list an address, or be left out",
    ),
    "an address twice": (
        "  egress:\n    - {host: a.example, ports: [443], addresses: [127.0.0.1, 127.0.0.1]}\n",
        "f.yaml:9:62: network.egress[0].addresses[1]: duplicate address",
    ),
    "addresses for an address": (
        "  egress:\n    - {host: 10.0.0.1, ports: [443], addresses: [10.0.0.1]}\n",
        "f.yaml:9:49: network.egress[0].addresses: an IP literal host is its own address",
    ),
    "a route name in capitals": (
        "  egress: []\n  routes: [Model]\n",
        "f.yaml:9:12: network.routes[0]: must be a route name: 1-63 of a-z 0-9 _ -",
    ),
    "a route twice": ("  egress: []\n  routes: [m, m]\n", "f.yaml:9:15: network.routes[1]: duplicate route"),
    "routes not a list": ("  egress: []\n  routes: m\n", "f.yaml:9:11: network.routes: must be a list"),
    "an unknown limit": ("  egress: []\n  limits: {bytes: 1}\n", "f.yaml:9:12: network.limits.bytes: unknown key"),
    "no connections": (
        "  egress: []\n  limits: {connections: 0}\n",
        "f.yaml:9:25: network.limits.connections: must be between 1 and 4096",
    ),
    "seconds with a fraction": (
        "  egress: []\n  limits: {seconds: 1.5}\n",
        "f.yaml:9:21: network.limits.seconds: must be an integer",
    ),
    "more than a TiB": (
        "  egress: []\n  limits: {mib: 2000000}\n",
        "f.yaml:9:17: network.limits.mib: must be between 1 and 1048576",
    ),
    "publish something else": (
        "  egress: []\n  publish: all\n",
        "f.yaml:9:12: network.publish: must be none or loopback",
    ),
    "an unknown network key": ("  egress: []\n  dns: on\n", "f.yaml:9:3: network.dns: unknown key"),
}


@pytest.mark.parametrize(("block", "message"), PROFILE_REFUSALS.values(), ids=PROFILE_REFUSALS.keys())
def test_each_egress_rule_has_its_one_line_error(block: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse(network(block))
    assert str(refused.value) == message
    assert refused.value.exit_status == 2


def test_publish_is_none_or_loopback() -> None:
    assert parse(network("  egress: []\n  publish: loopback\n")).publish == "loopback"
    assert parse(network("  egress: []\n")).publish == "none"
    with pytest.raises(ConfigError) as refused:
        parse(network("  egress: []\n  publish: everywhere\n"))
    assert str(refused.value) == "f.yaml:9:12: network.publish: must be none or loopback"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            network("  egress: []\n", PROFILE.replace("default: deny", "default: allow")),
            "f.yaml:7:12: network.default: must be deny for ext.bwrap: there is no allow-everything;"
            " list hosts in network.egress",
        ),
    ],
)
def test_what_no_backend_offers_is_a_policy_refusal(text: str, message: str) -> None:
    with pytest.raises(ForbiddenSettingError) as refused:
        parse(text)
    assert str(refused.value) == message
    assert refused.value.exit_status == 3


def test_setup_secrets_stay_refused_pointing_at_routes() -> None:
    with pytest.raises(ForbiddenSettingError, match=r"secrets never enter a sandbox: use network\.routes"):
        parse(PROFILE.replace("secrets: []", "secrets: [token]"))


def test_routes_are_parsed_into_the_proxys_type_and_back() -> None:
    item = parse(
        route(header="Authorization", format="'Bearer {secret}'", expires_at="'2099-01-01T00:00:00Z'")
        + "    plain:\n      host: Index.Example\n      header: x-token\n      secret_file: /etc/s/plain\n"
    )
    assert isinstance(item, ExtensionConfig)
    assert dict(item.routes) == {
        "model": Route(
            name="model",
            host="api.model.test",
            header="Authorization",
            format="Bearer {secret}",
            secret_file="/etc/s/model",
            expires_at=4070908800.0,
        ),
        "plain": Route(name="plain", host="index.example", header="x-token", secret_file="/etc/s/plain"),
    }
    assert meaning(item)["config"]["routes"]["model"] == {
        "host": "api.model.test",
        "header": "Authorization",
        "format": "Bearer {secret}",
        "secret_file": "/etc/s/model",
        "expires_at": "2099-01-01T00:00:00Z",
    }
    assert meaning(item)["config"]["routes"]["plain"]["format"] == "{secret}"  # the default, shown
    assert cached(item) == item
    with pytest.raises(TypeError):
        item.routes["x"] = item.routes["model"]  # type: ignore[index]  # frozen, like every parsed value


def test_an_extension_config_without_routes_has_none() -> None:
    item = parse(EXT)
    assert isinstance(item, ExtensionConfig)
    assert dict(item.routes) == {}
    assert meaning(item)["config"]["routes"] == {}
    assert cached(item) == item


def test_an_expiry_with_a_fraction_and_an_explicit_utc_offset_is_read() -> None:
    item = parse(route(expires_at="'2099-01-01T00:00:00.250+00:00'"))
    assert isinstance(item, ExtensionConfig)
    assert item.routes["model"].expires_at == 4070908800.25
    assert meaning(item)["config"]["routes"]["model"]["expires_at"] == "2099-01-01T00:00:00.250000Z"
    assert cached(item) == item


HEADER_REFUSED = (
    "f.yaml:9:15: config.routes.model.header:"
    " must not be Host, Content-Length, Transfer-Encoding, Proxy-* or hop-by-hop"
)
TIME_RULE = 'must be an RFC 3339 time in UTC, quoted ("2099-01-01T00:00:00Z")'
ROUTE_REFUSALS = {
    "a route name in capitals": (
        EXT + "  routes:\n    Model:\n      host: a.test\n      header: x\n      secret_file: /s\n",
        "f.yaml:7:5: config.routes.Model: a route name must be 1-63 of a-z 0-9 _ -",
    ),
    "routes as a list": (
        EXT + "  routes: [model]\n",
        "f.yaml:6:11: config.routes: must be a mapping of route names to routes",
    ),
    "a wildcard host": (
        route(host="'*.model.test'"),
        "f.yaml:8:13: config.routes.model.host: must be one exact DNS name (no *. wildcard)",
    ),
    "an address as host": (
        route(host="127.0.0.1"),
        "f.yaml:8:13: config.routes.model.host: must be a DNS name, not an IP literal",
    ),
    "host *": (
        route(host="'*'"),
        "f.yaml:8:13: config.routes.model.host: there is no allow-everything: name each host (exact, or *.suffix)",
    ),
    "a malformed host": (
        route(host="'a..b'"),
        "f.yaml:8:13: config.routes.model.host: must be a DNS name (malformed host)",
    ),
    "Host": (route(header="Host"), HEADER_REFUSED),
    "content-length": (route(header="content-length"), HEADER_REFUSED),
    "Transfer-Encoding": (route(header="Transfer-Encoding"), HEADER_REFUSED),
    "Connection": (route(header="Connection"), HEADER_REFUSED),
    "Proxy-Authorization": (
        route(header="Proxy-Authorization"),
        HEADER_REFUSED,
    ),
    "a header with a space": (
        route(header="'x api'"),
        "f.yaml:9:15: config.routes.model.header: must be an HTTP header name"
        " (a token: letters, digits, - and the like)",
    ),
    "a header with a colon": (
        route(header="'x:'"),
        "f.yaml:9:15: config.routes.model.header: must be an HTTP header name"
        " (a token: letters, digits, - and the like)",
    ),
    "a format without the secret": (
        route(format="'Bearer'"),
        "f.yaml:11:15: config.routes.model.format: must contain {secret} exactly once",
    ),
    "a format with it twice": (
        route(format="'{secret}{secret}'"),
        "f.yaml:11:15: config.routes.model.format: must contain {secret} exactly once",
    ),
    "a format with a tab": (
        route(format='"Bearer\\t{secret}"'),
        "f.yaml:11:15: config.routes.model.format: must be 1-1024 printable ASCII characters",
    ),
    "a format with a newline": (
        route(format='"Bearer {secret}\\r\\nX-Injected: 1"'),
        "f.yaml:11:15: config.routes.model.format: must be 1-1024 printable ASCII characters",
    ),
    "a format beyond ASCII": (
        route(format='"Bé {secret}"'),
        "f.yaml:11:15: config.routes.model.format: must be 1-1024 printable ASCII characters",
    ),
    "a relative secret file": (
        route(secret_file="secrets/model"),
        "f.yaml:10:20: config.routes.model.secret_file: must be a normalized absolute path other than /,"
        " without control characters",
    ),
    "no secret file": (route(secret_file=None), "f.yaml:8:7: config.routes.model.secret_file: missing required key"),
    "an unquoted time": (
        route(expires_at="2099-01-01T00:00:00Z"),
        "f.yaml:11:19: config.routes.model.expires_at: unsupported YAML tag (quote dates and times)",
    ),
    "a time in another zone": (
        route(expires_at="'2099-01-01T00:00:00+02:00'"),
        f"f.yaml:11:19: config.routes.model.expires_at: {TIME_RULE}",
    ),
    "a date alone": (route(expires_at="'2099-01-01'"), f"f.yaml:11:19: config.routes.model.expires_at: {TIME_RULE}"),
    "no such day": (
        route(expires_at="'2099-02-30T00:00:00Z'"),
        f"f.yaml:11:19: config.routes.model.expires_at: {TIME_RULE}",
    ),
    "seconds since the epoch": (
        route(expires_at="4070908800"),
        "f.yaml:11:19: config.routes.model.expires_at: must be a string",
    ),
    "an unknown route key": (route(secret="x"), "f.yaml:11:7: config.routes.model.secret: unknown key"),
    "two routes for one host": (
        EXT + "  routes:\n    a:\n      host: x.test\n      header: h\n      secret_file: /s\n"
        "    b:\n      host: X.test\n      header: h\n      secret_file: /s\n",
        "f.yaml:12:13: config.routes.b.host: another route (a) has this host",
    ),
}


@pytest.mark.parametrize(("text", "message"), ROUTE_REFUSALS.values(), ids=ROUTE_REFUSALS.keys())
def test_each_route_rule_has_its_one_line_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse(text)
    assert str(refused.value) == message
    assert refused.value.exit_status == 2


@given(secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=12, max_size=40))
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_egress_errors_never_quote_values(secret: str) -> None:
    texts = [
        network(f"  egress:\n    - {{host: '{secret}..x', ports: [443]}}\n"),
        network(f"  egress:\n    - {{host: '*.{secret}', ports: [443]}}\n"),
        network(f"  egress:\n    - {{host: a.example, ports: [443], addresses: ['{secret}']}}\n"),
        network(f"  egress: []\n  routes: ['{secret}!']\n"),
        network(f"  egress: []\n  publish: {secret}\n"),
        route(host=f"'{secret}..x'"),
        route(header=f"'{secret} x'"),
        route(format=f"'Bearer {secret}'"),
        route(secret_file=f"'{secret}'"),
        route(expires_at=f"'{secret}'"),
    ]
    for text in texts:
        with pytest.raises(SandboxerError) as refused:
            parse(text)
        assert secret not in str(refused.value)
