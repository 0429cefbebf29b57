"""Checkpoint readers, one module per form on disk; importing a module registers its reader.

`read_checkpoint(path)` picks the reader that recognizes `path`. Adding a form is one module here
that subclasses `CheckpointReader` with `@register_reader`, plus its tests.
"""

from . import nemo2  # noqa: F401, I001 - first: the Hugging Face reader recognizes any directory
from . import huggingface, nemo, nv_esm, saved  # noqa: F401
from .base import READERS, Checkpoint, CheckpointError, CheckpointReader, read_checkpoint, register_reader

__all__ = ["READERS", "Checkpoint", "CheckpointError", "CheckpointReader", "read_checkpoint", "register_reader"]
