"""Validate generated Kubernetes manifests with maintained libraries, no hand-written schema.

- Kubernetes objects: `kubernetes-validate`, which bundles the JSON schemas derived from the
  official OpenAPI of each Kubernetes release; strict mode rejects unknown fields.
- KServe's InferenceService: the `kserve` PyPI SDK ships no CRD, only the model classes that
  KServe generates from the same Go API types as its CRD (openapi-generator; `openapi_types`,
  `attribute_map`), whose embedded Kubernetes types (containers, probes, volumes) are the
  `kubernetes` client's generated models (pydantic). `sdk_problems` walks a document through
  them: every key must be a field of its model (neither library rejects unknown fields itself),
  every value of the field's declared type, and each model is validated by its own class, which
  rejects missing required fields (and, for the Kubernetes models, loose types).

The SDK is installed without its dependencies (they would replace this environment's protobuf
and bring a web server); its package `__init__` imports that server, so the model modules are
imported under a bare `kserve` package instead (`kserve_models`).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from typing import Any

KUBERNETES_VERSION = "1.34.0"
"""The Kubernetes release whose API schemas the manifests are validated against."""

_PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
                                            "date": (str,), "datetime": (str,)}


def validate_kubernetes(document: dict) -> str:
    """Validate one Kubernetes object against the official API schema (strict); raises
    kubernetes_validate.ValidationError. Returns the schema version used."""
    import kubernetes_validate

    return kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def kserve_models() -> types.ModuleType:
    """`kserve.models`, imported without running the SDK's package `__init__` (see the module)."""
    if "kserve.models" in sys.modules:
        return sys.modules["kserve.models"]
    spec = importlib.util.find_spec("kserve")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the kserve SDK is not installed (pip install --no-deps kserve)")
    if "kserve" not in sys.modules:
        package = types.ModuleType("kserve")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["kserve"] = package
    return importlib.import_module("kserve.models")


def kserve_constant(name: str) -> str:
    """A constant of the SDK (KSERVE_GROUP, KSERVE_V1BETA1_VERSION, KSERVE_KIND_INFERENCESERVICE)."""
    kserve_models()
    return getattr(importlib.import_module("kserve.constants.constants"), name)


def _model_class(name: str) -> type:
    """A generated model class: KServe's own, else the Kubernetes client's (V1Container, ...)."""
    import kubernetes.client.models

    for module in (kserve_models(), kubernetes.client.models):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(f"no generated model class {name}")


def sdk_problems(value: Any, type_name: str, where: str = "") -> list[str]:
    """What in `value` does not fit the generated type `type_name` ('V1beta1InferenceService',
    'list[V1EnvVar]', 'dict(str, str)', 'int', ...), one line per problem with its path."""
    where = where or type_name  # generated types are spelled list[X], dict(str, X) or Dict[str, X]
    if match := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in sdk_problems(item, match[1], f"{where}[{i}]")]
    if match := re.fullmatch(r"dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\]", type_name):
        value_type = match[2] or match[4]
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        return [p for key, item in value.items() for p in
                (([] if isinstance(key, str) else [f"{where}: key {key!r} is not a string"])
                 + sdk_problems(item, value_type, f"{where}.{key}"))]
    if type_name == "object":  # free-form (IntOrString, quantities): any JSON value
        return []
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and (type_name == "bool" or not isinstance(value, bool))
        return [] if ok else [f"{where}: expected {type_name}, got {type(value).__name__} {value!r}"]
    cls = _model_class(type_name)
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping, got {type(value).__name__}"]
    fields = {json_key: attribute for attribute, json_key in cls.attribute_map.items()}
    problems = [f"{where}: unknown field '{key}' for {type_name}" for key in value if key not in fields]
    for key, item in value.items():
        if key in fields:
            problems += sdk_problems(item, cls.openapi_types[fields[key]], f"{where}.{key}")
    try:  # the class's own validation: required fields, strict types, allowed values
        if hasattr(cls, "model_validate"):  # the Kubernetes client's models (pydantic), from JSON keys
            cls.from_dict({key: item for key, item in value.items() if key in fields})
        else:  # KServe's (classic openapi-generator), from attribute names; checks required fields
            cls(**{fields[key]: item for key, item in value.items() if key in fields})
    except (ValueError, TypeError) as err:
        problems.append(f"{where}: {type_name}: {' '.join(str(err).split())}")
    return problems


def validate_inference_service(document: dict) -> None:
    """Raise AssertionError listing what in an InferenceService the KServe SDK's types reject."""
    assert document.get("apiVersion") == (f"{kserve_constant('KSERVE_GROUP')}/"
                                          f"{kserve_constant('KSERVE_V1BETA1_VERSION')}"), document.get("apiVersion")
    assert document.get("kind") == kserve_constant("KSERVE_KIND_INFERENCESERVICE"), document.get("kind")
    problems = sdk_problems(document, "V1beta1InferenceService")
    assert not problems, "\n".join(problems)
