"""Bulk jobs (client/jobs.py) whose input or output lives in S3-compatible object storage: a
Kubernetes Indexed Job's pods, a cloud batch job, a laptop reading a bucket. It sits with the
runtime's object storage; the job sees only the `PartMirror` protocol it implements.

Locations are written as tritonserver writes them (object_storage.py): s3://bucket/key on
AWS, s3://host:port/bucket/key on any S3-compatible store; credentials from AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION or AWS_PROFILE, as for a repository.

- An input is downloaded once into the job's local folder and kept while the job runs (a job reads
  its input again from the start when it resumes); it is downloaded again only when the object
  changed (its ETag).
- A directory output (parts, journal, manifest.json) is mirrored to the location: the job runs in
  a local folder, and each finished part is uploaded before the journal that names it, so the
  stored journal never names a missing part; manifest.json is uploaded last and marks the output
  finished. A job that starts where that folder is gone (a rescheduled pod) downloads the stored
  journal and the parts it names, then resumes after them: exactly once, as on disk.
- A single-file output (s3://bucket/path/proteome.h5 or .parquet) keeps its parts and journal the
  same way under `<location>.parts/` while it runs; the finished file (and its errors file) is
  uploaded to the location, which marks it finished, then the stored parts are deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bionemo_export.client.job_files import FORMATS, JOURNAL, MANIFEST, errors_file, work_folder
from bionemo_export.errors import InvalidInputError

JOBS_DIR_ENV = "BIONEMO_EXPORT_JOBS_DIR"
"""Where jobs with an s3:// input or output keep their local folder (default: the temporary folder)."""
ERRORS = "errors.tsv"


def is_s3(location: str | os.PathLike[str]) -> bool:
    return str(location).startswith("s3://")


def local_folder(location: str) -> Path:
    """The local folder of the job whose output is `location`: the same path on every machine
    (a rescheduled pod finds what its predecessor left, where its disk survived)."""
    root = Path(os.environ.get(JOBS_DIR_ENV) or Path(tempfile.gettempdir()) / "bionemo-export-jobs")
    return root / hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:16]


class S3Folder:
    """A folder in object storage: list, download and upload its files by name."""

    def __init__(self, uri: str) -> None:
        from .object_storage import S3RepositoryError, parse_s3_uri, s3_client

        try:
            self.location = parse_s3_uri(uri)
            self.client = s3_client(self.location)
        except S3RepositoryError as err:
            raise InvalidInputError(str(err)) from None
        except ImportError:
            raise InvalidInputError(f"{uri}: s3:// inputs and outputs need boto3 (pip install boto3)") from None
        self.uri = uri.rstrip("/")

    def _call(self, what: str, call: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except (BotoCoreError, ClientError) as err:
            raise InvalidInputError(f"{self.uri}: cannot {what} ({err}); check the location and the AWS_* "
                                    "credentials") from None

    def exists(self, name: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.location.bucket, Key=self.location.key(name))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise InvalidInputError(f"{self.uri}/{name}: cannot read it ({err})") from None
        return True

    def download(self, name: str, to: Path) -> None:
        """`name` into the file `to`, written beside it and renamed."""
        staging = to.with_name(to.name + ".downloading")
        self._call(f"download {name}", lambda: self.client.download_file(
            self.location.bucket, self.location.key(name), str(staging)))
        staging.replace(to)

    def upload(self, path: Path, name: str | None = None) -> None:
        key = self.location.key(name or path.name)
        self._call(f"upload {path.name}", lambda: self.client.upload_file(str(path), self.location.bucket, key))

    def delete_all(self) -> None:
        """Every object under the folder (a finished single-file output's parts and journal)."""
        prefix = self.location.key("")
        pages = self._call("list the folder", lambda: list(self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=prefix)))
        keys = [{"Key": item["Key"]} for page in pages for item in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):  # S3's limit a request
            self._call("delete the stored parts", lambda batch=keys[start:start + 1000]: self.client.delete_objects(
                Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True}))

    def etag(self, name: str) -> str:
        head = self._call(f"read {name}", lambda: self.client.head_object(
            Bucket=self.location.bucket, Key=self.location.key(name)))
        return head["ETag"].strip('"')


