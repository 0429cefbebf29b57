"""Builds of the released models' real shapes (random weights: bionemo_export/testing/large_checkpoints.py)
with default options: build time, peak resident memory (and its ratio to the fp32 weights), where
in the build the peak was, repository bytes, and the served encoder graph's embeddings against
transformers' own model on the same checkpoint (issue 46, items 1 and 5).

    .venv/bin/python benchmarks/model_sizes.py --shapes esm2_t30_150M esm2_t33_650M
    .venv/bin/python benchmarks/model_sizes.py --shapes esm2_t36_3B --work /tmp/sizes --shared
    .venv/bin/python benchmarks/model_sizes.py --shapes esm2_t30_150M --precision int4 \
        --out benchmarks/results/model_sizes_int4.json
    .venv/bin/python benchmarks/model_sizes.py --shapes esm2_t48_15B --dtype fp16 --precision int4 \
        --min-cosine 0.001 --serve --work /tmp/sizes15b --out benchmarks/results/model_sizes_esm2_15b_int4.json

Each build runs in a child process of its own (`--build`), which samples its own /proc/self/status
every 50 ms (VmRSS, RssAnon, RssFile) and tags each sample with the build's progress line, so the
JSON says which step peaked; the kernel's VmHWM is recorded too. The accuracy check runs in another
child (`--check`): transformers' EsmModel (EsmcModel) from the same folder computes the hidden
states, mean-pooled over the residues as the repository's embeddings are, then the repository's
stored encoder graph runs under ONNX Runtime on the same batch.

A checkpoint whose fp32 weights exceed half the host's memory (ESM C 6B) is checked against
transformers' model run one layer's weights at a time (testing/streamed_reference.py), and for the
weight-only precisions also against that model computing with the graph's own rounded weights (the
graph's implementation, apart from what rounding costs). `--serve` then serves the repository with
a real `bionemo-export serve` and measures the resident memory of tritonserver and its stubs and the
embeddings throughput of CHECK_SEQUENCES sent through gRPC.

    .venv/bin/python benchmarks/model_sizes.py --family esmc --shapes esmc_6b --precision int4 \
        --min-cosine 0.1 --serve --work /tmp/sizes6b --out benchmarks/results/model_sizes_esmc_6b_int4.json

`--min-cosine` is the build's option (a random checkpoint keeps far less of itself at 4 bits than a
trained one: docs/building.md); the figures against both references are what the JSON reports.

`--shared` records that other work ran on the machine at the same time (seconds then mean little;
memory is the process's own either way).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "model_sizes.json"
SAMPLE_SECONDS = 0.05
CHECK_SEQUENCES = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSP",
    "MSLKRKNIALIPAAGIGVRFG",
    "LAGVSERTIDPKQNFYMHWC",
    "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG",
]
"""The accuracy check's proteins: lengths 20-110, padded together in one batch."""


