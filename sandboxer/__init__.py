"""sandboxer: a sandbox broker for Linux.

    from sandboxer import Broker

    with Broker().create("bwrap-local") as sb:
        print(sb.exec(["python3", "-c", "print(1)"]).stdout)

The API (docs/api.md) is imported on first use: the CLI imports this package on every command,
and its start-up must not pay for it — not even for `typing`. Type checkers read the names from
__init__.pyi, the lazy package's usual companion (Scientific Python's SPEC 1), which
tests/unit/test_package_names.py holds to what __getattr__ below answers.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "Approval",
    "Broker",
    "Client",
    "ClientOwner",
    "ClientSandbox",
    "Created",
    "Dispatched",
    "Evidence",
    "ExecResult",
    "ExecStream",
    "Exported",
    "GcReport",
    "KeptExport",
    "MountEvidence",
    "Owner",
    "OwnerCheck",
    "OwnerEntry",
    "Receipt",
    "RuntimeDigest",
    "RuntimePin",
    "Sandbox",
    "SandboxInfo",
]
_API = {"Broker", "ExecStream", "Owner", "Sandbox"}
_CLIENT = {"Client", "ClientOwner", "ClientSandbox"}


def __getattr__(name: str) -> object:
    if name in _API:
        from sandboxer.api import broker as api

        return getattr(api, name)
    if name in _CLIENT:
        from sandboxer.clients import service as client

        return getattr(client, name)
    if name in __all__:
        from sandboxer.api import results

        return getattr(results, name)
    raise AttributeError(f"module 'sandboxer' has no attribute {name!r}")