def fetch_input(uri: str, folder: Path) -> Path:
    """The object at `uri` as a local file in `folder` (downloaded unless the copy there has the
    object's ETag), keeping its name: `.gz` inputs stay compressed."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or parent in ("s3:", "s3:/"):
        raise InvalidInputError(f"--input {uri}: name an object, s3://bucket/path/file.fasta.gz")
    store = S3Folder(parent)
    folder.mkdir(parents=True, exist_ok=True)
    local, stamp = folder / name, folder / (name + ".etag")
    etag = store.etag(name)
    if not (local.is_file() and stamp.is_file() and stamp.read_text() == etag):
        store.download(name, local)
        stamp.write_text(etag)
    return local


def fetch_output(uri: str, folder: Path) -> Path:
    """A finished directory output stored at `uri` (manifest.json, its parts, errors.tsv) copied
    into `folder`, for `client merge`; refused when the location holds no finished output."""
    store = S3Folder(uri)
    if not store.exists(MANIFEST):
        raise InvalidInputError(f"{uri} is not a finished job output (no {MANIFEST}): run that shard to its end "
                                "first (the same command resumes it), then merge")
    folder.mkdir(parents=True, exist_ok=True)
    store.download(MANIFEST, folder / MANIFEST)
    for part in json.loads((folder / MANIFEST).read_text())["parts"]:
        if not (folder / part["file"]).is_file():
            store.download(part["file"], folder / part["file"])
    if store.exists(ERRORS):
        store.download(ERRORS, folder / ERRORS)
    return folder


class OutputMirror:
    """A job's output kept in a local folder and mirrored to an s3:// location (see the module):
    `output` is the job's local output, a directory or a single file named like the location."""

    def __init__(self, uri: str, output: Path) -> None:
        uri = uri.rstrip("/")
        parent, _, name = uri.rpartition("/")
        self.file: tuple[S3Folder, Path] | None = None
        if Path(name).suffix in FORMATS:  # a single file: its parts under <name>.parts/ meanwhile
            if output.name != name:
                raise ValueError(f"the local output {output} is not named like {uri}")
            self.file = (S3Folder(parent), output)
            uri = f"{uri}.parts"
        self.store, self.folder = S3Folder(uri), work_folder(output)
        self.uri = f"{parent}/{name}" if self.file else f"{uri}/"

    @property
    def location(self) -> str:
        return self.uri

    @property
    def errors_location(self) -> str:
        return f"{self.uri}.errors.tsv" if self.file else f"{self.uri}{ERRORS}"

    def pull(self) -> None:
        """Make the local folder and the location agree on where the job is: a finished output's
        manifest is brought here; else the longer journal wins. The store's (a job started anew on
        another machine): its parts are downloaded. The local one (this machine stopped between
        recording a part and uploading it): those parts and the journal are uploaded."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.file is not None:
            store, output = self.file
            if store.exists(output.name):  # finished: the job finds it so (and a stop before the clean-up is undone)
                store.download(output.name, output)
                self.store.delete_all()
                return
        elif self.store.exists(MANIFEST):
            self.store.download(MANIFEST, self.folder / MANIFEST)
            return
        journal = self.folder / JOURNAL
        local = _entries(journal)
        if self.store.exists(JOURNAL):
            stored_copy = self.folder / (JOURNAL + ".stored")
            self.store.download(JOURNAL, stored_copy)
            stored = _entries(stored_copy)
            if len(stored) > len(local):
                for entry in stored[1:]:
                    if not (self.folder / entry["part"]).is_file():
                        self.store.download(entry["part"], self.folder / entry["part"])
                stored_copy.replace(journal)
                return
            stored_copy.unlink()
        else:
            stored = []
        if len(local) > len(stored):
            for entry in local[max(1, len(stored)):]:
                self.store.upload(self.folder / entry["part"])
            self.store.upload(journal)

    def part_finished(self, part: Path) -> None:
        """After the job recorded `part` in its journal: the part, then the journal."""
        self.store.upload(part)
        self.store.upload(self.folder / JOURNAL)

    def finished(self) -> None:
        """The errors file (if any), then what marks the output finished: the manifest, or the single
        file itself (after which its stored parts go)."""
        if self.file is not None:
            store, output = self.file
            if errors_file(output).is_file():
                store.upload(errors_file(output))
            store.upload(output)
            self.store.delete_all()
            return
        if (self.folder / ERRORS).is_file():
            self.store.upload(self.folder / ERRORS)
        self.store.upload(self.folder / MANIFEST)


def _entries(journal: Path) -> list[dict[str, Any]]:
    """The journal's complete lines (the fingerprint line first), parsed; [] when there is none."""
    if not journal.is_file():
        return []
    entries = []
    for line in journal.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:  # a line a stopped run was writing
            break
    return entries
