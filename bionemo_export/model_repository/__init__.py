"""Plan a Triton model repository as typed objects and write it to disk (config.pbtxt via ModelConfig).

Importing this package imports none of its modules: the names below load `pbtxt` (protobuf and
tritonclient's ModelConfig) on first use (PEP 562), so that the runtime can read `manifest` or
`parameters` without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers and editors; at run time __getattr__ loads them
    from .pbtxt import ModelConfig, parse_pbtxt, read_config, to_pbtxt, write_config

__all__ = ["ModelConfig", "parse_pbtxt", "read_config", "to_pbtxt", "write_config"]


def __getattr__(name: str) -> Any:
    """A public name, loaded from `pbtxt` on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.pbtxt"), name)
    globals()[name] = value  # later lookups find it without __getattr__
    return value
