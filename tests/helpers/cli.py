"""The command line as tests run it in a subprocess: this interpreter's `-m bionemo_export.cli.main`,
so that the checkout's CLI runs whatever `bionemo-export` is on PATH."""

from __future__ import annotations

import sys

CLI = [sys.executable, "-m", "bionemo_export.cli.main"]
