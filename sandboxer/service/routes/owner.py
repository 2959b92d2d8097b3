"""The routes of what outlives a sandbox and of the owner: kept exports, gc, the owner files'
approvals and a runtime's digest."""

from __future__ import annotations

from sandboxer.api.results import Approval, GcReport, KeptExportRemoved, KeptExports, OwnerListing, RuntimeDigest
from sandboxer.service.openapi import BINARY, Body, Raw, Route

_NAME = Body(
    fields={"name": {"type": "string", "description": "an owner file's name (ext.NAME, a profile's)"}},
    required=frozenset({"name"}),
)

KEPT_AND_OWNER: tuple[Route, ...] = (
    Route(
        method="GET",
        path="/v1/exports",
        name="exports",
        summary="exports: the work the reaper kept of the caller's expired sandboxes (an owner: every one)",
        answer=KeptExports,
    ),
    Route(
        method="GET",
        path="/v1/exports/{id}/{format}",
        name="exports-get",
        summary="exports get: a kept export's new commits as a Git bundle (bundle) or its changed tree as a tar (tar)",
        answer=Raw(media_type=BINARY, description="the kept file's bytes"),
        errors={
            400: "usage (2): it kept no such file, an unknown format",
            404: "no such kept export (4): another caller's answers the same",
        },
    ),
    Route(
        method="DELETE",
        path="/v1/exports/{id}",
        name="exports-rm",
        summary="exports rm: remove a kept export (its room in the caller's export budget is free at once)",
        answer=KeptExportRemoved,
        errors={404: "no such kept export (4): another caller's answers the same"},
    ),
    Route(
        method="POST",
        path="/v1/gc",
        name="gc",
        summary="gc: finish what crashed creates and teardowns left, and remove the quarantine of every export "
        "whose exporter died",
        answer=GcReport,
    ),
    Route(
        method="GET",
        path="/v1/owner/entries",
        name="ext-list",
        summary="ext list (owners only): every owner file with its approval status",
        answer=OwnerListing,
        errors={403: "not an owner (3)"},
    ),
    Route(
        method="POST",
        path="/v1/owner/approve",
        name="ext-approve",
        summary="ext approve (owners only): approve the exact current bytes of an owner file",
        answer=Approval,
        body=_NAME,
        errors={400: "usage or an invalid file (2)", 403: "not an owner, or a runtime off its pin (3)"},
    ),
    Route(
        method="POST",
        path="/v1/owner/revoke",
        name="ext-revoke",
        summary="ext revoke (owners only): withdraw an approval",
        answer=Approval,
        body=_NAME,
        errors={400: "usage (2)", 403: "not an owner (3)"},
    ),
    Route(
        method="POST",
        path="/v1/runtime/digest",
        name="runtime-digest",
        summary="runtime digest (owners of the service's own account only): the tree digest v1 of a runtime "
        "directory, read with the service's rights",
        answer=RuntimeDigest,
        body=Body(
            fields={
                "path": {"type": "string", "description": "an absolute path"},
                "full": {"type": "boolean", "default": False},
            },
            required=frozenset({"path"}),
        ),
        errors={400: "usage (2)", 403: "not an owner, another account, or a runtime the rules refuse (3)"},
    ),
)