def _status() -> dict[str, int]:
    """This process's VmRSS, RssAnon, RssFile and VmHWM in bytes."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


class Sampler:
    """Samples this process's memory every SAMPLE_SECONDS in a thread, keeping each step's peak."""

    def __init__(self) -> None:
        self.step = "start"
        self.steps: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.perf_counter()

    def mark(self, step: str) -> None:
        self.sample()
        self.step = step
        self.steps.setdefault(step, {"started_s": round(time.perf_counter() - self._start, 1)})
        self.sample()

    def sample(self) -> None:
        now = _status()
        peak = self.steps.setdefault(self.step, {"started_s": 0.0})
        for key in ("VmRSS", "RssAnon", "RssFile"):
            peak[key] = max(peak.get(key, 0), now[key])

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def child_build(checkpoint: Path, family: str, out: Path, extra: dict[str, Any],
                threshold: int | None = None) -> dict[str, Any]:
    """Build `checkpoint` into `out` with default options in this process, sampling its memory.
    `threshold` (a diagnosis, not a default build): the external-data threshold lowered, so a small
    model takes the path with its weights left on disk."""
    from bionemo_export.build import BuildRequest, build_repository

    if threshold is not None:
        from bionemo_export.exporters import onnx_export
        from bionemo_export.exporters.optimize import candidates

        onnx_export.EXTERNAL_DATA_THRESHOLD_BYTES = candidates.INLINE_LIMIT_BYTES = threshold

    sampler = Sampler()
    baseline = _status()
    start = time.perf_counter()
    with sampler:
        sampler.mark("imports and checks")
        build_repository(BuildRequest(family=family, checkpoint=checkpoint, name="model", out=out, force=True,
                                      graph_cache=None, **extra), progress=sampler.mark)
    seconds = time.perf_counter() - start
    final = _status()
    peak_step = max(sampler.steps, key=lambda step: sampler.steps[step].get("VmRSS", 0))
    return {"seconds": round(seconds, 1), "baseline_rss": baseline["VmRSS"], "vm_hwm": final["VmHWM"],
            "peak_rss_sampled": max(s.get("VmRSS", 0) for s in sampler.steps.values()),
            "peak_anon_sampled": max(s.get("RssAnon", 0) for s in sampler.steps.values()),
            "peak_step": peak_step, "steps": sampler.steps}


def child_check(checkpoint: Path, family: str, repository: Path, precision: str = "fp32") -> dict[str, Any]:
    """Embeddings of CHECK_SEQUENCES from transformers' model on `checkpoint` against the
    repository's stored encoder graph (fp32 reference; each freed before the next is opened).
    Weights over half the host's memory: the model run one layer's weights at a time, and for
    int8w/int4 also with the weights rounded as the graph stores them (`rounded_weights`)."""
    import gc

    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    from bionemo_export.models import get_family
    from bionemo_export.models.readers.base import fp32_weight_bytes
    from bionemo_export.procfs import available_memory_bytes
    from bionemo_export.testing.streamed_reference import streamed_hidden_states

    loaded_tokenizer = get_family(family).build_tokenizer(checkpoint, None, None)  # type: ignore[attr-defined]
    encoded = loaded_tokenizer.encode(CHECK_SEQUENCES, truncate=True)
    ids = torch.from_numpy(np.asarray(encoded.input_ids))
    mask = torch.from_numpy(np.asarray(encoded.attention_mask))
    residues = torch.from_numpy(np.asarray(encoded.residue_mask)).bool()
    model_class = transformers.EsmModel if family == "esm2" else transformers.EsmcModel
    weights = residues.unsqueeze(-1).float()
    streamed = fp32_weight_bytes(checkpoint) > (available_memory_bytes() or 0) / 2
    references = {}
    if streamed:
        start = time.perf_counter()
        hiddens = streamed_hidden_states(model_class, checkpoint, ids, mask)
        references["transformers"] = ((hiddens * weights).sum(1) / weights.sum(1)).numpy()
        print(f"layer-by-layer reference: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        if precision in ("int8w", "int4"):
            hiddens = streamed_hidden_states(model_class, checkpoint, ids, mask,
                                             weight_bits={"int8w": 8, "int4": 4}[precision])
            references["rounded_weights"] = ((hiddens * weights).sum(1) / weights.sum(1)).numpy()
    else:
        reference = model_class.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        with torch.inference_mode():
            hiddens = reference(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        references["transformers"] = ((hiddens * weights).sum(1) / weights.sum(1)).numpy()
        del reference
    del hiddens
    gc.collect()
    graph = _encoder_graph(repository)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.asarray(encoded.input_ids), "attention_mask": np.asarray(encoded.attention_mask),
             "residue_mask": np.asarray(encoded.residue_mask)}
    names = [value.name for value in session.get_inputs()]
    got = np.asarray(session.run(["embeddings"], {name: feeds[name] for name in names})[0])
    result: dict[str, Any] = {"graph": str(graph.relative_to(repository)), "sequences": len(CHECK_SEQUENCES),
                              "reference": "layer by layer" if streamed else "whole model"}
    for label, expected in references.items():
        figures = _compared(got, expected)
        result.update(figures) if label == "transformers" else result.update({label: figures})
    np.save(_reference_file(repository), references["transformers"])  # what the served answers are held to
    return result


def _compared(got: Any, expected: Any) -> dict[str, float]:
    """Max abs error and the least cosine of `got`'s rows against `expected`'s."""
    import numpy as np

    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    cosine = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    return {"max_abs_error": float(np.abs(got - expected).max()), "min_cosine": float(cosine.min())}


def _reference_file(repository: Path) -> Path:
    """transformers' embeddings of CHECK_SEQUENCES, written by the check beside the repository."""
    return repository.with_name(repository.name + ".reference.npy")


