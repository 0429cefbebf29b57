"""The served sessions' memory arena (serving/onnx_session.py, choices.MemoryArena): "run" uses ONNX
Runtime's arena within a run and gives its memory back at the run's end, "true" keeps it, "false"
has none, and a value that is none of them fails the model's load naming its config. Real ONNX
Runtime sessions on a hand-made graph whose intermediate tensors are large (64 MiB), read through
the resident memory of a child process that does nothing else (this file run as a script).

Why a child: a pytest worker has run other tests before this one (torch, servers, mapped weights,
their threads); one CI run with five workers saw 64 MiB stay with memory_arena "false", which glibc
mmaps and unmaps whole and which never reproduced alone. Why smaps_rollup: proc(5) calls VmRSS
inaccurate (the kernel's per-CPU counters); smaps_rollup's Rss walks the page tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bionemo_export.choices import MemoryArena
from bionemo_export.model_repository.options import RoleOptions
from bionemo_export.serving import onnx_session

ROWS, WIDTH = 4096, 4096
"""x [ROWS, 1] times a [1, WIDTH] row: a 64 MiB fp32 intermediate, then summed."""


def outer_product_graph(folder: Path) -> Path:
    """folder/model.onnx: total = sum(relu(x @ ones[1, WIDTH])), one large intermediate tensor per
    run; returns `folder`."""
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT,
                                                                                           [1], [1.0])),
         helper.make_node("MatMul", ["x", "ones"], ["outer"]),
         helper.make_node("Relu", ["outer"], ["positive"]),
         helper.make_node("ReduceSum", ["positive"], ["total"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 1]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    return folder


def open_session(folder: Path, arena: str | None):
    parameters = {} if arena is None else {"memory_arena": {"string_value": arena}}
    args = {"model_config": json.dumps({"name": "m", "parameters": parameters}), "model_name": "m",
            "model_repository": str(folder.parent)}
    return onnx_session.create_session(args, str(folder))[0]


def resident_mb() -> float:
    """This process's resident memory in MiB, counted page by page (smaps_rollup's Rss)."""
    rss = next(line for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if line.startswith("Rss:"))
    return int(rss.split()[1]) / 1024


def run_once(session) -> float:
    x = np.ones((ROWS, 1), dtype=np.float32)
    (total,) = session.run(["total"], {"x": x, "shape": np.array([1, WIDTH], dtype=np.int64)})
    return float(total)


def growth_after_runs(folder: Path, arena: str | None) -> float:
    """MiB that stayed resident after three runs of a warmed-up session (run in this process)."""
    session = open_session(folder, arena)
    assert isinstance(session, onnx_session.ArenaPerRun) == (arena == "run")
    assert session.get_inputs()[0].name == "x"  # the session's own attributes pass through
    run_once(session)  # warm-up: the session's first run allocates its plans and caches
    before = resident_mb()
    for _ in range(3):
        assert run_once(session) == ROWS * WIDTH
    return resident_mb() - before


def test_the_served_choices_are_the_enums():
    assert set(onnx_session.MEMORY_ARENAS) == {arena.value for arena in MemoryArena}
    assert RoleOptions().session_parameters()["memory_arena"] == "run"
    assert RoleOptions(memory_arena=MemoryArena.KEPT).session_parameters()["memory_arena"] == "true"


@pytest.mark.parametrize(("arena", "kept"), [("run", False), ("true", True), ("false", False), (None, False)])
def test_a_run_arena_gives_its_memory_back_and_a_kept_one_does_not(tmp_path, arena, kept):
    folder = outer_product_graph(tmp_path / "m")
    child = subprocess.run([sys.executable, __file__, str(folder), json.dumps(arena)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stdout + child.stderr
    grown = float(child.stdout.split()[-1])
    if kept:
        assert grown > 48, f"the kept arena should hold the 64 MiB intermediate: grew {grown:.1f} MiB"
    else:
        assert grown < 16, f"memory_arena {arena!r}: {grown:.1f} MiB stayed after the runs"


def test_an_unknown_arena_fails_the_load_naming_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"parameter memory_arena is 'always', not one of run, false, true"):
        open_session(outer_product_graph(tmp_path / "m"), "always")


if __name__ == "__main__":  # the child of the test above: prints the MiB that stayed resident
    print(growth_after_runs(Path(sys.argv[1]), json.loads(sys.argv[2])))
