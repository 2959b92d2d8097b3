# The names sandboxer/__init__.py imports on first use, for type checkers (see its docstring).
from sandboxer.api.broker import Broker as Broker
from sandboxer.api.exec_stream import ExecStream as ExecStream
from sandboxer.api.owner import Owner as Owner
from sandboxer.api.results import Approval as Approval
from sandboxer.api.results import Created as Created
from sandboxer.api.results import Dispatched as Dispatched
from sandboxer.api.results import Evidence as Evidence
from sandboxer.api.results import ExecResult as ExecResult
from sandboxer.api.results import Exported as Exported
from sandboxer.api.results import GcReport as GcReport
from sandboxer.api.results import KeptExport as KeptExport
from sandboxer.api.results import MountEvidence as MountEvidence
from sandboxer.api.results import OwnerCheck as OwnerCheck
from sandboxer.api.results import OwnerEntry as OwnerEntry
from sandboxer.api.results import Receipt as Receipt
from sandboxer.api.results import RuntimeDigest as RuntimeDigest
from sandboxer.api.results import RuntimePin as RuntimePin
from sandboxer.api.results import SandboxInfo as SandboxInfo
from sandboxer.api.sandbox import Sandbox as Sandbox
from sandboxer.clients.service import Client as Client
from sandboxer.clients.service import ClientOwner as ClientOwner
from sandboxer.clients.service import ClientSandbox as ClientSandbox

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
    "OwnerCheck",
    "OwnerEntry",
    "Receipt",
    "RuntimeDigest",
    "RuntimePin",
    "Sandbox",
    "SandboxInfo",
]
