"""Move model repositories: `repo push` uploads one to S3-compatible object storage, where
tritonserver (and `bionemo-export serve`) reads it."""

from __future__ import annotations

from pathlib import Path

import typer

from bionemo_export.cli import NO_CHECK_HELP, check_files, reason
from bionemo_export.runtime.object_storage import S3RepositoryError, upload_repository
from bionemo_export.runtime.server import NotAModelRepositoryError, check_model_repository

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.command("push")
def push(
    repository: Path = typer.Argument(..., help="The model repository folder to upload.", exists=True,
                                      file_okay=False, resolve_path=True),
    location: str = typer.Argument(..., help="Where to: s3://bucket/path on AWS, s3://host:port/bucket/path on "
                                   "another S3-compatible store (the bucket must exist)."),
    replace: bool = typer.Option(False, help="Overwrite a location that already holds objects, deleting the "
                                 "ones the repository does not have."),
    no_check: bool = typer.Option(False, "--no-check", help=NO_CHECK_HELP),
) -> None:
    """Upload a model repository to an s3:// location, with the credentials tritonserver uses
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or AWS_PROFILE), after comparing
    its files with the digests its manifest.json records (which travels with it)."""
    try:
        check_model_repository(repository)
        # Object storage is not checked when served (that would download every file): check here.
        check_files(repository, skip=no_check)
        files = upload_repository(repository, location, replace=replace)
    except (NotAModelRepositoryError, S3RepositoryError) as err:
        typer.echo(f"error: {reason(err)}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"uploaded {len(files)} objects to {location}")
    typer.echo(f"serve it with: bionemo-export serve {location}")
