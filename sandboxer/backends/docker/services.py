"""Service containers of a Docker sandbox (docs/services.md): the sidecars a lease manifest's
`service_images` names beside the sandbox's own container, on a network of the sandbox's own,
and the port proxies that publish its ports from `port_proxy_image`.

- Every image is one the Engine already has: inspected by its immutable reference, never pulled
  or built; one that is missing refuses the create before any container of it starts.
- The network is an internal bridge (no route out of it) made for this sandbox alone: the host
  has no IPv4 address on it (`inhibit_ipv4`) and no IPv6 either, so nothing on it reaches the
  host; its members are the sandbox's own container (as `app`) and its sidecars (by their
  service names). The sandbox's container learns their addresses from its generated /etc/hosts.
- Each sidecar and proxy is held to the sandbox container's hardening (render.Hardening): read-only
  root, every capability dropped, no-new-privileges, the project's seccomp profile, the sandbox's
  memory and pids limits, the sandbox's user (or, where the owner allows it, the image's own),
  tmpfs at /tmp and /run; the image's own entrypoint. The Engine's view of each is checked after
  start, as for the sandbox's container.
- A port proxy shares the sandbox container's network namespace and relays a Unix socket in a
  host directory of the sandbox's (its only mount) to 127.0.0.1:PORT there; the service's
  listener on the host's 127.0.0.1 connects to that socket (host/inside_sockets.py).

Everything here carries PART_LABEL (the sandbox id), STATE_LABEL and ROLE_LABEL, so teardown and
gc find it by label whatever a record says (a broker killed mid-create leaves nothing unnamed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from hashlib import sha256
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sandboxer.backends.docker import engine
from sandboxer.backends.docker.container import engine_call
from sandboxer.backends.docker.render import STATE_LABEL, Hardening, nano_cpus, security_options
from sandboxer.core.plan import MountKind, Plan
from sandboxer.core.record import SandboxRecord, ServiceRecord, ServicesRecord
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError

if TYPE_CHECKING:
    from collections.abc import Callable


PART_LABEL = "io.sandboxer.part-of"  # the sandbox a service container or network belongs to
ROLE_LABEL = "io.sandboxer.role"  # service, port-proxy or network
SERVICE_LABEL = "io.sandboxer.service"  # a sidecar's service name, a proxy's port inside
PROXY_SOCKETS = "/run/sandboxer/publish"  # in a port proxy: its Unix socket's directory
SERVICE_TMP_MIB = 64  # each of a service container's tmpfs mounts (/tmp, /run)
PROXY_READY_SECONDS = 10.0
INHIBIT_IPV4 = "com.docker.network.bridge.inhibit_ipv4"
BRIDGE_OPTION = "com.docker.network.bridge.name"


def bridge_name(network: str) -> str:
    """The host's bridge interface of `network` (at most 15 characters, IFNAMSIZ)."""
    return "sbx" + sha256(network.encode()).hexdigest()[:12]


def labels(sandbox_id: str, state_dir: str, role: str, service: str | None = None) -> dict[str, str]:
    found = {PART_LABEL: sandbox_id, STATE_LABEL: state_dir, ROLE_LABEL: role}
    if service is not None:
        found[SERVICE_LABEL] = service
    return found


@dataclass(frozen=True, slots=True)
class Image:
    """An image as the Engine has it: its id and its own user."""

    id: str
    user: str


def check_images(services: ServicesRecord, *, file: str) -> dict[str, Image]:
    """Each sidecar's and the port proxy's image, by reference, as the Engine has it; BackendError
    naming the manifest's field when one is not there (images are never pulled or built)."""
    wanted = [(f"service_images.{s.name}", s.image) for s in services.sidecars]
    if services.proxy_image is not None:
        wanted.append(("port_proxy_image", services.proxy_image))
    found: dict[str, Image] = {}
    for field, reference in wanted:
        status, document = engine_call("GET", f"/images/{quote(reference, safe='/:@')}/json")
        if status == 404:
            raise BackendError(
                f"{file}: {field}: image {reference} is not present in the Docker Engine (images are never pulled)",
                hint="docker load it, or scripts/build-service-images",
            )
        if status != 200 or not isinstance(document, dict):
            raise BackendError(f"{file}: {field}: the Engine answered HTTP {status} for image {reference}")
        found[reference] = Image(id=str(document.get("Id")), user=str((document.get("Config") or {}).get("User") or ""))
    return found