def child_serve(repository: Path, rounds: int = 5) -> dict[str, Any]:
    """Serve `repository` with `bionemo-export serve` (real tritonserver), then: seconds to ready,
    resident memory of the server and its stubs once the encoder answered, and embeddings of
    CHECK_SEQUENCES sent `rounds` times (sequences per second, the median round)."""
    import signal
    import statistics
    import urllib.request

    import numpy as np

    from bionemo_export import procfs
    from bionemo_export.client.triton import TritonClient, strings_to_tensor
    from bionemo_export.runtime.server import free_ports

    http, grpc, metrics = free_ports(3)
    log = repository.parent / f"{repository.name}.serve.log"
    command = [str(Path(sys.executable).parent / "bionemo-export"), "serve", str(repository), "--http-port", str(http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--timeout", "3600"]
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"serve ended ({process.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        ready = time.perf_counter() - start
        name = next(path.name.removesuffix("_embeddings") for path in repository.glob("*_embeddings"))
        client = TritonClient(f"grpc://127.0.0.1:{grpc}", timeout_s=3600)
        rounds_s, answers = [], []
        for _ in range(rounds):
            begin = time.perf_counter()
            answers.append(client.infer(f"{name}_embeddings", {"sequences": strings_to_tensor(CHECK_SEQUENCES)}))
            rounds_s.append(time.perf_counter() - begin)
        accuracy = {}
        if _reference_file(repository).exists():  # the served answers against transformers' (the check's)
            expected = np.load(_reference_file(repository))
            accuracy = {"embeddings_vs_transformers": _compared(answers[0]["embeddings"], expected),
                        "rounds_identical": all(np.array_equal(a["embeddings"], answers[0]["embeddings"])
                                                for a in answers)}
        processes = [stat.pid for stat in procfs.children(process.pid)]
        processes += [stat.pid for pid in list(processes) for stat in procfs.children(pid)]
        memory = {part: sum(procfs.memory_bytes(pid, part) for pid in processes) for part in ("VmRSS", "RssAnon")}
        return {"seconds_to_ready": round(ready, 1), "processes": len(processes), "rss_bytes": memory["VmRSS"],
                "rss_anon_bytes": memory["RssAnon"], "sequences": len(CHECK_SEQUENCES),
                "sequences_per_second": round(len(CHECK_SEQUENCES) / statistics.median(rounds_s), 3),
                "rounds_s": [round(value, 3) for value in rounds_s], **accuracy}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def _encoder_graph(repository: Path) -> Path:
    """The model.onnx of the repository's encoder model (the folder named *_encoder)."""
    graphs = sorted(repository.glob("*_encoder/1/model.onnx"))
    if not graphs:
        raise SystemExit(f"{repository} has no *_encoder/1/model.onnx")
    return graphs[0]


def _tree_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _run_child(arguments: list[str]) -> dict[str, Any]:
    process = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True, check=False)
    if process.returncode:
        raise SystemExit(f"{' '.join(arguments)} failed ({process.returncode}):\n{process.stderr[-4000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def measure(family: str, shape: str, work: Path, keep: bool, precision: str = "fp32", min_cosine: float | None = None,
            serve: bool = False, dtype: str | None = None, reuse_build: bool = False) -> dict[str, Any]:
    """Write the checkpoint (unless there) in `dtype` (None: as the family's released weights), build it
    in a child (or, `reuse_build`, take the build recorded beside the repository), check it in another."""
    import torch

    from bionemo_export.memory_plan import IN_MEMORY, STREAMED, WEIGHTS_ON_DISK
    from bionemo_export.models.readers.base import fp32_weight_bytes
    from bionemo_export.testing.large_checkpoints import DEFAULT_DTYPES, write_random_checkpoint

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    checkpoint = work / (shape if dtype is None else f"{shape}.{dtype}")
    if not (checkpoint / "model.safetensors").exists():
        start = time.perf_counter()
        write_random_checkpoint(family, checkpoint, shape, dtype=dtypes[dtype] if dtype else None)
        print(f"{shape}: wrote {checkpoint} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    weights = fp32_weight_bytes(checkpoint)
    repository = work / f"{shape}.{precision}.repository"
    record = work / f"{shape}.{precision}.build.json"  # kept: a check or serve that fails need not build again
    if reuse_build and record.exists() and (repository / "manifest.json").exists():
        build = json.loads(record.read_text())
        print(f"{shape}: the build recorded in {record} is reused", file=sys.stderr)
    else:
        build = _run_child(["--build", str(checkpoint), "--family", family, "--repository", str(repository),
                            "--precision", precision, *(["--min-cosine", str(min_cosine)] if min_cosine else [])])
        record.write_text(json.dumps(build, indent=1) + "\n")
    print(f"{shape}: built in {build['seconds']} s, VmHWM {build['vm_hwm'] / 2**30:.2f} GiB", file=sys.stderr)
    check = _run_child(["--check", str(checkpoint), "--family", family, "--repository", str(repository),
                        "--precision", precision])
    print(f"{shape}: checked {check}", file=sys.stderr)
    served = _run_child(["--serve", str(repository)]) if serve else None
    manifest = json.loads((repository / "manifest.json").read_text())
    result = {
        "family": family, "shape": shape, "checkpoint_dtype": str(dtypes[dtype] if dtype else
                                                                 DEFAULT_DTYPES[family]).removeprefix("torch."),
        "checkpoint_bytes": _tree_bytes(checkpoint), "fp32_weight_bytes": weights,
        **({"build_record": build["source"]} if "source" in build else {}),
        "build_seconds": build["seconds"], "peak_rss_bytes": build["vm_hwm"],
        "peak_rss_over_fp32_weights": round(build["vm_hwm"] / weights, 2),
        "peak_anon_bytes": build["peak_anon_sampled"],
        "peak_anon_over_fp32_weights": round(build["peak_anon_sampled"] / weights, 2),
        "baseline_rss_bytes": build["baseline_rss"], "peak_step": build["peak_step"], "steps": build["steps"],
        "repository_bytes": _tree_bytes(repository), "tasks": manifest.get("tasks"),
        "precision": manifest.get("precision"),
        "optimization": {name: graph.get("optimization", {}).get("applied") for name, graph in
                         manifest.get("export", {}).items()},
        "skipped": {name: graph.get("optimization", {}).get("skipped") for name, graph in
                    manifest.get("export", {}).items()},
        "embeddings_vs_transformers": check,
        "build_path": next((path for path in (IN_MEMORY, WEIGHTS_ON_DISK, STREAMED)
                            if any(step.startswith("memory:") and f", {path}" in step for step in build["steps"])),
                           None),
        "min_cosine_asked": min_cosine,
    }
    if served is not None:
        result["served"] = served
    if not keep:
        shutil.rmtree(repository)
    return result


def _versions() -> dict[str, str]:
    names = ("bionemo-export", "torch", "onnx", "onnxruntime", "transformers", "safetensors", "numpy")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["esm2_t30_150M", "esm2_t33_650M"])
    parser.add_argument("--family", default="esm2", choices=("esm2", "esmc"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/bionemo-model-sizes"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8", "int8w", "int4"),
                        help="the build's --precision (the check compares its graph with fp32 transformers)")
    parser.add_argument("--shared", action="store_true", help="other work ran on the machine meanwhile")
    parser.add_argument("--keep", action="store_true", help="keep the repositories")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--check", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repository", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threshold", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--min-cosine", type=float, help="the build's --min-cosine (reduced precisions)")
    parser.add_argument("--serve", nargs="?", const=True, default=False, help="serve each repository and measure it")
    parser.add_argument("--reuse-build", action="store_true",
                        help="take a build recorded in WORK (SHAPE.PRECISION.build.json) with its repository")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                        help="the checkpoint's dtype (default: the family's released one, ESM-2 fp32, ESM C bf16)")
    args = parser.parse_args()
    if args.build:
        extra = {"precision": args.precision, **({"min_cosine": args.min_cosine} if args.min_cosine else {})}
        print(json.dumps(child_build(args.build, args.family, args.repository, extra, args.threshold)))
        return
    if args.check:
        print(json.dumps(child_check(args.check, args.family, args.repository, args.precision)))
        return
    if isinstance(args.serve, str):
        print(json.dumps(child_serve(Path(args.serve))))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    from bionemo_export.procfs import cpu_model

    results = []
    for shape in args.shapes:
        results.append(measure(args.family, shape, args.work, args.keep, args.precision, args.min_cosine,
                               bool(args.serve), args.dtype, args.reuse_build))
        report = {
            "command": " ".join([".venv/bin/python", "benchmarks/model_sizes.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE")
                        * os.sysconf("SC_PHYS_PAGES"), "platform": platform.platform()},
            "shared": args.shared, "versions": _versions(), "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps([{k: r[k] for k in ("shape", "build_seconds", "peak_rss_over_fp32_weights", "peak_step",
                                         "embeddings_vs_transformers")} for r in results], indent=1))


if __name__ == "__main__":
    main()
