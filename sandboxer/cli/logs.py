"""`sandboxer logs ID --network`: what a sandbox's egress proxy decided, one line a connection."""

from __future__ import annotations

from typing import Annotated

import typer

from sandboxer.cli.options import IdArgument, JsonOption, broker_of, named
from sandboxer.errors import UsageError
from sandboxer.output import print_result

app = typer.Typer()


@app.command("logs")
def logs(
    ctx: typer.Context,
    sandbox_id: IdArgument,
    network: Annotated[bool, typer.Option("--network", help="The egress proxy's decisions.")] = False,
    last: Annotated[int | None, typer.Option("--last", help="Only the last N entries.", min=0)] = None,
    json: JsonOption = False,
) -> None:
    """A sandbox's logs: --network, each connection through its egress proxy (time, host, port,
    decision and reason, credential route, bytes each way; never a header, body or secret)."""
    if not network:
        raise UsageError("logs: say which log: --network (the egress proxy's decisions)")
    result = broker_of(ctx).sandbox(named(sandbox_id)).network_log(last=last)
    lines = [
        f"{e.time} {e.decision} {e.host}:{e.port} {e.reason}"
        + (f" route={e.route}" if e.route else "")
        + f" sent={e.sent} received={e.received}"
        + (f" (x{e.count})" if e.count > 1 else "")
        for e in result.entries
    ]
    print_result(result.to_json(), "\n".join(lines) if lines else "no connections yet", json)