def create_network(services: ServicesRecord, *, sandbox_id: str, state_dir: str) -> None:
    """The sandbox's internal network, with no address of the host's on it."""
    network = str(services.network)
    body = {
        "Name": network,
        "CheckDuplicate": True,
        "Driver": "bridge",
        "Internal": True,
        "EnableIPv6": False,
        "Attachable": False,
        "Options": {
            INHIBIT_IPV4: "true",
            BRIDGE_OPTION: bridge_name(network),
            "com.docker.network.bridge.enable_icc": "true",
        },
        "Labels": labels(sandbox_id, state_dir, "network"),
    }
    status, document = engine_call("POST", "/networks/create", body)
    if status != 201:
        message = document.get("message") if isinstance(document, dict) else None
        raise BackendError(f"docker: the sandbox's network could not be made ({message or f'HTTP {status}'})")
    # The bridge's own IPv6 link-local address would be the host's on the network.
    try:
        with open(f"/proc/sys/net/ipv6/conf/{bridge_name(network)}/disable_ipv6", "w") as setting:
            setting.write("1")
    except FileNotFoundError:  # a kernel without IPv6: nothing to take away
        pass


def hardening(plan: Plan, *, user: str, network: str) -> Hardening:
    return Hardening(
        user=user,
        network=network,
        pids=plan.limits.pids,
        memory_mib=plan.limits.memory_mib,
        nano_cpus=nano_cpus(plan.limits.cpus),
        allow_ptrace=False,
    )


def tmpfs() -> dict[str, str]:
    size = SERVICE_TMP_MIB * 1024 * 1024
    targets = ("/tmp", "/run")  # noqa: S108 - the container's own, each a tmpfs
    return {target: f"rw,nosuid,nodev,size={size},mode=1777" for target in targets}


def _body(planned: Hardening, *, image: str, labelled: dict[str, str]) -> dict[str, Any]:
    """A service container's `POST /containers/create` body: the hardening every container of the
    sandbox has, and the image's own entrypoint."""
    memory = planned.memory_mib * 1024 * 1024
    return {
        "Image": image,
        "User": planned.user,
        "Labels": labelled,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "OpenStdin": False,
        "Tty": False,
        "HostConfig": {
            "NetworkMode": planned.network,
            "ReadonlyRootfs": True,
            "CapDrop": ["ALL"],
            "SecurityOpt": security_options(allow_ptrace=planned.allow_ptrace),
            "Privileged": False,
            "PidsLimit": planned.pids,
            "Memory": memory,
            "MemorySwap": memory,
            "NanoCpus": planned.nano_cpus,
            "Tmpfs": tmpfs(),
            "IpcMode": "private",
            "CgroupnsMode": "private",
            "Mounts": [],
        },
    }


def _run(body: dict[str, Any], what: str) -> str:
    """Create and start one service container; its id. On failure it is removed (the caller's
    teardown finds the others by label)."""
    status, document = engine_call("POST", "/containers/create", body)
    if status != 201 or not isinstance(document, dict) or not isinstance(document.get("Id"), str):
        message = document.get("message") if isinstance(document, dict) else None
        raise BackendError(f"docker: {what} could not be created ({str(message or f'HTTP {status}')[:300]})")
    container_id = str(document["Id"])
    status, document = engine_call("POST", f"/containers/{container_id}/start")
    if status not in (204, 304):
        engine.remove_container(container_id)
        message = document.get("message") if isinstance(document, dict) else None
        raise BackendError(f"docker: {what} could not be started ({str(message or f'HTTP {status}')[:300]})")
    return container_id


def user_of(services: ServicesRecord, plan: Plan, image: Image) -> str:
    return image.user if services.image_user else f"{plan.uid}:{plan.gid}"


def start_sidecars_of(record: SandboxRecord, services: ServicesRecord, plan: Plan, *, state_dir: str) -> ServicesRecord:
    """Every image the services name checked (none is pulled), then their network and sidecars."""
    file = record.manifest.file if record.manifest else "the lease manifest"
    images = check_images(services, file=file)
    if services.network is None:
        return services
    create_network(services, sandbox_id=record.id, state_dir=state_dir)
    return start_sidecars(services, plan, images=images, sandbox_id=record.id, state_dir=state_dir)


