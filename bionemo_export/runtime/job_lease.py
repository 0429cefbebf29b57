"""The lease that makes one run the owner of an s3:// job output (client/job_lock.OutputLease), where
no flock reaches: two pods of a requeued Indexed Job, a command started twice on two machines.

The lease is an object beside the output (`<folder>/job.lease`, `<file>.lease`) holding JSON:
host, pid, owner (a uuid of this run), started and expires_at (UTC, ISO 8601), and `machine` (the
kernel's boot id and the pid namespace), which tells a holder on this very machine.

- It is taken when absent (a create that fails when the object exists: If-None-Match: *), when
  expired, or when its holder ran on this machine and is no longer running (a killed run started
  again needs no wait); a takeover is a write conditional on the ETag just read (If-Match), said
  in one line. Then it is read back: a store that ignores the conditions is caught there. A live
  lease of another run is refused with JobLockedError naming its holder and how to take over.
- The owner renews it every third of its life from a daemon thread (a write conditional on its
  last ETag). A renewal that finds the lease changed or gone marks it lost (another run took it
  over, or someone removed it), and the job stops at its next upload (`check`, which renews the
  lease itself when the thread is late: a process stopped for longer than the lease's life and
  then continued must not upload before it knows the lease is still its own).
- It is given back on exit: deleted, only while still ours (a delete conditional on our ETag).

Expiry is judged by the reader's clock against the writer's: hosts of one cluster agree within
seconds, and a lease lives minutes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NoReturn, Protocol

from bionemo_export.client.job_lock import JobLockedError, Notice
from bionemo_export.errors import UserError
from bionemo_export.procfs import alive

from .object_storage import S3Location

LEASE_SECONDS = 300.0
"""How long a lease lives unless renewed: how long the output of a run that died elsewhere stays locked."""
_REFUSED = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "NotFound", "404", "409", "412"}
"""What a store answers to a conditional request whose condition no longer holds."""
_UNSUPPORTED = {"NotImplemented", "501"}
"""What a store that has no conditional writes answers to one."""


class LeaseFolder(Protocol):
    """The folder of object storage the lease object lives in (job_storage.S3Folder, which imports
    this module: named here by what the lease uses of it)."""

    uri: str
    location: S3Location
    client: Any
    """The boto3 S3 client of the folder's store."""

    def fail(self, what: str, err: Exception) -> NoReturn:
        """Raise the one-line error of a request to the store that failed."""
        ...


