"""Task kits: each served task's graphs, planner, verify check and dev-server answer (base.py).

Every module of this package is imported here, so a kit registers itself just by being a module in
it (no list to edit), as the model families do.
"""

import importlib
import pkgutil

from bionemo_export.kits.base import (
    KITS,
    Answers,
    ExportedGraph,
    GraphExport,
    PlanContext,
    Requests,
    TaskKit,
    graph_exports,
    kit_of,
    kits_of,
    needed_graphs,
    register_kit,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["KITS", "Answers", "ExportedGraph", "GraphExport", "PlanContext", "Requests", "TaskKit", "graph_exports",
           "kit_of", "kits_of", "needed_graphs", "register_kit"]