def start_proxies_of(
    record: SandboxRecord, services: ServicesRecord, plan: Plan, *, socket_dir: str, state_dir: str
) -> ServicesRecord:
    """The port proxies of a sandbox with services that publishes ports."""
    ports = record.manifest.published if record.manifest else ()
    if services.proxy_image is None or not ports:
        return services
    return start_proxies(
        services,
        plan,
        app_id=str(record.container_id),
        ports=ports,
        socket_dir=socket_dir,
        sandbox_id=record.id,
        state_dir=state_dir,
    )


def start_sidecars(
    services: ServicesRecord, plan: Plan, *, images: dict[str, Image], sandbox_id: str, state_dir: str
) -> ServicesRecord:
    """Start each sidecar on the sandbox's network under its service name; the record with their
    ids and addresses."""
    network = str(services.network)
    started: list[ServiceRecord] = []
    for sidecar in services.sidecars:
        planned = hardening(plan, user=user_of(services, plan, images[sidecar.image]), network=network)
        body = _body(planned, image=sidecar.image, labelled=labels(sandbox_id, state_dir, "service", sidecar.name))
        body["Hostname"] = sidecar.name
        body["NetworkingConfig"] = {"EndpointsConfig": {network: {"Aliases": [sidecar.name]}}}
        container_id = _run(body, f"service {sidecar.name}")
        attrs = inspect(container_id)
        address = ((attrs.get("NetworkSettings") or {}).get("Networks") or {}).get(network, {}).get("IPAddress")
        if not address:
            raise BackendError(f"docker: service {sidecar.name} has no address on the sandbox's network")
        started.append(replace(sidecar, container_id=container_id, address=str(address)))
    return replace(services, sidecars=tuple(started))


def hosts_lines(services: ServicesRecord) -> str:
    """/etc/hosts lines naming each sidecar for the sandbox's container."""
    return "".join(f"{s.address}\t{s.name}\n" for s in services.sidecars if s.address)


def start_proxies(
    services: ServicesRecord,
    plan: Plan,
    *,
    app_id: str,
    ports: tuple[tuple[int, int], ...],
    socket_dir: str,
    sandbox_id: str,
    state_dir: str,
) -> ServicesRecord:
    """One port proxy per published port, from exactly `proxy_image` (never pulled), in the
    sandbox container's network namespace, listening on `socket_dir`/PORT.sock; the record with
    their ids once every socket is there."""
    image = str(services.proxy_image)
    os.makedirs(socket_dir, mode=0o700)
    os.chown(socket_dir, plan.host_uid, plan.host_gid)
    proxies: list[tuple[int, str]] = []
    for _, runtime in ports:
        planned = hardening(plan, user=f"{plan.uid}:{plan.gid}", network=f"container:{app_id}")
        body = _body(planned, image=image, labelled=labels(sandbox_id, state_dir, "port-proxy", str(runtime)))
        body["Cmd"] = [f"UNIX-LISTEN:{PROXY_SOCKETS}/{runtime}.sock,fork", f"TCP:127.0.0.1:{runtime}"]
        body["HostConfig"]["Mounts"] = [{"Type": "bind", "Source": socket_dir, "Target": PROXY_SOCKETS}]
        proxies.append((runtime, _run(body, f"the port proxy of port {runtime}")))
    deadline = time.monotonic() + PROXY_READY_SECONDS
    while not all(os.path.exists(os.path.join(socket_dir, f"{runtime}.sock")) for runtime, _ in proxies):
        if time.monotonic() > deadline:
            raise BackendError("docker: a port proxy did not listen within 10 s (is port_proxy_image a socat?)")
        time.sleep(0.02)
    return replace(services, proxies=tuple(proxies), proxy_sockets=socket_dir)


def inspect(container_id: str) -> dict[str, Any]:
    status, document = engine_call("GET", f"/containers/{container_id}/json")
    if status != 200 or not isinstance(document, dict):
        raise BackendError(f"docker: service container {container_id[:12]}: the Engine answered HTTP {status}")
    return document


