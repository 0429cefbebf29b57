"""The scripts the README and the docs tell people to run: every benchmark answers --help (so its imports resolve
against the package as it is now), and the demo runs end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p for p in ROOT.glob("benchmarks/*.py") if not p.name.startswith("_"))  # _*: shared code

# Runs each script as `python <script> --help` would, one after the other in one interpreter (torch
# is imported once, not once per script), and prints {script: [exit code, stdout, stderr]} as JSON.
ASK_FOR_HELP = """
import contextlib, io, json, os, runpy, sys, traceback
answers = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(script))  # as `python <script>` does: its siblings import
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            code = "raised"
            traceback.print_exc()
    sys.path.pop(0)
    answers[script] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(answers))
"""


def test_every_benchmark_answers_help():
    result = subprocess.run([sys.executable, "-c", ASK_FOR_HELP, *map(str, BENCHMARKS)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.splitlines()[-1])
    assert len(answers) == len(BENCHMARKS) >= 7
    for script, (code, out, err) in answers.items():
        assert code == 0 and out.startswith(f"usage: {Path(script).name}"), f"{script}: exit {code}\n{out}{err}"


def test_demo_builds_serves_queries_and_verifies_antiberty(tmp_path):
    # demo.py writes beside the checkout (<root>/demo_out); a copy in tmp_path writes under tmp_path.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.py", tmp_path / "scripts" / "demo.py")
    result = subprocess.run([sys.executable, "scripts/demo.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "demo passed" in result.stdout
    assert (tmp_path / "demo_out" / "model_repository" / "antiberty_embeddings" / "config.pbtxt").is_file()
