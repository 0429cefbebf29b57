"""The `bionemo-export` command: a Typer app assembled from one module per command group.

Errors end a command with one line on stderr and exit status 1: `error: <message>` for user errors
(errors.UserError: their messages are written for users, the settings they name worded as flags)
and files that cannot be read or written, `error: <type>: <message> (run with --debug for the
traceback)` for anything else. `--debug` (or BIONEMO_EXPORT_DEBUG=1) shows the traceback instead.
A value that is none of an option's choices reads the same way: `error: --target helm: choose one
of all, kserve, plain`.
"""

from __future__ import annotations

import re
import typing
import warnings
from enum import Enum

import typer
from typer.core import TyperGroup

from bionemo_export import __version__
from bionemo_export.errors import user_facing

from . import (
    assembled,
    bench,
    build,
    client,
    deploy,
    dev_server,
    doctor,
    engines,
    health,
    inspect,
    repo,
    serve,
    tune,
    verify,
)
from . import reason as _reason

# torch imports pynvml, which warns on every run that it is deprecated: noise before every
# command's output that the user can do nothing about.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)


def error_line(err: BaseException) -> str:
    """The line that reports `err` to the user (cli.reason: its type too when unexpected)."""
    return f"error: {_reason(err)}" + ("" if user_facing(err) else " (run with --debug for the traceback)")


def refused_choice(err: typer.BadParameter) -> str | None:
    """`--target helm: choose one of all, kserve, plain` when `err` is Typer refusing a value of an
    option typed by an enum (bionemo_export/choices.py), else None."""
    param, ctx = err.param, err.ctx
    callback = getattr(ctx.command, "callback", None) if ctx is not None else None
    if param is None or not param.name or callback is None:
        return None
    try:
        hint = typing.get_type_hints(callback).get(param.name)  # Choice, or Choice | None
    except (NameError, TypeError):  # an annotation only a type checker resolves: not a choice of ours
        return None
    choices = next((t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and issubclass(t, Enum)), None)
    if choices is None:
        return None
    option = next((opt for opt in param.opts if opt.startswith("--")), param.name)
    # Typer words the refusal "'helm' is not one of 'all', ...": the value the user gave.
    given = re.search(r"'([^']*)' is not one of", err.message)
    return f"{option}{f' {given.group(1)}' if given else ''}: choose one of {', '.join(c.value for c in choices)}"


class _ReportingGroup(TyperGroup):
    """The root command: an error escaping a command becomes `error_line(...)` and exit status 1,
    unless --debug asks for the traceback; so does a value none of an option's choices
    (`refused_choice`). Typer's other exceptions (usage errors, exits) pass."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except typer.BadParameter as err:
            line = refused_choice(err)
            if line is None or ctx.params.get("debug"):
                raise
            typer.echo(f"error: {line}", err=True)
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except Exception as err:
            if ctx.params.get("debug"):
                raise
            typer.echo(error_line(err), err=True)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=_ReportingGroup,
    name="bionemo-export",
    help=(
        "Export biology language models (ESM-2, ProtT5, BERT protein LMs, MegaMolBART) into Triton "
        "Inference Server model repositories, serve them with a real tritonserver, and benchmark them."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"bionemo-export {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", envvar="BIONEMO_EXPORT_DEBUG",
                               help="Show the Python traceback of an error instead of one line."),
) -> None:
    """Export, serve, query and benchmark biology language models on Triton Inference Server."""


app.command("inspect", help=inspect.__doc__)(inspect.inspect)
app.add_typer(build.app, name="build")
app.add_typer(engines.app, name="engines")
app.command("serve", help=serve.__doc__)(serve.serve)
app.command("health", help=health.__doc__)(health.health)
app.command("verify", help=verify.__doc__)(verify.verify)
app.add_typer(client.app, name="client")
app.command("doctor", help=doctor.__doc__)(doctor.doctor)
app.command("dev-server", help=dev_server.__doc__)(dev_server.dev_server)
app.command("bench", help=bench.__doc__)(bench.bench)
app.command("tune", help=tune.__doc__)(tune.tune)
app.add_typer(deploy.app, name="deploy")
app.add_typer(repo.app, name="repo")
assembled(app)  # every command is in: errors may now word library fields as their flags


if __name__ == "__main__":  # pragma: no cover
    app()
