"""A local S3-compatible server for the tests that serve from or push to object storage."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
import pytest
from moto.server import ThreadedMotoServer

from bionemo_export.runtime.server import free_ports

ISOLATED_ENV = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials", "AWS_CONFIG_FILE": "/nonexistent/config",
                "AWS_EC2_METADATA_DISABLED": "true"}
"""Only the credentials below may take part: none of this host's profiles or instance metadata."""
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def local_s3(bucket: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A moto S3 server on a free loopback port holding the empty `bucket`; yields its endpoint
    (http://127.0.0.1:PORT). While it runs, the environment holds its dummy credentials (and `env`),
    so the processes a test starts meanwhile (serve, tritonserver) find them.

    moto keeps its buckets in the process, not in the server: a module's server would find what an
    earlier module of the same pytest worker stored (a finished job under the same key, which a
    job then takes for its own). So the store is reset as it starts: every module's is empty."""
    port = free_ports(1)[0]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request would bury a failure's report
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**ISOLATED_ENV, **CREDENTIALS, **(env or {})}.items():
            patch.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(key, raising=False)
        store.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            yield endpoint
        finally:
            store.stop()
