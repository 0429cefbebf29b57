"""SHA-256 of a file, read in one place: a repository's recorded digests (model_repository/integrity.py),
a bulk job's parts in its journal (client/job_files.py) and the digests its s3:// uploads carry
(runtime/job_storage.py) are all this one function's answer.

    file_digest(path)      # {"sha256": "9f86d0...", "bytes": 4096}

Standard library only, so every layer may use it (serve, verify and the clients run without torch).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

CHUNK_BYTES = 1 << 20
"""Bytes read at a time while hashing: large reads keep the hash, not the system calls, the cost."""


def file_digest(path: Path) -> dict[str, Any]:
    """{"sha256": hex digest, "bytes": size} of one file, read in CHUNK_BYTES pieces."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:  # unbuffered: readinto fills our buffer directly
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
    return {"sha256": digest.hexdigest(), "bytes": size}
