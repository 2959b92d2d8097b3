"""The Docker backend: the same plan as a container, checked through the Engine API after start.

The Docker SDK is an optional extra (`pip install 'sandboxer[docker]'`); without it, Docker
profiles fail with that hint. Images are inspected locally and never pulled.
"""

from __future__ import annotations

import os
from typing import Any

from sandboxer.backends.docker_render import LABEL, STATE_LABEL, binds, create_kwargs, verify
from sandboxer.errors import BackendError
from sandboxer.plan import MountKind, Plan


def client() -> Any:
    """A Docker SDK client that has answered a ping."""
    try:
        import docker
    except ImportError:
        raise BackendError("the Docker backend needs the Docker SDK", hint="pip install 'sandboxer[docker]'") from None
    try:
        # The same fixed endpoint as sandboxer.dockerexec: never DOCKER_HOST from the environment.
        engine = docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=60)
        engine.ping()
    except docker.errors.DockerException as exc:
        raise BackendError(f"cannot reach the Docker daemon ({type(exc).__name__})", hint="start dockerd") from None
    return engine


def write_etc(plan: Plan, etc_dir: str) -> None:
    """The generated /etc files, bound read-only into the container."""
    os.makedirs(etc_dir, mode=0o755, exist_ok=True)
    for mount in plan.mounts:
        if mount.kind is MountKind.FILE:
            path = os.path.join(etc_dir, os.path.basename(mount.target))
            with open(path, "wb") as stream:
                stream.write(mount.content or b"")
            os.chmod(path, 0o644)


def start(plan: Plan, *, image: str, etc_dir: str, state_dir: str) -> str:
    """Create and start the container; returns its id. Raises BackendError on any Engine error."""
    import docker
    from docker.types import Mount

    engine = client()
    try:
        engine.images.get(image)
    except docker.errors.ImageNotFound:
        raise BackendError(f"image {image}: not present locally (images are never pulled)") from None
    write_etc(plan, etc_dir)
    mounts = [Mount(b.target, b.source, type="bind", read_only=b.read_only) for b in binds(plan, etc_dir=etc_dir)]
    try:
        settings = create_kwargs(plan, image=image, etc_dir=etc_dir, state_dir=state_dir)
        container = engine.containers.create(mounts=mounts, **settings)
    except docker.errors.DockerException as exc:
        raise BackendError(f"docker: the container could not be created ({_explain(exc)})") from None
    try:
        container.start()
    except docker.errors.DockerException as exc:
        remove(container.id)
        raise BackendError(f"docker: the container could not be started ({_explain(exc)})") from None
    return str(container.id)


def _explain(exc: Exception) -> str:
    text = getattr(exc, "explanation", None) or type(exc).__name__
    return str(text)[:300]


def inspect(container_id: str) -> dict[str, Any]:
    """The Engine's inspect document of the container."""
    import docker

    try:
        attrs: dict[str, Any] = client().api.inspect_container(container_id)
    except docker.errors.NotFound:
        raise BackendError(f"container {container_id[:12]}: gone") from None
    return attrs


def check(container_id: str, plan: Plan, *, etc_dir: str) -> list[str]:
    """Final inspection: every way the running container differs from its plan."""
    attrs = inspect(container_id)
    problems = verify(attrs, plan, etc_dir=etc_dir)
    if not (attrs.get("State") or {}).get("Running"):
        problems.append("the container is not running")
    return problems


def remove(container_id: str) -> list[str]:
    """Remove the container and its anonymous volumes; returns residue."""
    from sandboxer.dockerexec import remove_container

    problem = remove_container(container_id)
    return [] if problem is None or problem == "gone" else [f"container {container_id[:12]}: {problem}"]


def labelled(state_dir: str) -> dict[str, str]:
    """Every container this broker (this state dir) made on the Engine: sandbox id -> container id."""
    try:
        engine = client()
    except BackendError:
        return {}
    found: dict[str, str] = {}
    for container in engine.api.containers(all=True, filters={"label": f"{STATE_LABEL}={state_dir}"}):
        sandbox_id = (container.get("Labels") or {}).get(LABEL)
        if sandbox_id:
            found[str(sandbox_id)] = str(container["Id"])
    return found
