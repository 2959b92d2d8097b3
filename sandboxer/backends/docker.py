"""The Docker backend: the same plan as a container, checked through the Engine API after start.

The Docker SDK is an optional extra (`pip install 'sandboxer[docker]'`); without it, Docker
profiles fail with that hint. Images are inspected locally and never pulled.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

from sandboxer.backends.docker_render import LABEL, PROBE_END, STATE_LABEL, create_body, verify
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
            os.chmod(path, mount.mode or 0o644)


def require_sdk() -> None:
    """Docker profiles need the `docker` extra (gc lists containers through it); a clear hint if absent."""
    import importlib.util

    if importlib.util.find_spec("docker") is None:
        raise BackendError("the Docker backend needs the Docker SDK", hint="pip install 'sandboxer[docker]'")


def _engine(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One Engine API call over the fixed socket: (status, decoded JSON body or None)."""
    from sandboxer import dockerexec

    try:
        status, content = dockerexec.engine_request(method, path, body)
    except (OSError, dockerexec.EngineError) as exc:
        raise BackendError(f"cannot reach the Docker daemon ({exc})", hint="start dockerd") from None
    try:
        return status, json.loads(content) if content.strip() else None
    except ValueError:
        return status, None


def _message(document: Any) -> str:
    text = document.get("message") if isinstance(document, dict) else None
    return str(text or "no explanation")[:300]


def start(plan: Plan, *, image: str, etc_dir: str, state_dir: str) -> tuple[str, bytes]:
    """Create and start the container; returns its id and what its probe printed. Raises
    BackendError on any Engine error, and then leaves no container behind.

    The create hot path speaks the Engine API itself: importing the SDK costs ~70 ms here,
    more than creating the container does.
    """
    require_sdk()
    status, document = _engine("GET", f"/images/{quote(image, safe='/:@')}/json")
    if status == 404:
        raise BackendError(f"image {image}: not present locally (images are never pulled)")
    if status != 200:
        raise BackendError(f"image {image}: the Engine answered HTTP {status} ({_message(document)})")
    write_etc(plan, etc_dir)
    body = create_body(plan, image=image, etc_dir=etc_dir, state_dir=state_dir)
    status, document = _engine("POST", "/containers/create", body)
    if status != 201 or not isinstance(document, dict) or not isinstance(document.get("Id"), str):
        raise BackendError(f"docker: the container could not be created ({_message(document)})")
    container_id = str(document["Id"])
    from sandboxer import dockerexec

    try:
        attached = dockerexec.attach(container_id)
        status, document = _engine("POST", f"/containers/{container_id}/start")
        if status not in (204, 304):
            attached[0].close()
            raise BackendError(f"docker: the container could not be started ({_message(document)})")
        probe = dockerexec.read_until(attached, PROBE_END, timeout=30)
    except (OSError, dockerexec.EngineError) as exc:
        remove(container_id)
        raise BackendError(f"docker: the container's probe failed ({exc})") from None
    except BaseException:
        remove(container_id)
        raise
    return container_id, probe


def deliver(container_id: str, plan: Plan, data: bytes, target: str) -> None:
    """Write `data` to `target` inside the container as the sandbox user (mode 0600, a new file),
    through the stdin of an exec: never its command line, environment or the host's disk."""
    from sandboxer import dockerexec

    source = os.memfd_create("sandboxer-delivery", os.MFD_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.write(source, data)
        os.lseek(source, 0, os.SEEK_SET)
        exec_id = dockerexec.create_exec(
            container_id,
            ["/bin/sh", "-c", 'umask 077 && set -C && exec cat > "$0"', target],
            env=dict(plan.env),
            user=f"{plan.uid}:{plan.gid}",
            cwd="/",
        )
        finished = dockerexec.run(exec_id, stdin=source, stdout=devnull, stderr=devnull, timeout=30)
        status = dockerexec.exit_code(exec_id) if finished else 124
    except (OSError, dockerexec.EngineError) as exc:
        raise BackendError(f"delivery of {target}: the Engine failed ({exc})") from None
    finally:
        os.close(source)
        os.close(devnull)
    if status != 0:
        raise BackendError(f"delivery of {target} failed inside the container")


def inspect(container_id: str) -> dict[str, Any]:
    """The Engine's inspect document of the container."""
    status, document = _engine("GET", f"/containers/{container_id}/json")
    if status == 404:
        raise BackendError(f"container {container_id[:12]}: gone")
    if status != 200 or not isinstance(document, dict):
        raise BackendError(f"container {container_id[:12]}: the Engine answered HTTP {status}")
    return document


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
