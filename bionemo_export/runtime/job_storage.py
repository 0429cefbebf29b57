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
- Every object is uploaded with its SHA-256 in its metadata (`x-amz-meta-sha256`; an ETag is no
  digest of a multipart upload). A run that finds the output finished here but not there (a run
  stopped during its last uploads) uploads every file the location lacks or holds with another
  digest, the marker of completeness last, and says so: a stop at any point is repaired by
  running the same command again.
- The local folder is private to the user (0700, under $XDG_CACHE_HOME or ~/.cache), at the same
  path for the same location, so that a rerun on the machine finds it.
- One run at a time works on an output: `OutputMirror.lease` is the lease object beside it
  (job_lease.py), which the job holds while it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, NoReturn

from bionemo_export.client.job_files import FORMATS, JOURNAL, MANIFEST, errors_file, plain_part_name, work_folder
from bionemo_export.client.job_lock import Notice, OutputLease
from bionemo_export.digests import file_digest
from bionemo_export.errors import InvalidInputError

from .job_lease import LEASE_SECONDS, S3Lease

JOBS_DIR_ENV = "BIONEMO_EXPORT_JOBS_DIR"
"""Where jobs with an s3:// input or output keep their local folders (default: the user's cache folder)."""
ERRORS = "errors.tsv"
LEASE = "job.lease"
"""A directory output's lease object; a single file's is `<name>.lease` beside it."""


def is_s3(location: str | os.PathLike[str]) -> bool:
    return str(location).startswith("s3://")


def local_folder(location: str) -> Path:
    """The local folder of the job whose output is `location`, created private (0700): the same
    path on the same machine every time (a rerun, a rescheduled pod whose disk survived, finds
    what the last run left), under $BIONEMO_EXPORT_JOBS_DIR or the user's cache folder. A folder
    there that is not the user's own is refused; one of theirs open to others is closed again."""
    if os.environ.get(JOBS_DIR_ENV):
        root = Path(os.environ[JOBS_DIR_ENV])
    else:
        cache = os.environ.get("XDG_CACHE_HOME", "")
        root = (Path(cache) if os.path.isabs(cache) else Path.home() / ".cache") / "bionemo-export" / "jobs"
    folder = root / hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        what = "not a folder" if not stat.S_ISDIR(found.st_mode) else f"owned by user id {found.st_uid}, not you"
        raise InvalidInputError(f"{folder}: the local folder of the job on {location} is {what}; remove it, or set "
                                f"{JOBS_DIR_ENV} to a folder of your own")
    if stat.S_IMODE(found.st_mode) != 0o700:  # ours, but others could read or change the job's files
        os.chmod(folder, 0o700)
    return folder


class S3Folder:
    """A folder in object storage: list, download and upload its files by name; each upload
    carries its SHA-256 (the object's `sha256` metadata), which `sha256` reads back."""

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

    def fail(self, what: str, err: Exception) -> NoReturn:
        raise InvalidInputError(f"{self.uri}: cannot {what} ({err}); check the location and the AWS_* "
                                "credentials") from None

    def _call(self, what: str, call: Any) -> Any:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except (BotoCoreError, ClientError, S3UploadFailedError) as err:
            self.fail(what, err)

    def _head(self, name: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.location.bucket, Key=self.location.key(name))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise InvalidInputError(f"{self.uri}/{name}: cannot read it ({err})") from None

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def sha256(self, name: str) -> str | None:
        """The SHA-256 the object was uploaded with; "" for one uploaded without it, None when absent."""
        head = self._head(name)
        return None if head is None else head.get("Metadata", {}).get("sha256", "")

    def download(self, name: str, to: Path) -> None:
        """`name` into the file `to`, written beside it and renamed."""
        staging = to.with_name(to.name + ".downloading")
        self._call(f"download {name}", lambda: self.client.download_file(
            self.location.bucket, self.location.key(name), str(staging)))
        staging.replace(to)

    def upload(self, path: Path, name: str | None = None, sha256: str | None = None) -> None:
        """The file at `path` as `name` (its own name by default), with its SHA-256 (`sha256`, or read here)."""
        key = self.location.key(name or path.name)
        metadata = {"sha256": sha256 or file_digest(path)["sha256"]}
        self._call(f"upload {path.name}", lambda: self.client.upload_file(
            str(path), self.location.bucket, key, ExtraArgs={"Metadata": metadata}))

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
        name = plain_part_name(part.get("file"), f"{uri.rstrip('/')}/{MANIFEST}")
        if not (folder / name).is_file():
            store.download(name, folder / name)
    if store.exists(ERRORS):
        store.download(ERRORS, folder / ERRORS)
    return folder


