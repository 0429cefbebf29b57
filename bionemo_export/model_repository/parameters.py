"""Config parameters through which a generated repository tells the serving runtime, and its clients,
about its models.

The planners (masked_lm.py, seq2seq.py) write them into a model's `config.pbtxt` (`parameters`);
the supervisor (runtime/supervisor.py) reads them back from the server. They are named here, in the
planners' layer, which the runtime may import and the planners do not climb out of.
"""

from __future__ import annotations

BLS_MODELS = "bls_models"
"""Config parameter of a model that calls others through BLS: their names, comma-separated. Triton
knows an ensemble's steps but not these calls; the supervisor reloads the callees with their caller."""

SOURCE_SHA256 = "source_sha256"
"""Config parameter of every model a build writes: what the repository was built from, as one
digest (manifest.source_sha256: the checkpoint digests manifest.json records, in member order, and
the precision). A client reads configs, never the repository's files, so this is how it tells apart
two repositories built under one name from different checkpoints, whose configs are otherwise the
same (a bulk job's fingerprint hashes the served configs). No served model reads it."""
