# The names sandboxer/__init__.py imports on first use, for type checkers (see its docstring).
from sandboxer.api import Broker as Broker
from sandboxer.api import Owner as Owner
from sandboxer.api import Sandbox as Sandbox
from sandboxer.client import Client as Client
from sandboxer.client import ClientOwner as ClientOwner
from sandboxer.client import ClientSandbox as ClientSandbox
from sandboxer.exec_threads import ExecStream as ExecStream
from sandboxer.results import Approval as Approval
from sandboxer.results import Created as Created
from sandboxer.results import Dispatched as Dispatched
from sandboxer.results import Evidence as Evidence
from sandboxer.results import ExecResult as ExecResult
from sandboxer.results import Exported as Exported
from sandboxer.results import GcReport as GcReport
from sandboxer.results import KeptExport as KeptExport
from sandboxer.results import MountEvidence as MountEvidence
from sandboxer.results import OwnerEntry as OwnerEntry
from sandboxer.results import Receipt as Receipt
from sandboxer.results import RuntimeDigest as RuntimeDigest
from sandboxer.results import SandboxInfo as SandboxInfo

__version__: str
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
    "OwnerEntry",
    "Receipt",
    "RuntimeDigest",
    "Sandbox",
    "SandboxInfo",
]
