"""What every command of the CLI shares: the --json option, and what the root's global options
resolved (the broker's directories, --debug) before the command runs."""

from __future__ import annotations

from typing import Annotated

import typer

from sandboxer.dirs import Dirs

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]

_DEBUG = "sandboxer.debug"


def remember(ctx: typer.Context, dirs: Dirs, *, debug: bool) -> None:
    """Keep the root's resolved options for the command (its context shares the root's meta)."""
    ctx.obj = dirs
    ctx.meta[_DEBUG] = debug


def dirs_of(ctx: typer.Context) -> Dirs:
    """The config and state directories the global options (or their defaults) name."""
    dirs: Dirs = ctx.find_root().obj
    return dirs


def debug_of(ctx: typer.Context) -> bool:
    """Whether --debug was given: show the traceback of an internal error."""
    return bool(ctx.meta.get(_DEBUG, False))
