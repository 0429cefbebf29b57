"""The documentation site builds with `mkdocs build --strict` (a broken link or anchor fails it), and
the pages written from the code cover it: every command and option of the command line, every served
task and tensor, every layer of the package, every committed benchmark result."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from bionemo_export._layers import LAYERS
from bionemo_export.cli.main import app
from bionemo_export.tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's article as text: inline tags dropped, other tags a space, entities decoded,
    whitespace collapsed."""
    source = (site / page / "index.html").read_text(encoding="utf-8")
    main = source[source.find("<article"):source.rfind("</article>")]
    main = re.sub(r"</?(?:code|a|strong|em|span)\b[^>]*>", "", main)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", main)).split())


def written(text: str) -> str:
    """Help text as the page shows it: code spans' backticks gone, whitespace collapsed."""
    return " ".join(text.replace("`", "").replace("\b", "").split())


def commands(command: Any, ctx: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    """Every (words, command) under `command`, read from the click tree Typer builds."""
    found = [(path, command)]
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None
            found += commands(sub, sub.context_class(sub, info_name=name, parent=ctx), path + [name])
    return found


def test_the_cli_reference_shows_every_command_with_its_options_and_their_help(site):
    text = page_text(site, "reference/cli")
    root = typer.main.get_command(app)
    tree = commands(root, root.context_class(root, info_name="bionemo-export"), ["bionemo-export"])
    assert len(tree) > 15  # the walk reached the groups' commands
    for words, command in tree:
        name = " ".join(words)
        assert f"{name} [OPTIONS]" in text, f"no usage line for {name}"
        if command.help:
            first = re.split(r"\n\s*\n", command.help.strip())[0]
            assert written(first) in text, f"{name}: its help is missing"
        for param in command.params:
            if param.hidden:
                continue
            for flag in list(param.opts) + list(getattr(param, "secondary_opts", [])):
                if param.param_type_name == "option":
                    assert flag in text, f"{name}: option {flag} is missing"
            if getattr(param, "help", None):
                assert written(param.help) in text, f"{name} {param.opts[0]}: its help is missing"


def test_the_served_api_page_shows_every_task_and_tensor(site):
    text = page_text(site, "reference/served-api")
    for task in TASKS.values():
        section = text[text.index(f"N_{task.name}¶"):]  # the task's own section (headings end with ¶)
        assert written(task.doc[0].upper() + task.doc[1:]) in section
        for tensor in task.inputs + task.outputs:
            row = f"{tensor.name} {tensor.dtype.value} [{', '.join(str(d) for d in tensor.dims)}]"
            assert row in section, f"N_{task.name}: {row} is missing"
            assert written(tensor.doc) in section, f"N_{task.name}: the meaning of {tensor.name} is missing"


def test_the_developer_guide_shows_every_layer(site):
    text = page_text(site, "developing")
    assert "generated: layers" not in text
    for layer in LAYERS:
        assert f"{layer.name} " in text and written(layer.purpose) in text, f"layer {layer.name} is missing"


def test_the_committed_benchmark_results_are_in_the_site(site):
    results = sorted((ROOT / "benchmarks" / "results").rglob("*.md"))
    assert results
    for result in results:
        page = result.relative_to(ROOT).with_suffix("")
        assert (site / page / "index.html").is_file(), f"{result.relative_to(ROOT)} is not in the site"


def test_no_generated_page_is_committed():
    # docs/hooks.py writes these when the site is built; a committed copy would go stale unnoticed.
    for page in ("reference/cli.md", "reference/served-api.md"):
        assert not (ROOT / "docs" / page).exists(), f"docs/{page} is generated: delete it"
