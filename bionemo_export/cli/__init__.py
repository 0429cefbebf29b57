"""The `bionemo-export` command line (cli/main.py assembles it)."""

from __future__ import annotations

from pathlib import Path

import typer


def debugging(ctx: typer.Context) -> bool:
    """Whether the root option --debug asks for tracebacks: a command that reports an error in its
    own words re-raises it instead, and cli/main.py lets it through."""
    return bool(ctx.find_root().params.get("debug"))


NO_CHECK_HELP = ("Skip comparing the repository's files with the sha256 digests its manifest.json records "
                 "(a changed file is otherwise refused, exit code 2).")


def check_files(location: object, skip: bool = False) -> None:
    """Before serving, verifying or uploading `location`: compare its files with the digests its
    manifest.json records (model_repository/integrity.py) and print one line saying what was
    checked or why nothing was. A changed, missing or added file ends the command with `error: ...`
    naming each on stderr and exit code 2. An s3:// location is not checked here: that would mean
    downloading every file (`repo push` checks the local folder before uploading it)."""
    from bionemo_export.model_repository.integrity import IntegrityError, require_intact  # protobuf: not at import

    if skip:
        typer.echo(f"note: --no-check: the files of {location} are not compared with its manifest.json")
        return
    if not isinstance(location, Path):
        typer.echo(f"note: {location}: files in object storage are not checked against manifest.json "
                   "(that would download them all); `repo push` checks a repository before uploading it")
        return
    try:
        typer.echo(require_intact(location))
    except IntegrityError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
