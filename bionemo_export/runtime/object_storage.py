"""Model repositories in S3-compatible object storage, which tritonserver reads itself.

Triton takes `--model-repository s3://bucket/path` (AWS) or `s3://host:port/bucket/path` (any
S3-compatible store, over HTTP; `s3://https://host:port/bucket/path` for HTTPS), with credentials
from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION (or AWS_PROFILE), and downloads
each model folder before loading it. Nothing here downloads a repository: this module reads such a
location the way Triton does, so that `serve` can refuse a wrong one with one line before a server
starts, and uploads a local repository with what Triton needs and `aws s3 sync` leaves out.

boto3 is optional: without it a location is handed to tritonserver unchecked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bionemo_export.errors import UserError
from bionemo_export.model_repository.manifest import MANIFEST_NAME

S3_SCHEME = "s3://"

# Triton's own pattern for a location on an explicit endpoint (triton-inference-server/core,
# src/filesystem/implementations/s3.h). A location that starts with host:port but does not match
# it is read by Triton as bucket "host:port", so such a location must match it exactly.
_ENDPOINT_LOCATION = re.compile(
    r"s3://(?P<protocol>http://|https://|)(?P<host>[0-9a-zA-Z\-.]+):(?P<port>[0-9]+)/"
    r"(?P<bucket>[0-9a-z.\-]+)(?P<prefix>(/[0-9a-zA-Z.\-_]+)*)"
)
_ENDPOINT_RULES = ("bucket names may use lowercase letters, digits, '.' and '-'; folder names "
                   "letters, digits, '.', '-' and '_'")
_CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_DEFAULT_REGION), or "
                     "AWS_PROFILE: tritonserver reads the same variables")


class S3RepositoryError(UserError, ValueError):
    """An s3:// location that tritonserver could not serve; the message names it and says why."""


@dataclass(frozen=True)
class S3Location:
    """Where an s3:// repository lives, as Triton reads the location."""

    uri: str
    """The location as given to tritonserver."""
    bucket: str
    prefix: str
    """The repository's key prefix, without leading or trailing '/'; '' for the bucket root."""
    endpoint_url: str | None
    """http(s)://host:port of an S3-compatible store; None for AWS's own endpoint."""

    def key(self, relative: str) -> str:
        """The object key of a file given relative to the repository root."""
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def child(self, relative: str) -> str:
        """The s3:// location of a folder inside this one, written the way this one is."""
        return f"{self.uri.rstrip('/')}/{relative.strip('/')}"


def is_s3_uri(location: object) -> bool:
    """Whether a repository location names object storage rather than a local folder."""
    return isinstance(location, str) and location.startswith(S3_SCHEME)


def parse_s3_uri(uri: str) -> S3Location:
    """Split an s3:// location into bucket, prefix and endpoint exactly as tritonserver does
    (repeated and trailing slashes dropped); raise S3RepositoryError for one it would misread."""
    if not is_s3_uri(uri):
        raise S3RepositoryError(f"{uri} is not an s3:// location")
    rest = uri[len(S3_SCHEME):]
    protocol = next((p for p in ("https://", "http://") if rest.startswith(p)), "")
    path = re.sub("/+", "/", rest[len(protocol):]).strip("/")
    if not path:
        raise S3RepositoryError(f"{uri} names no bucket: write s3://bucket/path or s3://host:port/bucket/path")
    first = path.split("/", 1)[0]
    if ":" in first or protocol:  # an explicit endpoint
        match = _ENDPOINT_LOCATION.fullmatch(f"{S3_SCHEME}{protocol}{path}")
        if match is None:
            raise S3RepositoryError(
                f"tritonserver cannot read {uri}: write s3://host:port/bucket/path, where {_ENDPOINT_RULES}")
        scheme = "https" if match["protocol"] == "https://" else "http"  # Triton's default is HTTP here
        return S3Location(uri, match["bucket"], match["prefix"].strip("/"),
                          f"{scheme}://{match['host']}:{match['port']}")
    bucket, _, prefix = path.partition("/")
    return S3Location(uri, bucket, prefix, None)


def s3_client(location: S3Location) -> Any:
    """A boto3 S3 client for the location's endpoint, with the credentials Triton would use.

    Raises ImportError without boto3. Path-style addressing, as Triton uses for an explicit
    endpoint; short timeouts, so that an unreachable store is reported in seconds, not minutes.
    """
    from boto3.session import Session
    from botocore.config import Config

    config = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2},
                    s3={"addressing_style": "path"} if location.endpoint_url else {})
    return Session().client("s3", endpoint_url=location.endpoint_url, config=config)


def _relative_keys(client: Any, location: S3Location) -> Iterator[str]:
    """Every object under the location, relative to it."""
    start = location.key("")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=start):
        for item in page.get("Contents", []):
            yield item["Key"][len(start):]


