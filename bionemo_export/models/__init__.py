"""Model families: one module per architecture, registered by name (see base.py)."""

from bionemo_export.models import bert, esm2, megamolbart  # noqa: F401 - importing registers the families
from bionemo_export.models.base import REGISTRY, LoadedModel, ModelFamily, get_family

__all__ = ["REGISTRY", "LoadedModel", "ModelFamily", "get_family"]
