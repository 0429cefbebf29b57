"""The `bionemo-export` command: a Typer app assembled from one module per command group."""

from __future__ import annotations

import typer

from bionemo_export import __version__

from . import bench, build, client, doctor, serve, verify

app = typer.Typer(
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
) -> None:
    """Export, serve, query and benchmark biology language models on Triton Inference Server."""


app.add_typer(build.app, name="build")
app.command("serve", help=serve.__doc__)(serve.serve)
app.command("verify", help=verify.__doc__)(verify.verify)
app.add_typer(client.app, name="client")
app.command("doctor", help=doctor.__doc__)(doctor.doctor)
app.command("bench", help=bench.__doc__)(bench.bench)


if __name__ == "__main__":  # pragma: no cover
    app()
