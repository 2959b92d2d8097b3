"""What a Docker sandbox's service containers are, checked against their plan (services.py): each
sidecar and port proxy as the Engine and the host show it, and the sandbox's network; and what
`inspect` shows of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pyroute2 import IPRoute

from sandboxer.backends.docker.container import engine_call, pid1_problems
from sandboxer.backends.docker.render import Hardening, hardening_problems
from sandboxer.backends.docker.services import (
    BRIDGE_OPTION,
    INHIBIT_IPV4,
    PROXY_SOCKETS,
    Image,
    bridge_name,
    check_images,
    hardening,
    inspect,
    labels,
    tmpfs,
    user_of,
)

if TYPE_CHECKING:
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import ServicesRecord


def evidence(services: ServicesRecord) -> dict[str, Any]:
    """What inspect shows of them: the network, each sidecar (image, container, address) and
    each port proxy (port inside, container) and the image they run."""
    return {
        "network": services.network,
        "image_user": services.image_user,
        "sidecars": [
            {"name": s.name, "image": s.image, "container": s.container_id, "address": s.address}
            for s in services.sidecars
        ],
        "port_proxy_image": services.proxy_image,
        "port_proxies": [{"runtime": runtime, "container": container_id} for runtime, container_id in services.proxies],
    }


def problems(services: ServicesRecord, plan: Plan, *, app_id: str, sandbox_id: str, state_dir: str) -> list[str]:
    """Every way the sandbox's network, sidecars and proxies differ from their plan, as the Engine
    and the host show them."""
    found: list[str] = []
    members = {app_id}
    images = check_images(services, file="the record")
    for sidecar in services.sidecars:
        attrs = inspect(str(sidecar.container_id))
        image = images[sidecar.image]
        planned = hardening(plan, user=user_of(services, plan, image), network=str(services.network))
        host_ids = None if services.image_user else (plan.host_uid, plan.host_gid)
        role = labels(sandbox_id, state_dir, "service", sidecar.name)
        found += [
            f"service {sidecar.name}: {p}" for p in _container_problems(attrs, planned, image, role, host_ids, binds=[])
        ]
        networks = set((attrs.get("NetworkSettings") or {}).get("Networks") or {})
        if networks != {services.network}:
            found.append(f"service {sidecar.name}: on networks {sorted(networks)}, planned only the sandbox's")
        members.add(str(sidecar.container_id))
    for runtime, container_id in services.proxies:
        attrs = inspect(container_id)
        planned = hardening(plan, user=f"{plan.uid}:{plan.gid}", network=f"container:{app_id}")
        role = labels(sandbox_id, state_dir, "port-proxy", str(runtime))
        binds = [(PROXY_SOCKETS, str(services.proxy_sockets))]
        found += [
            f"port proxy {runtime}: {p}"
            for p in _container_problems(
                attrs, planned, images[str(services.proxy_image)], role, (plan.host_uid, plan.host_gid), binds=binds
            )
        ]
    if services.network is not None:
        found += network_problems(str(services.network), members)
    return found


def _container_problems(
    attrs: dict[str, Any],
    planned: Hardening,
    image: Image,
    role: dict[str, str],
    host_ids: tuple[int, int] | None,
    *,
    binds: list[tuple[str, str]],
) -> list[str]:
    found = hardening_problems(attrs, planned) + pid1_problems(attrs, host_ids)
    if attrs.get("Image") != image.id:
        found.append(f"runs image {attrs.get('Image')}, planned {image.id}")
    if not (attrs.get("State") or {}).get("Running"):
        found.append("not running")
    seen_labels = (attrs.get("Config") or {}).get("Labels") or {}
    if any(seen_labels.get(key) != value for key, value in role.items()):
        found.append("its labels are not the sandbox's")
    if ((attrs.get("HostConfig") or {}).get("Tmpfs") or {}) != tmpfs():
        found.append("tmpfs mounts differ from the plan (/tmp and /run)")
    mounts = attrs.get("Mounts") or []
    seen_binds = [(m.get("Destination"), m.get("Source")) for m in mounts if m.get("Type") == "bind"]
    if seen_binds != binds or any(m.get("Type") not in ("bind", "volume") for m in mounts):
        found.append(f"mounts {seen_binds} differ from the plan {binds} (only the image's own volumes besides)")
    if any(m.get("Type") == "bind" and not m.get("RW") for m in mounts):
        found.append("its socket directory is read-only")
    return found


def network_problems(network: str, members: set[str]) -> list[str]:
    """The network is internal, IPv4-only, with no host address, and holds only `members`."""
    status, document = engine_call("GET", f"/networks/{quote(network, safe='')}")
    if status != 200 or not isinstance(document, dict):
        return [f"network {network}: the Engine answered HTTP {status}"]
    found = []
    options = document.get("Options") or {}
    if not document.get("Internal") or document.get("EnableIPv6") or document.get("Driver") != "bridge":
        found.append(f"network {network}: not an internal IPv4 bridge")
    if options.get(INHIBIT_IPV4) != "true" or options.get(BRIDGE_OPTION) != bridge_name(network):
        found.append(f"network {network}: the host may have an address on it")
    attached = set(document.get("Containers") or {})
    if attached - members:
        found.append(f"network {network}: containers not the sandbox's are on it")
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=bridge_name(network))
        if index and ipr.get_addr(index=index[0], family=2):
            found.append(f"network {network}: the host has an IPv4 address on it")
    try:
        with open(f"/proc/sys/net/ipv6/conf/{bridge_name(network)}/disable_ipv6") as setting:
            if setting.read().strip() != "1":
                found.append(f"network {network}: the host has IPv6 on it")
    except FileNotFoundError:
        pass
    return found
