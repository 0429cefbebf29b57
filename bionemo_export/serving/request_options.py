"""N_samplings' optional inputs (num_samples, scaled_radius, sampling_method, seed, top_k, top_p,
temperature, beam_size): one value per request, parsed and checked before any work.

The one parser of these options: the generated N_samplings model (arrays read from its Triton
request) and the dev server (arrays PyTriton hands over) both call `parse_options`, so an option
gets the same message from either (a NaN radius included).

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .responses import RequestError

# The type checker reads the package's imports: in the package, search lives in generation/, so
# the top-level name of a generated model folder does not resolve here.
from .search import SAMPLING_DEFAULTS, check_sampling_arguments

OPTIONS: dict[str, Any] = {**SAMPLING_DEFAULTS, "seed": None}
"""The optional inputs and what a request gets without them."""
MAX_SEED = 2**63 - 1


def option_value(name: str, array: np.ndarray) -> Any:
    """The one value of optional input `name` ([batch, 1], the same on every row) as a Python
    value: a str for BYTES (UTF-8), else an int or float."""
    values = array.reshape(-1)
    if values.dtype == np.object_ or values.dtype.kind == "S":  # BYTES (Triton: objects; PyTriton may give "S")
        for row, value in enumerate(values):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"input '{name}' row {row} is not valid UTF-8") from None
        values = np.array([value.decode("utf-8") for value in values], dtype=np.object_)
        same = values == values[0]
    else:
        same = values == values[0]
        if values.dtype.kind == "f":  # NaN is its own problem (reported by the range checks), not a mismatch
            same |= np.isnan(values) & np.isnan(values[0])
    differs = np.flatnonzero(~same)
    if differs.size:
        row = int(differs[0])
        raise RequestError(f"input '{name}' row {row} differs from row 0 ({values[row]!r} vs {values[0]!r}): "
                           f"one value for the whole request")
    return values[0] if isinstance(values[0], str) else values[0].item()


def parse_options(arrays: Mapping[str, np.ndarray | None], batch: int, limits: Mapping[str, int]) -> dict[str, Any]:
    """The request's options as Python values (OPTIONS' defaults for those absent or None in
    `arrays`), each given as a [batch, 1] array, checked against their ranges and the server's
    `limits` (search.LIMITS -> int). RequestError or GenerationError names the input and the row."""
    values = dict(OPTIONS)
    for name in OPTIONS:
        array = arrays.get(name)
        if array is None:
            continue
        array = np.asarray(array)
        if array.shape != (batch, 1):
            raise RequestError(f"input '{name}' must have shape [batch, 1] = [{batch}, 1] (one value per "
                               f"row of 'sequences'), got {list(array.shape)}")
        values[name] = option_value(name, array)
    check_sampling_arguments(values["sampling_method"], values["num_samples"], values["beam_size"],
                             values["scaled_radius"], values["top_k"], values["top_p"], values["temperature"],
                             limits=limits, label=lambda name: f"input '{name}' row 0")
    seed = values["seed"]
    if seed is not None and seed < 0:
        raise RequestError(f"input 'seed' row 0 must be between 0 and {MAX_SEED}, got {seed}")
    return values
