"""A generated model's settings, read from its config.pbtxt `parameters` when Triton loads it.

Triton hands `initialize(args)` the model's configuration as JSON (`args["model_config"]`), where
each parameter is {"string_value": ...}. Constants the model needs (limits, token ids, thread
counts) arrive this way rather than being rendered into model.py, so that one copied module
serves every model and a setting can be changed by editing config.pbtxt.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

# The parameters a build writes that no served model reads: the supervisor, tune and the clients
# read them back from the server (the planners write them; this module names them for all).
BLS_MODELS = "bls_models"
"""Config parameter of a model that calls others through BLS: their names, comma-separated. Triton
knows an ensemble's steps but not these calls; the supervisor reloads the callees with their caller."""

SOURCE_SHA256 = "source_sha256"
"""Config parameter of every model a build writes: what the repository was built from, as one
digest (manifest.source_sha256: the checkpoint digests manifest.json records, in member order, and
the precision). A client reads configs, never the repository's files, so this is how it tells apart
two repositories built under one name from different checkpoints, whose configs are otherwise the
same (a bulk job's fingerprint hashes the served configs). No served model reads it."""


def config_file(args: Mapping[str, str]) -> str:
    """This model's config.pbtxt (Triton passes the model's folder as `model_repository`), for errors."""
    return os.path.join(args.get("model_repository", args["model_name"]), "config.pbtxt")


def model_config(args: Mapping[str, str]) -> dict[str, Any]:
    """This model's configuration, as Triton passed it to initialize()."""
    return json.loads(args["model_config"])


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """This model's config.pbtxt `parameters`: {name: string value}."""
    return {key: value["string_value"] for key, value in model_config(args).get("parameters", {}).items()}


def number_parameter(args: Mapping[str, str], parameters: Mapping[str, str], name: str, default: Any = None,
                     kind: Callable[[Any], Any] = int) -> Any:
    """config.pbtxt parameter `name` as a number (`default` when it is absent). A value that is not
    one fails the model's load with an error naming its config.pbtxt and the parameter, where a
    bare int() would say only "invalid literal"."""
    value = parameters.get(name, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{config_file(args)}: parameter {name} is {value!r}, not {expected}; correct it, "
                         "or rebuild the repository") from None


def flag_parameter(parameters: Mapping[str, str], name: str) -> bool:
    """config.pbtxt parameter `name` as a switch: on exactly when it is "true" (absent: off)."""
    return parameters.get(name, "false") == "true"


def json_parameter(args: Mapping[str, str], parameters: Mapping[str, str], name: str) -> Any:
    """config.pbtxt parameter `name` read as JSON (tables such as a graph's axes); absent or not
    JSON, the model's load fails with an error naming its config.pbtxt and the parameter."""
    if name not in parameters:
        raise ValueError(f"{config_file(args)}: parameter {name} is missing; rebuild the repository")
    try:
        return json.loads(parameters[name])
    except ValueError:
        raise ValueError(f"{config_file(args)}: parameter {name} is not JSON ({parameters[name][:80]!r}); correct "
                         "it, or rebuild the repository") from None


def tensor_names(args: Mapping[str, str], kind: str) -> list[str]:
    """The names of this model's config `kind` tensors ("input" or "output"), in config order."""
    return [tensor["name"] for tensor in model_config(args).get(kind, [])]


# config.pbtxt's graph_optimization_level: the level each kind of stored graph is opened at
# (onnx_session.py). The exporters decide which kind a build stores (exporters/optimize), the
# planners write the matching level.
SERVING_GRAPH_OPTIMIZATION_LEVEL = "ORT_ENABLE_BASIC"
"""The ONNX Runtime session level for a graph stored optimized offline (fp32, int8): the expensive
rewrites are already in the file, and "all" measured no faster."""
UNOPTIMIZED_SERVING_LEVEL = "ORT_ENABLE_ALL"
"""The session level for a graph stored without offline optimization (the plain export, fp16)."""
