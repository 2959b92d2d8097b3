"""What a profile with egress makes of a sandbox: its policy (core/egress/profile_policy.py), and
its plan's environment, network and trust mount (core/plan.py); and the names that environment
reserves, which neither the owner (exec.env) nor a caller (exec.caller_env) may set."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest

from sandboxer.core.config import parse_owner_file
from sandboxer.core.config_types import ExtensionConfig, Limits, Profile, RuntimePin, Workspace
from sandboxer.core.egress.inside import EGRESS_PORT, EGRESS_PROXY_URL, TRUST_BUNDLE
from sandboxer.core.egress.policy import EgressPolicy, EgressRule, Route, decide
from sandboxer.core.egress.policy import Limits as EgressLimits
from sandboxer.core.egress.profile_policy import policy_of, route_problem
from sandboxer.core.plan import PLAN_ENV_NAMES, Grants, MountKind, build_plan
from sandboxer.errors import ConfigError
from tests.samples import profile_yaml

MODEL = Route(name="model", host="api.model.test", header="x-api-key", secret_file="/etc/s/model")
INDEX = Route(name="index", host="pypi.org", header="Authorization", format="Basic {secret}", secret_file="/etc/s/i")
RULES = (EgressRule(host="pypi.org", ports=(443,)), EgressRule(host="*.model.test", ports=(8443,)))
PROXY_NAMES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
TRUST_NAMES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
)


def profile(egress: tuple[EgressRule, ...] = (), routes: tuple[str, ...] = ()) -> Profile:
    return Profile(
        name="p",
        extension="ext.bwrap",
        workspace=Workspace(repository="/srv/repos/demo", ref="main"),
        network_default="deny",
        egress=egress,
        secrets=(),
        limits=Limits(),
        file_sha256="0" * 64,
        routes=routes,
        egress_limits=EgressLimits(connections=4, mib=10, seconds=5),
    )


EXTENSION = ExtensionConfig(
    extension="ext.bwrap",
    runtime=RuntimePin(path="/opt/rt", sha256="1" * 64),
    image=None,
    file_sha256="2" * 64,
    routes=types.MappingProxyType({"model": MODEL, "index": INDEX}),
)


def plan_env(item: Profile, *, grants: Grants | None = None, trust_bundle: bytes | None = None) -> dict[str, str]:
    planned = build_plan(
        sandbox_id="a" * 24,
        profile=item,
        extension=EXTENSION,
        workspace_source="/w",
        grants=grants,
        trust_bundle=trust_bundle,
    )
    return dict(planned.env)


def test_a_profile_without_egress_has_no_policy() -> None:
    assert policy_of(profile(), EXTENSION) is None


def test_the_policy_is_the_profiles_rules_and_limits_and_only_the_routes_it_names() -> None:
    policy = policy_of(profile(RULES, ("model",)), EXTENSION)
    assert policy == EgressPolicy(
        rules=RULES,
        limits=EgressLimits(connections=4, mib=10, seconds=5),
        routes=types.MappingProxyType({"model": MODEL}),
    )
    assert policy is not None
    assert decide(policy, "api.model.test", 8443).route == MODEL
    assert decide(policy, "pypi.org", 443).route is None  # the extension's index route: not opted into


def test_a_route_the_extension_does_not_have_is_refused_by_name() -> None:
    problem = route_problem(profile(RULES, ("model", "missing")), EXTENSION)
    assert problem == "profile p: network.routes: missing is not a route of ext.bwrap (config.routes has: index, model)"
    with pytest.raises(ValueError, match="missing is not a route"):
        policy_of(profile(RULES, ("missing",)), EXTENSION)


def test_a_routes_host_must_also_be_listed_in_egress() -> None:
    """A route adds a credential to traffic the profile lets through; it opens no way out."""
    only_index = (EgressRule(host="pypi.org", ports=(443,)),)
    assert route_problem(profile(only_index, ("model",)), EXTENSION) == (
        "profile p: network.routes: the host of route model is not listed in network.egress"
        " (a route adds a credential to listed traffic, it opens no way out)"
    )
    assert route_problem(profile((), ("index",)), EXTENSION) is not None  # routes without egress
    assert route_problem(profile(RULES, ("model",)), EXTENSION) is None  # *.model.test lists it


def test_a_sandbox_without_egress_keeps_loopback_and_none_of_the_proxy_names() -> None:
    planned = build_plan(sandbox_id="a" * 24, profile=profile(), extension=EXTENSION, workspace_source="/w")
    env = dict(planned.env)
    assert (planned.network, planned.egress, planned.routes) == ("loopback", False, ())
    assert env["SANDBOXER_NETWORK"] == "loopback"
    assert not set(env) & {*PROXY_NAMES, "NO_PROXY", "no_proxy", *TRUST_NAMES}
    assert all(mount.target != TRUST_BUNDLE for mount in planned.mounts)


def test_egress_points_every_proxy_variable_at_the_listener() -> None:
    planned = build_plan(sandbox_id="a" * 24, profile=profile(RULES), extension=EXTENSION, workspace_source="/w")
    env = dict(planned.env)
    assert EGRESS_PROXY_URL == f"http://127.0.0.1:{EGRESS_PORT}" == "http://127.0.0.1:3128"
    assert {name: env[name] for name in PROXY_NAMES} == dict.fromkeys(PROXY_NAMES, EGRESS_PROXY_URL)
    assert (env["NO_PROXY"], env["no_proxy"]) == ("localhost,127.0.0.1,::1",) * 2
    assert env["SANDBOXER_NETWORK"] == "proxy"
    assert (planned.network, planned.egress) == ("proxy", True)
    assert not set(env) & set(TRUST_NAMES)  # no routes: no terminated TLS, the host's roots suffice
    assert all(mount.target != TRUST_BUNDLE for mount in planned.mounts)


def test_routes_add_the_trust_bundle_as_a_read_only_file() -> None:
    bundle = b"-----BEGIN CERTIFICATE-----\nhost and sandbox CAs\n-----END CERTIFICATE-----\n"
    planned = build_plan(
        sandbox_id="a" * 24,
        profile=profile(RULES, ("model",)),
        extension=EXTENSION,
        workspace_source="/w",
        trust_bundle=bundle,
    )
    env = dict(planned.env)
    assert TRUST_BUNDLE == "/etc/sandboxer/trust/bundle.pem"
    assert {name: env[name] for name in TRUST_NAMES} == dict.fromkeys(TRUST_NAMES, TRUST_BUNDLE)
    assert env["HTTPS_PROXY"] == EGRESS_PROXY_URL
    mount = planned.mount_at(TRUST_BUNDLE)
    assert (mount.kind, mount.content, mount.read_only, mount.mode) == (MountKind.FILE, bundle, True, 0o444)
    assert planned.routes == ("model",)


def test_routes_without_a_trust_bundle_are_a_callers_mistake() -> None:
    with pytest.raises(ValueError, match="trust_bundle"):
        build_plan(sandbox_id="a" * 24, profile=profile(RULES, ("model",)), extension=EXTENSION, workspace_source="/w")


def test_a_manifests_variables_cannot_redirect_the_proxy() -> None:
    grants = Grants(env=(("HTTPS_PROXY", "http://elsewhere:1"), ("SSL_CERT_FILE", "/workspace/mine.pem")))
    env = plan_env(profile(RULES, ("model",)), grants=grants, trust_bundle=b"CA\n")
    assert (env["HTTPS_PROXY"], env["SSL_CERT_FILE"]) == (EGRESS_PROXY_URL, TRUST_BUNDLE)


RESERVED = [*PROXY_NAMES, "NO_PROXY", "no_proxy", *TRUST_NAMES, "SANDBOXER_NETWORK"]


def test_every_name_egress_sets_is_a_plan_name() -> None:
    assert set(RESERVED) <= PLAN_ENV_NAMES
    env = plan_env(profile(RULES, ("model",)), trust_bundle=b"CA\n")
    assert {name for name in env if name != "SANDBOXER_SANDBOX_ID"} <= PLAN_ENV_NAMES


@pytest.mark.parametrize("name", RESERVED)
def test_the_owner_may_not_set_an_egress_name_in_exec_env(name: str) -> None:
    text = profile_yaml("p", extra=f"exec:\n  env:\n    {name}: http://elsewhere:1\n")
    with pytest.raises(ConfigError) as refused:
        parse_owner_file(text.encode(), "p.yaml")
    assert str(refused.value) == f"p.yaml:13:5: exec.env.{name}: {name} is set by the sandbox itself"
    assert "elsewhere" not in str(refused.value)


@pytest.mark.parametrize("name", RESERVED)
def test_a_caller_may_never_be_let_set_an_egress_name(name: str) -> None:
    text = profile_yaml("p", extra=f"exec:\n  caller_env: [TASK_ID, {name}]\n")
    with pytest.raises(ConfigError) as refused:
        parse_owner_file(text.encode(), "p.yaml")
    assert str(refused.value) == (
        f"p.yaml:12:25: exec.caller_env[1]: {name} is set by the sandbox itself, not by a caller"
    )


def test_the_profiles_limits_reach_the_policy_unchanged() -> None:
    item = replace(profile(RULES), egress_limits=EgressLimits(connections=1, mib=1, seconds=1))
    policy = policy_of(item, EXTENSION)
    assert policy is not None
    assert policy.limits == EgressLimits(connections=1, mib=1, seconds=1)
