"""docs/developing.md's recipes against the code they describe: the serving-backend table names
everything a backend class says about itself, and the checkpoint-form recipe everything a reader
defines. Reads the Markdown source; no site build, no server."""

from __future__ import annotations

import re
from pathlib import Path

from bionemo_export.model_repository.backends import ServingBackend
from bionemo_export.models.readers import CheckpointReader

DEVELOPING = Path(__file__).resolve().parents[2] / "docs" / "developing.md"


def section(title: str) -> str:
    """The text of developing.md's `## title` section."""
    text = DEVELOPING.read_text(encoding="utf-8")
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert found, f"developing.md has no section '## {title}'"
    return found.group(1)


def public_names(cls: type) -> set[str]:
    """What a class defines for its subclasses: its public attributes, annotations and methods."""
    return {name for name in (*vars(cls), *getattr(cls, "__annotations__", {})) if not name.startswith("_")}


def test_the_backend_table_lists_everything_a_backend_says_about_itself():
    table = section("Adding a serving backend")
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert public_names(ServingBackend) - listed == set()
    assert listed - public_names(ServingBackend) == set()


def test_the_checkpoint_form_recipe_names_everything_a_reader_defines():
    recipe = section("Adding a checkpoint form")
    missing = [name for name in sorted(public_names(CheckpointReader)) if f"`{name}" not in recipe]
    assert missing == []