class OutputMirror:
    """A job's output kept in a local folder and mirrored to an s3:// location (see the module):
    `output` is the job's local output, a directory or a single file named like the location."""

    def __init__(self, uri: str, output: Path, lease_seconds: float = LEASE_SECONDS) -> None:
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
        self.lease_seconds = lease_seconds
        self.notice: Notice = _to_stderr
        """Where the mirror says what it repaired: the notice the job's lease was taken with."""
        self._lease: S3Lease | None = None

    @property
    def location(self) -> str:
        return self.uri

    @property
    def errors_location(self) -> str:
        return f"{self.uri}.errors.tsv" if self.file else f"{self.uri}{ERRORS}"

    def lease(self, notice: Notice) -> OutputLease:
        """The lease object beside the output (job_lease.py), for the job to hold while it runs;
        `notice` also hears what `pull` repairs."""
        self.notice = notice
        store, name = (self.file[0], f"{self.file[1].name}.lease") if self.file else (self.store, LEASE)
        self._lease = S3Lease(store, name, notice, self.lease_seconds)
        return self._lease

    def pull(self) -> None:
        """Make the local folder and the location agree on where the job is. An output finished here
        is completed there (`_complete`); a finished output there is brought here; else the longer
        journal wins. The store's (a job started anew on another machine): its parts are
        downloaded. The local one (this machine stopped between recording a part and uploading
        it): those parts and the journal are uploaded."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._complete():
            return
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
                    path = self.folder / plain_part_name(entry.get("part"), f"{self.store.uri}/{JOURNAL}")
                    if not path.is_file() or entry.get("sha256", None) not in (None, file_digest(path)["sha256"]):
                        self.store.download(path.name, path)
                stored_copy.replace(journal)
                return
            stored_copy.unlink()
        else:
            stored = []
        if len(local) > len(stored):
            for entry in local[max(1, len(stored)):]:
                self._check()
                self.store.upload(self.folder / plain_part_name(entry.get("part"), journal), sha256=entry.get("sha256"))
            self.store.upload(journal)

    def part_finished(self, part: Path) -> None:
        """After the job recorded `part` in its journal: the part, then the journal."""
        self._check()
        self.store.upload(part)
        self.store.upload(self.folder / JOURNAL)

    def finished(self) -> None:
        """The errors file (if any; a directory's journal too, as the job left it), then what marks the
        output finished: the manifest, or the single file itself (after which its stored parts go)."""
        self._check()
        if self.file is not None:
            store, output = self.file
            if errors_file(output).is_file():
                store.upload(errors_file(output))
            store.upload(output)
            self.store.delete_all()
            return
        for path in (self.folder / JOURNAL, self.folder / ERRORS):
            if path.is_file():
                self.store.upload(path)
        self.store.upload(self.folder / MANIFEST)

    def _check(self) -> None:
        if self._lease is not None:
            self._lease.check()

    def _complete(self) -> bool:
        """Where the output is finished here: the location made to hold all of it, checked by digest
        (every file it lacks or holds with another SHA-256 uploaded, the marker last), and what was
        uploaded said in one line. False where nothing is finished here, or the location holds a
        finished output of its own (another machine's run of the job: it wins, as when this folder
        is gone)."""
        marker_store, marker = self.file if self.file is not None else (self.store, self.folder / MANIFEST)
        if not marker.is_file():
            return False
        stored = marker_store.sha256(marker.name)
        if stored is not None and stored != file_digest(marker)["sha256"]:
            return False
        uploads = [] if stored is not None else [
            (store, path, digest) for store, path, digest in self._finished_files()
            if store.sha256(path.name) != digest]
        for store, path, digest in uploads:  # in _finished_files' order: the marker last
            self._check()
            store.upload(path, sha256=digest)
        if self.file is not None:
            self.store.delete_all()  # the stored parts of a run stopped before it removed them
        if uploads:
            names = ", ".join(path.name for _, path, _ in uploads[:4]) + (", ..." if len(uploads) > 4 else "")
            self.notice(f"{self.uri}: the last run stopped before its output was all uploaded; uploaded the "
                        f"{len(uploads)} files the location lacked ({names}) from {marker.parent}, {marker.name} last")
        return True

    def _finished_files(self) -> list[tuple[S3Folder, Path, str]]:
        """(where it goes, the local file, its SHA-256) of each file of the finished output here, in
        the order they are uploaded: the parts, the journal and the errors file, then the marker.
        A part whose recorded SHA-256 (the manifest's or the journal's, where they record one) is not
        the file's is damaged here, and refused."""
        if self.file is not None:
            store, output = self.file
            listed = [errors_file(output), output]
            return [(store, path, file_digest(path)["sha256"]) for path in listed if path.is_file()]
        manifest = self.folder / MANIFEST
        recorded = {entry.get("part"): entry.get("sha256") for entry in _entries(self.folder / JOURNAL)[1:]}
        files: list[tuple[S3Folder, Path, str]] = []
        for part in json.loads(manifest.read_text()).get("parts", []):
            path = self.folder / plain_part_name(part.get("file"), manifest)
            digest = file_digest(path)["sha256"] if path.is_file() else None
            if digest is None or (part.get("sha256") or recorded.get(path.name) or digest) != digest:
                problem = "is missing" if digest is None else "has not the SHA-256 the job recorded"
                raise InvalidInputError(f"{path} {problem}: the finished output here is damaged and {self.uri} "
                                        "lacks it; run the job again into a new output")
            files.append((self.store, path, digest))
        for path in (self.folder / JOURNAL, self.folder / ERRORS, manifest):
            if path.is_file():
                files.append((self.store, path, file_digest(path)["sha256"]))
        return files


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


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
