"""Sample owner files shared by the tests."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def profile_yaml(name: str = "dev", repository: str = "/srv/repos/demo", extra: str = "") -> str:
    """A valid bwrap profile (ten lines before `extra`, which tests counting lines rely on)."""
    return (
        f"profile: {name}\nextension: ext.bwrap\nworkspace:\n  repository: {repository}\n  ref: main\n"
        f"network:\n  default: deny\n  egress: []\nsetup:\n  secrets: []\n{extra}"
    )


# The names of the environment the contract builds from nothing, sorted (no consumer given).
CONTRACT_ENV_NAMES = [
    "HOME",
    "LANG",
    "LOGNAME",
    "PATH",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE",
    "SANDBOXER_NETWORK",
    "SANDBOXER_PROFILE",
    "SANDBOXER_SANDBOX_ID",
    "TMPDIR",
    "USER",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_STATE_HOME",
]


def tiny_wheel(directory: Path) -> Path:
    """A wheel of one module (`tinywheel`, VALUE = 42), made here with zipfile: no build backend,
    no index."""
    name, version = "tinywheel", "1.0"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": b"VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandboxer-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel
