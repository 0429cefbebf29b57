"""The weights once per repository (issue 46, item 2), measured on a real-shape ESM-2: repository
weight bytes, resident memory per served instance and what of it is shared, and the speed of
embeddings requests, before (each of the encoder, layers, contacts and attentions graphs stored with
its own weights and served by a model of its own) and after (the four over one weights.bin, served
by N_encoder).

    .venv/bin/python benchmarks/shared_weights.py [--shape esm2_t12_35M] [--out benchmarks/results/shared_weights.json]

One default build (`--backend python`: every task the checkpoint serves) of a random checkpoint of
the shape (testing/large_checkpoints.py: with its contact head). "Before" is made from it: each
hosted graph saved again with its weights inside (what the build stored until now, byte for byte
the same tensors), each opened in a process of its own as its Triton model's instance was (ONNX
Runtime's defaults: prepacked). "After" is N_encoder's instance as its model.py opens it
(serving/onnx_session.py: the encoder's session prepacked, the hosted graphs' computing from the
mapped file), twice at once, as two instances would: each process's RssAnon (private), RssFile
and Pss_File (file pages, shared between the processes that map them) from /proc after every graph
answered a request. Speed: one embeddings batch (rows x length random proteins' tokens) on the
encoder graph with and without prepacking, and on the layers graph before (prepacked, its own
weights) and after (mapped), alternated in one process; medians. A machine shared with other work
gives ratios, not absolute figures: the JSON says when it ran and how loaded the host was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HOSTED = ("layers", "contacts", "attentions")
SUMMARY = (__doc__ or "").split("\n\n")[0]
SMOKE_SHAPE = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}
"""--shape smoke: a tiny model, to try the script (its figures mean nothing)."""


def memory(pid: int | None = None) -> dict[str, float]:
    """MB: RssAnon, RssFile (status) and Pss_Anon, Pss_File (smaps_rollup) of process `pid`."""
    pid = pid or os.getpid()
    found: dict[str, float] = {}
    for name in ("status", "smaps_rollup"):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "Pss_Anon", "Pss_File"):
                found[key] = round(int(value.split()[0]) / 1024, 1)
    return found


def _args(folder: Path) -> dict[str, str]:
    """initialize()'s args for the model in `folder`, as Triton passes them."""
    from google.protobuf.json_format import MessageToDict

    from bionemo_export.model_repository.pbtxt import read_config

    config = MessageToDict(read_config(folder), preserving_proto_field_name=True)
    return {"model_config": json.dumps(config), "model_name": folder.name, "model_instance_kind": "CPU"}


def _feed(rows: int, length: int, vocab: int = 33) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 24, size=(rows, length)).astype(np.int64)
    ids[:, 0], ids[:, -1] = 0, 2
    del vocab
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def worker(spec: dict[str, Any]) -> None:
    """One served instance: opens its sessions, runs one request on each, prints its memory, then
    waits for a line on stdin (so that the parent reads every instance's memory while all live)."""
    from bionemo_export.serving.onnx_session import create_session

    feed = _feed(2, 64)
    sessions = []
    baseline = memory()  # the interpreter, numpy, onnxruntime: before any session
    if spec["kind"] == "before":  # one old graph model: its own weights, ONNX Runtime's defaults
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.enable_cpu_mem_arena = False
        sessions.append(ort.InferenceSession(spec["graph"], options, providers=["CPUExecutionProvider"]))
    else:  # N_encoder's instance: as its model.py opens its sessions
        folder = Path(spec["folder"])
        args, here = _args(folder), str(folder / "1")
        session, parameters = create_session(args, here, prepack=spec["prepack"])
        sessions.append(session)
        hosted = json.loads(parameters["hosted_graphs"])
        for entry in hosted.values():
            sessions.append(create_session(args, here, entry["file"], prepack=False,
                                           level=entry["graph_optimization_level"])[0])
    loaded = memory()  # the sessions opened (the served model's golden checks run too), no request yet
    for session in sessions:
        inputs = {value.name: value for value in session.get_inputs()}
        run_feed = {name: feed[name] for name in inputs if name in feed}
        if "residue_mask" in inputs:
            run_feed["residue_mask"] = feed["attention_mask"].astype(bool)
        session.run(None, run_feed)
    print(json.dumps({"pid": os.getpid(), **memory(), "RssAnon before the sessions": baseline["RssAnon"],
                      "RssAnon with the sessions opened": loaded["RssAnon"]}), flush=True)
    sys.stdin.readline()


def _instances(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Start a worker per spec, all alive together; each one's memory read by this process too."""
    processes = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for spec in specs]
    reports = []
    try:
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker failed: {specs[processes.index(process)]}")
            reports.append(json.loads(line))
        for report in reports:  # once all are loaded: the shared pages are divided among them all
            report.update({f"{key} (all loaded)": value for key, value in memory(report["pid"]).items()})
    finally:
        for process in processes:
            if process.stdin:
                process.stdin.close()
            process.wait(timeout=60)
    return reports


def _median_seconds(run, repeats: int) -> float:
    run()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(encoder: Path, before_layers: Path, after_layers: Path, rows: int, length: int,
          repeats: int) -> dict[str, Any]:
    """Seconds per batch, alternated in one process: the encoder graph prepacked and mapped, the
    layers graph before (own weights, prepacked) and after (mapped)."""
    import onnxruntime as ort

    def session(path: Path, prepack: bool, level: Any) -> Any:
        options = ort.SessionOptions()
        options.intra_op_num_threads = len(os.sched_getaffinity(0))
        options.enable_cpu_mem_arena = False
        options.graph_optimization_level = level
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    feed = _feed(rows, length)
    encoder_feed = {**feed, "residue_mask": feed["attention_mask"].astype(bool)}
    basic, full = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    runs = {"encoder embeddings, prepacked (served default)":
            (session(encoder, True, basic), ["embeddings"], encoder_feed),
            "encoder embeddings, mapped (prepack_weights false)":
            (session(encoder, False, basic), ["embeddings"], encoder_feed),
            "layers graph before (own weights, prepacked)": (session(before_layers, True, full), None, feed),
            "layers graph after (mapped weights.bin)": (session(after_layers, False, full), None, feed)}
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):  # alternated rounds: a neighbour's load falls on every variant alike
        for name, (runner, outputs, run_feed) in runs.items():
            figures[name].append(_median_seconds(lambda r=runner, o=outputs, f=run_feed: r.run(o, f), repeats))
    return {"rows": rows, "length": length, "repeats": repeats,
            "seconds per batch (median of rounds)": {name: round(statistics.median(values), 4)
                                                     for name, values in figures.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=SUMMARY)
    parser.add_argument("--shape", default="esm2_t12_35M")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=None, help="keep the build here (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="measure the build already in --work/repo")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shared_weights.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        worker(json.loads(options.worker))
        return
    import onnx

    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.model_repository.graph_io import initializer_bytes, repository_weight_bytes
    from bionemo_export.model_repository.manifest import package_versions
    from bionemo_export.testing.large_checkpoints import write_random_checkpoint

    work = options.work or Path(tempfile.mkdtemp(prefix="shared_weights_"))
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = os.getloadavg()
    started = time.perf_counter()
    if options.reuse:
        from bionemo_export.model_repository.manifest import Manifest

        repository, build_seconds = work / "repo", None
        tasks = Manifest.read(repository).tasks
    else:
        checkpoint = write_random_checkpoint("esm2", work / "checkpoint",
                                             SMOKE_SHAPE if options.shape == "smoke" else options.shape)
        result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="sw", out=work / "repo",
                                               backend="python", force=True, graph_cache=None), progress=print)
        repository, tasks = result.repository, result.manifest.tasks
        build_seconds = round(time.perf_counter() - started, 1)
    encoder = repository / "sw_encoder"
    version = encoder / "1"
    # Before: each graph with its weights inside, in a folder of its own (as its model's was).
    before: dict[str, Path] = {}
    for name, file in {"encoder": "model.onnx", **{task: f"{task}.onnx" for task in HOSTED}}.items():
        model = onnx.load(str(version / file))  # its weights read in from weights.bin
        for tensor in model.graph.initializer:
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
        (work / "before" / name).mkdir(parents=True, exist_ok=True)
        before[name] = work / "before" / name / "model.onnx"
        onnx.save_model(model, str(before[name]))
    one_copy = initializer_bytes(version / "model.onnx")
    stored_after = repository_weight_bytes(repository)
    heads = sum(initializer_bytes(path) for path in repository.rglob("*.onnx") if encoder not in path.parents)
    stored_before = sum(initializer_bytes(path) for path in before.values()) + heads
    bytes_record = {"one fp32 copy (the encoder graph's weights)": one_copy,
                    "before: every graph its own weights (+ the masked-LM head's graph)": stored_before,
                    "after: the repository's weight bytes (weights.bin once, + the head's graph)": stored_after,
                    "before / one copy": round(stored_before / one_copy, 3),
                    "after / one copy": round(stored_after / one_copy, 3)}
    print(json.dumps(bytes_record, indent=1))
    before_memory = _instances([{"kind": "before", "graph": str(path), "name": name} for name, path in before.items()])
    for report, name in zip(before_memory, before):
        report["model"] = f"sw_{name}" if name == "encoder" else f"sw_{name[:-1]}_graph (before)"
    after_memory = _instances([{"kind": "after", "folder": str(encoder), "prepack": True}] * 2)
    after_mapped = _instances([{"kind": "after", "folder": str(encoder), "prepack": False}] * 2)
    figures = speed(version / "model.onnx", before["layers"], version / "layers.onnx", options.rows, options.length,
                    options.repeats)
    record = {
        "what": SUMMARY,
        "command": "python benchmarks/shared_weights.py " + " ".join(argv or sys.argv[1:]),
        "started": started_at, "load_average_at_start": [round(value, 2) for value in load],
        "host": {"cores": len(os.sched_getaffinity(0)), "note": "a 2-core machine shared with other sessions' work: "
                 "compare figures side by side, not with other hosts"},
        "shape": options.shape, "build_seconds": build_seconds, "tasks": tasks,
        "versions": package_versions(),
        "weight_bytes": bytes_record,
        "memory_mb": {
            "before: one process per graph model (each prepacks its own weights)": before_memory,
            "after: two N_encoder instances (encoder prepacked, hosted graphs mapped)": after_memory,
            "after, prepack_weights false: two N_encoder instances (every graph mapped)": after_mapped,
        },
        "speed": figures,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(record, indent=1) + "\n")
    options.out.with_suffix(".md").write_text(markdown(record))
    print(json.dumps(record, indent=1))


def markdown(record: dict[str, Any]) -> str:
    """The report's page (the JSON beside it holds every figure)."""
    weights = record["weight_bytes"]
    lines = [f"# Shared weights: {record['shape']}", "", SUMMARY.replace("\n", " "), "",
             f"Run {record['started']} (load average {record['load_average_at_start']} at the start; "
             f"{record['host']['note']}); `{record['command']}`; every figure in "
             "`benchmarks/results/shared_weights.json`.", "", "## Weight bytes", "", "| | bytes |", "|---|---|"]
    lines += [f"| {key} | {value:,} |" if isinstance(value, int) else f"| {key} | {value} |"
              for key, value in weights.items()]
    lines += ["", "## Resident memory per process (MB, every process of the row loaded)", "",
              "RssAnon: private memory after one request to every graph (the interpreter, onnxruntime, the "
              "prepacked weights, the requests' freed activations); before the sessions, and with them opened "
              "(before any request), beside it. RssFile counts a file's pages once per mapping (each hosted "
              "session maps weights.bin); Pss_File divides each physical page among the processes mapping it.",
              "", "| processes | RssAnon (before sessions / opened / after requests) | RssFile "
              "| Pss_File (file pages, shared) |", "|---|---|---|---|"]
    for name, reports in record["memory_mb"].items():
        for report in reports:
            anon = (report.get("RssAnon before the sessions"), report.get("RssAnon with the sessions opened"),
                    report["RssAnon (all loaded)"])
            lines.append(f"| {name}: {report.get('model', 'N_encoder instance')} | {' / '.join(map(str, anon))}"
                         f" | {report['RssFile (all loaded)']} "
                         f"| {report['Pss_File (all loaded)']} |")
        total = sum(r["Pss_Anon (all loaded)"] + r["Pss_File (all loaded)"] for r in reports)
        lines.append(f"| {name}: **total Pss** | | | **{total:.1f}** |")
    figures = record["speed"]
    lines += ["", f"## Speed ({figures['rows']} rows x {figures['length']} tokens, seconds per batch)", "",
              "| graph | s |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in figures["seconds per batch (median of rounds)"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
