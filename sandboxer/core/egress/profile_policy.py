"""The egress policy of one sandbox, from its approved profile and extension config: the
profile's rules and limits, and the extension's routes the profile opts into (`network.routes`).

A route's host must also be listed in `network.egress` (by name, exact or `*.suffix`, on any of
its ports): a route adds a credential to traffic the profile already lets through, it never
opens a way out of its own. `route_problem` says what is wrong with a pairing; create and
approval refuse it (sandboxer/commands/making.py, owner.py), so `policy_of` only builds valid ones.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

from sandboxer.core.egress.policy import EgressPolicy, name_matches

if TYPE_CHECKING:
    from sandboxer.core.config_types import ExtensionConfig, Profile


def route_problem(profile: Profile, extension: ExtensionConfig) -> str | None:
    """Why the profile's `network.routes` cannot be used with this extension config, or None."""
    for name in profile.routes:
        route = extension.routes.get(name)
        if route is None:
            known = ", ".join(sorted(extension.routes)) or "none"
            return (
                f"profile {profile.name}: network.routes: {name} is not a route of {extension.extension}"
                f" (config.routes has: {known})"
            )
        if not any(name_matches(rule.host, route.host) for rule in profile.egress):
            return (
                f"profile {profile.name}: network.routes: the host of route {name} is not listed in"
                " network.egress (a route adds a credential to listed traffic, it opens no way out)"
            )
    return None


def policy_of(profile: Profile, extension: ExtensionConfig) -> EgressPolicy | None:
    """What the sandbox's proxy enforces, or None for a profile with no egress (loopback only).
    A pairing `route_problem` refuses raises ValueError: admission checks it first."""
    problem = route_problem(profile, extension)
    if problem is not None:
        raise ValueError(problem)
    if not profile.egress:
        return None
    routes = {name: extension.routes[name] for name in profile.routes}
    return EgressPolicy(rules=profile.egress, limits=profile.egress_limits, routes=types.MappingProxyType(routes))
