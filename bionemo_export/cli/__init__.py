"""The `bionemo-export` command line (cli/main.py assembles it)."""

from __future__ import annotations

import typer


def debugging(ctx: typer.Context) -> bool:
    """Whether the root option --debug asks for tracebacks: a command that reports an error in its
    own words re-raises it instead, and cli/main.py lets it through."""
    return bool(ctx.find_root().params.get("debug"))
