"""Model families: one module per architecture, registered by name (see base.py).

Every module of this package is imported here, so a family registers itself just by being a
module in it (no list to edit); checkpoint readers live in the `readers` subpackage.
"""

import importlib
import pkgutil

from bionemo_export.models.base import (
    REGISTRY,
    LoadedModel,
    ModelDescription,
    ModelFamily,
    get_family,
    infer_family,
    load_checkpoint,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "LoadedModel", "ModelDescription", "ModelFamily", "get_family", "infer_family",
           "load_checkpoint"]
