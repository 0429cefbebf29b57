"""Jinja2 templates of the generated Python-backend `model.py`: model.py.j2, the same code for every
Python model (the served package's TritonPythonModel), and each kind's docstring (<kind>_model.py.j2),
the one part written for the model."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

TEMPLATE_DIR = Path(__file__).parent


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,  # a missing variable is a bug, not an empty string
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **context: object) -> str:
    """Render `template` (a file name in this folder) with `context`."""
    return _environment().get_template(template).render(**context)
