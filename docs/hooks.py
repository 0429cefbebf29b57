"""mkdocs hooks (mkdocs.yml `hooks:`): the pages and files the site takes from the code and the
repository instead of from `docs/`.

- `reference/cli.md`, from the Typer app (`bionemo_export.cli.main:app`);
- `reference/served-api.md`, from the task table (`bionemo_export/tasks.py`);
- the layers table of the developer guide, where a page says `<!-- generated: layers -->`, from
  `bionemo_export/_layers.py`;
- `benchmarks/results/...`: the committed benchmark results (Markdown reports and their plots),
  so that the benchmarks page links to them inside the site.

None of these is written into `docs/`: they exist only in the built site.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package, when mkdocs runs outside an environment that installed it
    sys.path.insert(0, str(ROOT))

import reference_pages  # noqa: E402  (docs/, put on sys.path by mkdocs while it loads this file)

RESULTS = ROOT / "benchmarks" / "results"
RESULT_SUFFIXES = {".md", ".png"}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from bionemo_export.cli.main import app

    for page, content in ((reference_pages.CLI_PAGE, reference_pages.cli_reference(app)),
                          (reference_pages.SERVED_API_PAGE, reference_pages.served_api())):
        if files.get_file_from_path(page) is not None:  # a committed copy would go stale unnoticed
            raise PluginError(f"docs/{page} is generated from the code when the site is built: delete the file")
        files.append(File.generated(config, page, content=content))
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in RESULT_SUFFIXES:
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if reference_pages.LAYERS_MARKER in markdown:
        markdown = markdown.replace(reference_pages.LAYERS_MARKER, reference_pages.layers_table())
    return markdown
