"""Clients for the served models (a generated repository or `bionemo-export dev-server`).

- `RepositoryClient(name, url)`: one object for the public models of a repository built with
  `--name N`, with BioNeMo's method names (`seqs_to_embedding`, `seqs_to_hidden`,
  `hidden_to_seqs`, `sample_seqs`, MegaMolBART's `smis_*` aliases); batching and concurrency are
  automatic. `EncoderClient` and `Seq2SeqClient` are earlier names of the same class.
- `TritonClient(url)`: one request at a time to any model, numpy in and out.
- `infer_rows`: the batching engine both use, and the `client` commands.
"""

from .batches import RowResults, infer_rows
from .repository import EncoderClient, RepositoryClient, Seq2SeqClient, masked_mean
from .triton import (
           DEFAULT_URL,
           InferenceError,
           ServerBusyError,
           ServerUnreachableError,
           TritonClient,
           TritonUrl,
           strings_to_tensor,
)

__all__ = ["DEFAULT_URL", "EncoderClient", "InferenceError", "RepositoryClient", "ServerBusyError", "RowResults",
           "Seq2SeqClient", "ServerUnreachableError", "TritonClient", "TritonUrl", "infer_rows", "masked_mean",
           "strings_to_tensor"]
