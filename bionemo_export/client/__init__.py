"""Clients for the served models (a generated repository or `bionemo-export dev-server`).

- `RepositoryClient(name, url)`: one object for the public models of a repository built with
  `--name N`, with BioNeMo's method names (`seqs_to_embedding`, `seqs_to_hidden`,
  `hidden_to_seqs`, `sample_seqs`, MegaMolBART's `smis_*` aliases); batching and concurrency are
  automatic. `EncoderClient` and `Seq2SeqClient` are earlier names of the same class.
- `TritonClient(url)`: one request at a time to any model, numpy in and out.
- `infer_rows`: the batching engine both use, and the `client` commands.
- Errors: `InferenceError` (the server refused the request: its message), `ServerFailedError` (the
  server failed it for a reason of its own: a deadline, a dead Python-backend stub; transient),
  with `ServerBusyError` (turned away for load) and `ModelNotServedError` (the model unloading or
  reloading) under it, and `ServerUnreachableError` (nothing answers at the URL). `is_transient`
  tells from a failure's message (and status) whether sending it again can succeed.
"""

from .batches import RowResults, infer_rows
from .repository import EncoderClient, RepositoryClient, Seq2SeqClient, masked_mean
from .triton import (
    DEFAULT_URL,
    InferenceError,
    ModelNotServedError,
    ServerBusyError,
    ServerFailedError,
    ServerUnreachableError,
    TritonClient,
    TritonUrl,
    is_transient,
    strings_to_tensor,
)

__all__ = ["DEFAULT_URL", "EncoderClient", "InferenceError", "ModelNotServedError", "RepositoryClient",
           "RowResults", "Seq2SeqClient", "ServerBusyError", "ServerFailedError", "ServerUnreachableError",
           "TritonClient", "TritonUrl", "infer_rows", "is_transient", "masked_mean", "strings_to_tensor"]