class S3Lease:
    """The lease object `name` in `store`, held for `seconds` at a time (see the module)."""

    def __init__(self, store: LeaseFolder, name: str, notice: Notice, seconds: float = LEASE_SECONDS) -> None:
        self.store, self.name, self.notice, self.seconds = store, name, notice, seconds
        self.owner = uuid.uuid4().hex
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.etag: str | None = None
        self.lost: str | None = None
        """Why the lease is no longer this run's (set by the renewing thread); None while it is."""
        self._conditions = True
        """False once the store answered that it has no conditional writes: then the read-back decides."""
        self._written = 0.0
        """time.monotonic() of our last write of the lease."""
        self._writing = threading.Lock()
        """Held by a renewal: the thread's and check's would otherwise race on one ETag."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return f"{self.store.uri}/{self.name}"

    # -- taking and giving back -----------------------------------------------------------------------
    def __enter__(self) -> S3Lease:
        for _ in range(3):  # the lease changed between our read and our write: read it again
            held = self._read()
            if held is None:
                if self._write(IfNoneMatch="*"):
                    break
                continue
            record, etag = held
            gone = _holder_gone(record)
            if gone is None:
                raise JobLockedError(self._held(record))
            if self._write(IfMatch=etag):
                self.notice(f"took over {self.uri} from {_holder(record)}, {gone}")
                break
        else:
            raise JobLockedError(f"{self.uri}: other runs keep taking this job's lease; make sure one run at a time "
                                 "works on the output, then rerun")
        held = self._read()  # a store that ignored the condition: the last writer holds the lease
        if held is None or held[0].get("owner") != self.owner:
            raise JobLockedError(self._held(held[0] if held else {}))
        self._thread = threading.Thread(target=self._renew, name=f"lease {self.uri}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)  # a renewal in flight ends within the client's timeouts
        if self.lost is None and self.etag is not None:
            location = self.store.location
            self._conditional("give back the job's lease", lambda condition: self.store.client.delete_object(
                Bucket=location.bucket, Key=location.key(self.name), **condition), IfMatch=self.etag)

    def check(self) -> None:
        """Raise JobLockedError when the lease was lost: this run must not write the output any more.
        A renewal overdue (the process was stopped, the thread starved) is done here first."""
        if self.lost is None and time.monotonic() - self._written > self.seconds / 2:
            self._renew_once()
        if self.lost is not None:
            raise JobLockedError(f"{self.uri}: {self.lost}; this run stopped writing the output. If no other run "
                                 "works on it, rerun the same command: it resumes")

    # -- the object ------------------------------------------------------------------------------------
    def _record(self) -> dict[str, Any]:
        expires = datetime.now(timezone.utc) + timedelta(seconds=self.seconds)
        return {"host": socket.gethostname(), "pid": os.getpid(), "machine": _machine(), "owner": self.owner,
                "started": self.started, "expires_at": expires.isoformat(timespec="seconds"),
                "output": self.store.uri}

    def _read(self) -> tuple[dict[str, Any], str] | None:
        """(the lease's record, {} when it is not one this tool writes; its ETag), or None when absent."""
        location = self.store.location
        answer = self._conditional("read the job's lease", lambda condition: self.store.client.get_object(
            Bucket=location.bucket, Key=location.key(self.name)))
        if answer is None:
            return None
        try:
            record = json.loads(answer["Body"].read())
        except ValueError:
            record = None
        return (record if isinstance(record, dict) and "expires_at" in record else {}), answer["ETag"]

    def _write(self, **condition: str) -> bool:
        """The lease written as ours if `condition` (IfNoneMatch / IfMatch) holds; False when it did not."""
        body = json.dumps(self._record(), indent=1).encode()
        location = self.store.location
        answer = self._conditional("write the job's lease", lambda given: self.store.client.put_object(
            Bucket=location.bucket, Key=location.key(self.name), Body=body, ContentType="application/json",
            **given), **condition)
        if answer is None:
            return False
        self.etag, self._written = answer["ETag"], time.monotonic()
        return True

    def _conditional(self, what: str, call: Callable[[dict[str, str]], Any], **condition: str) -> Any:
        """call(condition)'s answer, or None when the store refused it because its condition (or the
        object) was not there; a store without conditional requests is asked without them."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call(condition if self._conditions else {})
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code")
            if code in _REFUSED:
                return None
            if code in _UNSUPPORTED and condition and self._conditions:
                self._conditions = False
                return self._conditional(what, call, **condition)
            self.store.fail(what, err)
        except BotoCoreError as err:
            self.store.fail(what, err)

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3) and self.lost is None:
            try:
                self._renew_once()
            except UserError:  # the store unreachable for a moment: the next renewal tries again
                continue

    def _renew_once(self) -> None:
        with self._writing:
            if self.lost is None and not self._write(IfMatch=self.etag or ""):
                self.lost = ("the job's lease was taken over or removed while this run held it (it was not renewed "
                             f"within {self.seconds:.0f} s, or someone deleted it)")

    # -- what the user reads ---------------------------------------------------------------------------
    def _held(self, record: dict[str, Any]) -> str:
        expires = record.get("expires_at", "?")
        return (f"{self.store.uri}: another run works on this job's output: {_holder(record)}, since "
                f"{record.get('started', '?')} (its lease {self.uri} runs to {expires} and is renewed while it "
                f"runs). Wait for it to finish; if that run is certainly gone, rerun after {expires} (an expired "
                f"lease is taken over) or delete {self.uri} first")


def _holder(record: dict[str, Any]) -> str:
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}"


def _holder_gone(record: dict[str, Any]) -> str | None:
    """Why the lease's holder no longer holds it (said when taking over), or None while it does."""
    if not record:
        return "which held no lease this tool writes"
    try:
        expires = datetime.fromisoformat(str(record["expires_at"]))
    except ValueError:
        return "whose lease had no readable expiry"
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=timezone.utc)
    if expires <= datetime.now(timezone.utc):
        return f"whose lease expired at {record['expires_at']}"
    machine, pid = _machine(), record.get("pid")
    if machine is not None and record.get("machine") == machine and not (isinstance(pid, int) and alive(pid)):
        return "which ran on this machine and is no longer running"
    return None


def _machine() -> str | None:
    """This machine's kernel boot and pid namespace: a holder with the same one is a process here
    (a host name alone is not: containers share one)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # not Linux: no holder is known to be here, and a lease waits for its expiry
        return None
