"""bench/run.py's bounded perf_analyzer runs: a run that stalls is killed and started again, and a
run that stalls every time is an error that names the log. A shell script stands in for the
perf_analyzer binary so that the stall happens on cue; the process handling is the real one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bionemo_export.bench.run import BenchError, _perf_analyzer, run_limit
from bionemo_export.runtime.perf_analyzer import PerfAnalyzer


def _script(tmp_path: Path, body: str) -> PerfAnalyzer:
    binary = tmp_path / "perf_analyzer"
    binary.write_text(f"#!/bin/sh\n{body}\n")
    binary.chmod(0o755)
    return PerfAnalyzer(binary=binary)


def test_a_run_that_stalls_once_is_started_again_and_its_second_output_returned(tmp_path):
    # The first run leaves a mark and stalls; the second finds the mark and answers.
    mark = tmp_path / "ran-once"
    pa = _script(tmp_path, f'if [ -e {mark} ]; then echo "Concurrency: 8, throughput: 1 infer/sec"; exit 0; fi\n'
                           f"touch {mark}\nexec sleep 60")
    log = tmp_path / "perf_analyzer.log"
    started = time.monotonic()
    code, output = _perf_analyzer(pa, ["--concurrency-range", "8"], log, timeout=1.0)
    assert time.monotonic() - started < 30
    assert code == 0 and output.strip() == "Concurrency: 8, throughput: 1 infer/sec"
    text = log.read_text()
    assert text.count("$ perf_analyzer --concurrency-range 8") == 2
    assert "perf_analyzer still running after 1 s: stopped" in text


def test_a_run_that_stalls_every_time_is_an_error_naming_the_log(tmp_path):
    pa = _script(tmp_path, "exec sleep 60")
    log = tmp_path / "perf_analyzer.log"
    with pytest.raises(BenchError, match=f"longer than 1 s each of 2 times .*see {log}"):
        _perf_analyzer(pa, [], log, timeout=1.0)
    assert log.read_text().count("stopped") == 2


def test_a_run_that_ends_is_not_retried_whatever_its_exit_code(tmp_path):
    pa = _script(tmp_path, 'echo "Failed to obtain stable measurement."; exit 1')
    log = tmp_path / "perf_analyzer.log"
    code, output = _perf_analyzer(pa, [], log, timeout=30.0)
    assert code == 1 and "Failed to obtain stable measurement" in output
    assert log.read_text().count("$ perf_analyzer") == 1


def test_the_limit_grows_with_what_the_run_should_take():
    assert run_limit(0.0) == 60.0 and run_limit(6.0) == 120.0
