"""Checkpoint readers, one module per form on disk; importing a module registers its reader.

`read_checkpoint(path)` picks the reader that recognizes `path`. Adding a form is one module here
that subclasses `CheckpointReader` with `@register_reader`, plus its tests.
"""

# Registration order is recognition order (and the order messages list forms in): .nemo and NeMo 2
# before the Hugging Face reader, which recognizes any directory.
from . import nemo, nemo2  # noqa: F401, I001
from . import esm_weights, fair_esm, huggingface, nv_esm, saved  # noqa: F401
from .base import (
    READERS,
    Checkpoint,
    CheckpointError,
    CheckpointPath,
    CheckpointReader,
    read_checkpoint,
    register_reader,
)

__all__ = ["READERS", "Checkpoint", "CheckpointError", "CheckpointPath", "CheckpointReader", "read_checkpoint",
           "register_reader"]
