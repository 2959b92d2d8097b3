"""What an orchestrator watches of its sandboxes: `usage ID`, `work ID`, `extend ID SECONDS`,
and the readable text of `list` and `inspect` (each also prints its JSON document with --json;
docs/reference.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import typer

from sandboxer.api.results import Evidence, SandboxInfo, SandboxList
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.cli.options import IdArgument, JsonOption, broker_of, named
from sandboxer.output import flatten, print_result, table

app = typer.Typer()


@app.command("list")
def list_(
    ctx: typer.Context,
    work: Annotated[
        bool, typer.Option("--work/--no-work", help="Ask each running sandbox's git for its work (a command in each).")
    ] = True,
    json: JsonOption = False,
) -> None:
    """List the sandboxes you may see: whose each is, its age, its time left and its work."""
    entries = broker_of(ctx).list(work=work)
    print_result(SandboxList(sandboxes=tuple(entries)).to_json(), list_text(entries), json)


@app.command("inspect")
def inspect(ctx: typer.Context, sandbox_id: IdArgument, json: JsonOption = False) -> None:
    """Evidence observed from a live sandbox, and what it uses now."""
    evidence = broker_of(ctx).sandbox(named(sandbox_id)).inspect()
    print_result(evidence.to_json(), inspect_text(evidence), json)


@app.command("usage")
def usage(ctx: typer.Context, sandbox_id: IdArgument, json: JsonOption = False) -> None:
    """What a running sandbox uses now: memory, processes, CPU time, disk."""
    result = broker_of(ctx).sandbox(named(sandbox_id)).usage()
    print_result(result.to_json(), "\n".join(usage_lines(result)), json)


@app.command("work")
def work(ctx: typer.Context, sandbox_id: IdArgument, json: JsonOption = False) -> None:
    """A running sandbox's work as its git reports it, and what of it no export took out."""
    result = broker_of(ctx).sandbox(named(sandbox_id)).work_state()
    print_result(result.to_json(), "\n".join(work_lines(result)), json)


@app.command("extend")
def extend(
    ctx: typer.Context,
    sandbox_id: IdArgument,
    seconds: Annotated[int, typer.Argument(metavar="SECONDS", help="Its lifetime ends this many seconds from now.")],
    json: JsonOption = False,
) -> None:
    """Move the end of a sandbox's lifetime (create --ttl) to SECONDS from now, within the
    profile's lifetime.max_seconds (3 past it). It never ends earlier than it did."""
    result = broker_of(ctx).sandbox(named(sandbox_id)).extend(seconds)
    print_result(result.to_json(), lifetime_text(result), json)


# ------------------------------------------------------------------------------------ the text


def list_text(entries: Sequence[SandboxInfo]) -> str:
    if not entries:
        return "no sandboxes"
    rows = [("ID", "PROFILE", "BACKEND", "STATUS", "CALLER", "AGE", "LEFT", "WORK")]
    rows += [
        (
            e.id,
            e.profile or "-",
            e.backend or "-",
            e.status,
            e.caller or ("-" if e.caller_uid is None else f"uid {e.caller_uid}"),
            duration(e.age_seconds),
            duration(e.seconds_left),
            work_cell(e.work),
        )
        for e in entries
    ]
    return table(rows)


def work_cell(summary: WorkSummary | None) -> str:
    """A list's view of a sandbox's work: "+N commits", "dirty", "exported" or "clean"."""
    if summary is None:
        return "-"
    parts = []
    if summary.commits is None:
        parts.append("base left HEAD")
    elif summary.commits:
        parts.append(f"+{summary.commits} commit{'s' if summary.commits != 1 else ''}")
    if summary.dirty:
        parts.append("dirty")
    if summary.exported:
        parts.append("exported")
    return ", ".join(parts) or "clean"


def usage_lines(result: Usage) -> list[str]:
    peak = "" if result.memory_peak_bytes is None else f", {size(result.memory_peak_bytes)} at most"
    quota = "no quota" if result.cpus is None else f"quota {result.cpus:g} cores"
    floor = "" if result.workspace_complete or result.workspace_bytes is None else " (at least: the walk stopped)"
    cpu = "-" if result.cpu_seconds is None else f"{result.cpu_seconds:.2f} s"
    return [
        f"memory: {size(result.memory_bytes)} now{peak}, of {size(result.memory_limit_bytes)}",
        f"processes: {_plain(result.pids)} of {result.pids_limit}",
        f"cpu time: {cpu} ({quota})",
        f"workspace: {size(result.workspace_bytes)}{floor}",
        f"state: {size(result.state_bytes)}",
        f"tmp: {size(result.tmp_bytes)}",
        f"counted from: {'its cgroups' if result.source == 'cgroup' else 'its processes now (no cgroup)'}",
    ]


def work_lines(result: WorkSummary) -> list[str]:
    on = f" on {result.branch}" if result.branch else " (detached)"
    lines = [f"HEAD {result.head[:12]}{on}: {work_cell(result)}"]
    lines += [f"not exported: {item}" for item in result.unexported]
    return lines


def lifetime_text(result: Lifetime) -> str:
    bound = "no bound" if result.max_expires_at is None else f"at most until {result.max_expires_at}"
    return f"{result.id}: ends {result.expires_at} ({duration(result.seconds_left)} left; {bound})"


def inspect_text(evidence: Evidence) -> str:
    """The evidence as readable lines: a verdict first, then usage, then every observed value."""
    verdict = "matches its plan" if evidence.matches_plan else "DIFFERS from its plan"
    lines = [f"{evidence.id}: profile {evidence.profile}, {evidence.backend}, {evidence.status}; {verdict}"]
    lines += [f"  difference: {item}" for item in evidence.differences]
    if evidence.usage is not None:
        lines += ["usage:"] + [f"  {line}" for line in usage_lines(evidence.usage)]
    shown = {"id", "profile", "backend", "status", "matches_plan", "differences", "usage"}
    rest: dict[str, Any] = {key: value for key, value in evidence.to_json().items() if key not in shown}
    lines += [f"{key}: {value}" for key, value in flatten(rest)]
    return "\n".join(lines)


def duration(seconds: int | None) -> str:
    """Seconds as the largest two units: 45s, 12m05s, 3h20m, 2d04h; "-" for none."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def size(count: int | None) -> str:
    """Bytes in binary units (1.5 MiB); "-" when not known."""
    if count is None:
        return "-"
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _plain(value: int | None) -> str:
    return "-" if value is None else str(value)