def list_repository(uri: str) -> list[str]:
    """The objects of an s3:// repository (files, and `folder/` markers), relative to it and
    sorted; S3RepositoryError (naming the location) when it cannot be read. Needs boto3."""
    location = parse_s3_uri(uri)
    try:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError:
        raise S3RepositoryError(f"reading {uri} needs boto3: pip install boto3") from None
    try:
        return sorted(_relative_keys(s3_client(location), location))
    except NoCredentialsError:
        raise S3RepositoryError(f"no S3 credentials to read {uri}: {_CREDENTIALS_HINT}.") from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            where = f" at {location.endpoint_url}" if location.endpoint_url else ""
            raise S3RepositoryError(f"{uri}: bucket '{location.bucket}' does not exist{where}.") from None
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise S3RepositoryError(f"{uri}: access denied ({code}): {_CREDENTIALS_HINT}.") from None
        raise S3RepositoryError(f"{uri}: {code}: {err.response.get('Error', {}).get('Message', err)}") from None
    except BotoCoreError as err:
        raise S3RepositoryError(f"{uri}: cannot read the object store: {err}") from None


def _holds_models(files: list[str]) -> bool:
    """A model folder (a top-level folder with config.pbtxt) or bionemo-export's manifest is there."""
    return any(re.fullmatch(r"[^/]+/config\.pbtxt", name) or name == MANIFEST_NAME for name in files)


def _check_versions(location: S3Location, files: list[str]) -> None:
    """Every model folder must hold a version folder (`1/`): an ensemble's is empty, and object
    storage keeps no empty folders unless a marker object (`N_embeddings/1/`) stands for it, so a
    plain `aws s3 sync` drops it and Triton refuses the model ("at least one version must be
    available")."""
    models = sorted(name.split("/", 1)[0] for name in files if re.fullmatch(r"[^/]+/config\.pbtxt", name))
    unversioned = [model for model in models
                   if not any(re.match(rf"{re.escape(model)}/[0-9]+/", name) for name in files)]
    if unversioned:
        raise S3RepositoryError(
            f"{location.uri}: {', '.join(unversioned)} {'has' if len(unversioned) == 1 else 'have'} no version folder "
            f"(object storage keeps no empty folders, and `aws s3 sync` drops an ensemble's empty 1/): upload with "
            f"`bionemo-export repo push REPO {location.uri} --replace`, which writes a marker for each empty folder.")


def check_s3_repository(uri: str) -> bool:
    """Check that an s3:// location holds a model repository tritonserver can read; False when
    boto3 is missing and nothing was checked. Raises S3RepositoryError with one line that names
    the location, says what is wrong and what to do."""
    location = parse_s3_uri(uri)
    try:
        import boto3  # noqa: F401 - only asking whether it is there
    except ImportError:
        return False
    files = list_repository(uri)
    if not files:
        raise S3RepositoryError(
            f"{uri} does not exist (no objects under it): upload the repository first with "
            f"`bionemo-export repo push REPO {uri}`.")
    if _holds_models(files):
        _check_versions(location, files)
        return True
    folders = sorted({name.split("/", 1)[0] for name in files if "/" in name})
    inside = [folder for folder in folders if _holds_models(
        [name[len(folder) + 1:] for name in files if name.startswith(folder + "/")])]
    hint = (f"did you mean {location.child(inside[0])}?" if inside
            else "upload a repository built by `bionemo-export build repo`.")
    raise S3RepositoryError(f"{uri} is not a model repository (no folder in it has a config.pbtxt); {hint}")


def repository_objects(folder: str | os.PathLike[str]) -> list[str]:
    """The objects a local repository folder becomes, relative and sorted: its files, and a marker
    (`name/`, no content) for each empty folder. Object storage has no folders; Triton reads such
    a marker as one. Builds write a README.md into each ensemble's version folder, which was empty in
    repositories built before that (and in hand-made ones)."""
    folder = Path(folder)
    objects = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder).as_posix()
        if path.is_file():
            objects.append(relative)
        elif path.is_dir() and not any(path.iterdir()):
            objects.append(relative + "/")
    return sorted(objects)


def upload_repository(folder: str | os.PathLike[str], uri: str, replace: bool = False) -> list[str]:
    """Upload a local repository folder to an s3:// location: every file, and a marker for each
    empty folder, which `aws s3 sync` leaves out (see `repository_objects`); returns what was
    uploaded, relative and sorted.

    The bucket must exist. A location that already holds objects is refused unless `replace`,
    which then also deletes the objects the folder does not have: Triton would load a stale
    model folder left there as one of the repository's models.
    """
    folder = Path(folder)
    location = parse_s3_uri(uri)
    files = repository_objects(folder)
    present = list_repository(uri)  # also reports a missing bucket or missing credentials
    if present and not replace:
        raise S3RepositoryError(f"{uri} already holds {len(present)} objects: pass `replace` to overwrite it "
                                "(objects the repository does not have are deleted).")
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client(location)
    stale = sorted(set(present) - set(files))
    try:
        for relative in files:
            if relative.endswith("/"):
                client.put_object(Bucket=location.bucket, Key=location.key(relative), Body=b"")
            else:
                client.upload_file(str(folder / relative), location.bucket, location.key(relative))
        for start in range(0, len(stale), 1000):  # DeleteObjects takes at most 1000 keys
            client.delete_objects(Bucket=location.bucket, Delete={
                "Objects": [{"Key": location.key(name)} for name in stale[start:start + 1000]]})
    except (BotoCoreError, ClientError, S3UploadFailedError) as err:
        raise S3RepositoryError(f"cannot upload to {uri}: {err}") from None
    return files
