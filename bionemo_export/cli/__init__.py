"""The `bionemo-export` command line (cli/main.py assembles it).

Options take their defaults from the library's dataclasses (`ServingOptions.max_batch_size`) and
their choices from its enums (bionemo_export/choices.py), so neither is repeated here. The library's
errors name settings by field, in backticks (errors.py); `reason` words them as this command line's
flags, from the options the commands declare (`option_flags`): the one place that knows both.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import typer

_ASSEMBLED: list[typer.Typer] = []
"""The whole command line, once cli/main.py has assembled it (`assembled`): recorded here rather
than imported, since main imports every command module and they import this package."""


def assembled(app: typer.Typer) -> typer.Typer:
    """Record `app` as the whole command line whose options `option_flags` reads; returns it."""
    _ASSEMBLED[:] = [app]
    _flags_of.cache_clear()
    return app


def option_flags() -> dict[str, str]:
    """Each option's parameter name -> its long flag, over every command (`max_batch_size` ->
    `--max-batch-size`, `family` -> `--model`). A command's parameter is named as the library field
    it sets, so that a library error naming the field names the flag here (tests check that no name
    means two flags). Empty until cli/main.py has assembled the commands: the fields then keep
    their names."""
    return _flags_of(_ASSEMBLED[0]) if _ASSEMBLED else {}


@cache
def _flags_of(app: typer.Typer) -> dict[str, str]:
    from typer.main import get_command

    flags: dict[str, str] = {}

    def visit(command: object) -> None:
        for param in getattr(command, "params", ()):
            long = [opt for opt in param.opts if opt.startswith("--")]
            if param.name and long:
                flags.setdefault(param.name, long[0])
        for sub in getattr(command, "commands", {}).values():
            visit(sub)

    visit(get_command(app))
    return flags


def flag(field: str) -> str | None:
    """The command line's flag for the library field `field`, or None when no option sets it."""
    return option_flags().get(field)


def reason(err: BaseException) -> str:
    """`err` as a clause for the user (errors.reason), the settings it names worded as flags."""
    from bionemo_export.errors import reason as worded_reason

    return worded_reason(err, flag)


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