def with_hosts(plan: Plan, services: ServicesRecord) -> Plan:
    """The plan whose generated /etc/hosts also names each sidecar."""
    extra = hosts_lines(services).encode()
    mounts = tuple(
        replace(m, content=(m.content or b"") + extra) if m.kind is MountKind.FILE and m.target == "/etc/hosts" else m
        for m in plan.mounts
    )
    return replace(plan, mounts=mounts)


def remove(sandbox_id: str, state_dir: str) -> Removal:
    """Every service container, port proxy and network labelled as this sandbox's, with their
    anonymous volumes; each is named in the removal."""
    return remove_containers(sandbox_id, state_dir) + remove_networks(sandbox_id, state_dir)


def remove_containers(sandbox_id: str, state_dir: str) -> Removal:
    """The sandbox's service containers and port proxies (remove)."""
    removal = Removal()
    try:
        listed = engine.containers(f"{PART_LABEL}={sandbox_id}")
    except (OSError, ValueError, engine.EngineError) as exc:
        return Removal(residue=(f"service containers: the Engine cannot list them ({exc})",))
    for item in listed:
        found = item.get("Labels")
        if not isinstance(found, dict) or found.get(STATE_LABEL) != state_dir:
            continue
        container_id = str(item["Id"])
        what = f"{found.get(ROLE_LABEL)} {found.get(SERVICE_LABEL)} container {container_id[:12]}"
        mounts = item.get("Mounts")
        volumes = [
            str(m.get("Name"))
            for m in (mounts if isinstance(mounts, list) else [])
            if isinstance(m, dict) and m.get("Type") == "volume"
        ]
        problem = engine.remove_container(container_id)
        if problem is None or problem == "gone":
            removal += Removal(removed=(what, *(f"volume {name[:12]}" for name in volumes)))
        else:
            removal += Removal(residue=(f"{what}: {problem}",))
    return removal


def remove_networks(sandbox_id: str, state_dir: str) -> Removal:
    """The sandbox's network, once no container is on it (remove)."""
    removal = Removal()
    try:
        networks = _networks(f"{PART_LABEL}={sandbox_id}", state_dir)
    except BackendError as exc:
        return removal + Removal(residue=(f"network: {exc.message}",))
    for network_id, name, _ in networks:
        removal += _remove_network(network_id, name)
    return removal


def _networks(label: str, state_dir: str) -> list[tuple[str, str, str]]:
    """(id, name, sandbox id) of each network carrying `label` and made for `state_dir`."""
    filters = quote(json.dumps({"label": [label, f"{STATE_LABEL}={state_dir}"]}), safe="")
    status, document = engine_call("GET", f"/networks?filters={filters}")
    if status != 200 or not isinstance(document, list):
        raise BackendError(f"docker: the Engine's network list answered HTTP {status}")
    return [
        (str(n.get("Id")), str(n.get("Name")), str((n.get("Labels") or {}).get(PART_LABEL)))
        for n in document
        if isinstance(n, dict)
    ]


def _remove_network(network_id: str, name: str) -> Removal:
    status, document = engine_call("DELETE", f"/networks/{network_id}")
    if status in (204, 404):
        return Removal(removed=(f"network {name}",)) if status == 204 else Removal()
    message = document.get("message") if isinstance(document, dict) else f"HTTP {status}"
    return Removal(residue=(f"network {name}: {message}",))


def orphans(state_dir: str, present: Callable[[], set[str]]) -> dict[str, Removal]:
    """gc: the service containers, proxies and networks of this state dir whose sandbox directory
    is gone, removed; by sandbox id."""
    try:
        listed = engine.containers(f"{STATE_LABEL}={state_dir}")
        networks = _networks(PART_LABEL, state_dir)
    except (OSError, ValueError, engine.EngineError, BackendError):
        return {}  # the Engine stopped answering: nothing collected this time
    owners = {part for item in listed if (part := _part(item))}
    owners |= {sandbox_id for _, _, sandbox_id in networks}
    there = present()
    return {sandbox_id: remove(sandbox_id, state_dir) for sandbox_id in sorted(owners - there)}


def _part(item: dict[str, Any]) -> str | None:
    """The sandbox a listed container is part of (PART_LABEL), if any."""
    found = item.get("Labels")
    return str(found[PART_LABEL]) if isinstance(found, dict) and found.get(PART_LABEL) else None
