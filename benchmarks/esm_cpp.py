"""esm.cpp against bionemo-export on CPUs, side by side in one run (issue 47).

    .venv/bin/python benchmarks/esm_cpp.py                                 # ESM-2 35M, 150M, 650M shapes
    .venv/bin/python benchmarks/esm_cpp.py --shapes esm2_t30_150M --rounds 7
    .venv/bin/python benchmarks/esm_cpp.py --quick                         # smoke: 8M shape, a few proteins

Installs nothing: esm-cpp (PyPI, 0.2.1) comes with `make setup` (requirements/lock.txt; elsewhere
pyproject's `bench` extra), and without it the script says how to install it. Per ESM-2 shape (random weights of the
released model's shape, bionemo_export/testing/large_checkpoints.py; fp32 safetensors as released),
on the same proteins, these targets:

- `HF eager fp32`: transformers' EsmModel (attn_implementation="eager"), the proteins sorted by
  length in batches of 8, each padded to its longest row (esm.cpp's own comparison's baseline,
  sorted so that it pads little). Its embeddings are the accuracy reference.
- `esm.cpp fp32`, `esm.cpp int8`: esm.cpp's Python API on the same weights (plus the rotary
  `inv_freq` tensors its loader wants, which transformers does not save: 1 / 10000^(2i/d)),
  `forward_scheduled` (its packed, length-bucketed scheduler) over the whole workload at once.
  int8 is esm.cpp's own recipe: calibration (ActivationObserver over 32 proteins of UniProt-like
  lengths drawn with another seed, 99.9th percentile), apply_smoothquant(alpha 0.5),
  quantize_weights (W8A8, per-channel int8 weights; lm_head stays fp32). esm.cpp returns logits
  only, so its timed runs include its lm_head (a 2-matrix head over 30-33 blocks: under 1 %).
- `in process <precision>`: the repository's encoder in this process through the served code
  (bionemo_export/bench/in_process.py: the served session, length buckets and token budget).
- `served <precision>`: the repository served by the real tritonserver, the workload sent by the
  Python client (`RepositoryClient.seqs_to_embedding`) with its defaults (requests of the model's
  max_batch_size, 4 in flight), over gRPC: tokenizing, Triton and the Python backend included.
  The repositories are built as `build repo --precision P` builds them, without the queue timeout
  (`build()`); `--precisions auto` builds what `build repo --precision auto` chooses here.
- `served <precision>, rows as given` (`--as-given`, default int8): the same client and server,
  the rows sent in the workload's order instead of shortest first (`infer_rows` without `order`:
  what the client did before it sorted), so that each request's rows span the server's length
  buckets: the client-order lever, side by side.

Workloads: `uniform` (8 proteins of 254 residues: 256 tokens), `antibody` (256 proteins of
106-146 residues, mean 126: the mean of esm.cpp's OAS sample), `uniprot` (96 proteins with
UniProt-like lengths: log-normal, median 300, sigma 0.6, 30-1000 residues).

Accuracy beside speed: each target's embeddings (the last hidden state's mean over residues)
against HF eager fp32's, min and mean cosine over the proteins (esm.cpp's from
`forward_with_hidden_states`, protein by protein, whose last state is transformers'
last_hidden_state; their passes for accuracy are their warm-up). Timing: `--rounds` rounds,
each running every target once over every workload (interleaved, so a disturbance hits all
targets alike); sequences/s of the best round and the median round. Results:
benchmarks/results/esm_cpp.json and esm_cpp.md (with the command, host and versions).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import cast

import numpy as np
import torch

from bionemo_export.bench.in_process import InProcessEncoder
from bionemo_export.bench.inputs import LengthDistribution, random_proteins
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.model_repository.manifest import Manifest, package_versions
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.serving.host import available_cores, cpu_description
from bionemo_export.testing.large_checkpoints import ESM2_SHAPES, write_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = {"uniform": ("fixed:254", 8), "antibody": ("uniform:106-146", 256), "uniprot": ("uniprot", 96)}
"""Name -> (length distribution, proteins)."""
QUICK_WORKLOADS = {"uniform": ("fixed:62", 4), "antibody": ("uniform:26-46", 16), "uniprot": ("uniform:30-200", 8)}
HF_BATCH = 8
CALIBRATION = ("uniprot", 32, 1)
"""esm.cpp's int8 calibration set: distribution, proteins, seed (not the benchmark's seed)."""

Embed = Callable[[list[str]], np.ndarray]


def esm_cpp_module():
    # This script is named esm_cpp.py too: with its folder first on sys.path (python runs it so),
    # `import esm_cpp` would find the script itself.
    here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    sys.modules.pop("esm_cpp", None) if getattr(sys.modules.get("esm_cpp"), "__file__", "") == __file__ else None
    try:  # by name: an optional package (the `bench` extra), typed as Any where it is absent
        return importlib.import_module("esm_cpp")
    except ImportError:
        sys.exit("esm-cpp is not installed: `make setup` installs it (requirements/lock.txt), or "
                 "`pip install 'esm-cpp==0.2.1'`; then run this again")


def proteins(distribution: str, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return random_proteins(LengthDistribution.parse(distribution).sample(count, rng), rng)


# ------------------------------------------------------------------------------ targets
def with_rotary_frequencies(checkpoint: Path) -> Path:
    """checkpoint/esmcpp.safetensors: the checkpoint's tensors plus each layer's rotary
    `inv_freq` (1 / 10000^(arange(0, d, 2) / d), d the head size), which esm.cpp's loader requires
    and transformers 5 does not save."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    inv_freq = (1.0 / 10000 ** (np.arange(0, head, 2, dtype=np.float32) / head)).astype(np.float32)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        tensors[f"esm.encoder.layer.{layer}.attention.self.rotary_embeddings.inv_freq"] = inv_freq
    path = checkpoint / "esmcpp.safetensors"
    save_file(tensors, str(path))
    return path


class HuggingFace:
    """transformers' EsmModel, eager attention, fp32: sorted batches of HF_BATCH padded to their longest."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import EsmModel, EsmTokenizer

        self.model = EsmModel.from_pretrained(str(checkpoint), attn_implementation="eager",
                                              add_pooling_layer=False).eval()
        self.tokenizer = EsmTokenizer.from_pretrained(str(checkpoint))

    def __call__(self, sequences: list[str]) -> np.ndarray:
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = np.empty((len(sequences), self.model.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), HF_BATCH):
                rows = order[start:start + HF_BATCH]
                batch = self.tokenizer([sequences[i] for i in rows], return_tensors="pt", padding=True)
                hidden = self.model(**batch).last_hidden_state
                residues = batch["attention_mask"].clone()
                residues[:, 0] = 0  # <cls>
                residues[torch.arange(len(rows)), batch["attention_mask"].sum(1) - 1] = 0  # <eos>
                pooled = (hidden * residues[..., None]).sum(1) / residues.sum(1, keepdim=True)
                out[rows] = pooled.numpy()
        return out


class EsmCpp:
    """esm.cpp on the same weights: `forward_scheduled` for speed, protein by protein with hidden
    states for accuracy; int8 by esm.cpp's own calibration + SmoothQuant recipe."""

    def __init__(self, weights: Path, int8: bool, calibration: list[str]) -> None:
        esm_cpp = esm_cpp_module()
        self.model = esm_cpp.Model.load_from_safetensors(str(weights))
        self.tokenizer = esm_cpp.Tokenizer()
        if int8:
            observer = esm_cpp.ActivationObserver()
            for sequence in calibration:
                ids = self.ids(sequence)
                self.model.forward_with_observer(ids, np.ones_like(ids), observer)
            self.model.apply_smoothquant(observer.percentile(99.9), 0.5)
            self.model.quantize_weights()

    def ids(self, sequence: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(sequence), dtype=np.int32)

    def __call__(self, sequences: list[str]) -> None:
        self.model.forward_scheduled([self.ids(sequence) for sequence in sequences])

    def embeddings(self, sequences: list[str]) -> np.ndarray:
        rows = []
        for sequence in sequences:
            _, states = self.model.forward_with_hidden_states(self.ids(sequence))
            rows.append(states[-1][1:-1].mean(axis=0))
        return np.stack(rows).astype(np.float32)


def build(checkpoint: Path, out: Path, precision: str) -> Path:
    """The repository as `build repo` makes it, but for admission control: no queue timeout (a
    request of 32 UniProt-length proteins to the 650M shape takes longer than the default 30 s on
    2 cores, and the client keeps 4 requests in flight: the ones queued behind it would be turned
    away)."""
    if not (out / "manifest.json").exists():
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2", out=out, backend="python",
                                      tasks=("embeddings",), precision=precision, force=True,
                                      serving=ServingOptions(queue_timeout_s=0)))
    return out


def as_given(client) -> Embed:
    """`client.seqs_to_embedding` with the rows sent in the caller's order, not shortest first."""
    from bionemo_export.client import infer_rows

    def embed(sequences: list[str]) -> np.ndarray:
        column = np.array([[s.encode()] for s in sequences], dtype=object)
        return infer_rows(client.client, client.model("embeddings"), len(sequences),
                          lambda rows, _: {"sequences": column[rows]}, outputs=["embeddings"],
                          batch_size=client.batch_size, in_flight=client.in_flight).outputs["embeddings"]

    return embed


# ------------------------------------------------------------------------------ measuring
def cosines(embeddings: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    dots = (embeddings * reference).sum(1)
    cos = dots / (np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1))
    return {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "max_abs": float(np.abs(embeddings - reference).max())}


def measure_shape(shape: str, args, work: Path) -> dict:
    from bionemo_export.client import RepositoryClient
    from bionemo_export.runtime import TritonServer, find_tritonserver

    sizes = ESM2_SHAPES[shape]
    checkpoint = work / shape
    if not (checkpoint / "model.safetensors").exists():
        write_random_checkpoint("esm2", checkpoint, shape)
    weights = with_rotary_frequencies(checkpoint)
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    inputs = {name: proteins(distribution, min(count, args.max_proteins or count), args.seed)
              for name, (distribution, count) in workloads.items() if name in args.workloads}
    calibration = proteins(*CALIBRATION[:2], seed=CALIBRATION[2])
    built = {precision: build(checkpoint, work / f"{shape}_{precision}", precision) for precision in args.precisions}
    # `auto` is labelled with what it chose here ("auto: int8"), so its ratios are against the right peer.
    repos = {(f"auto: {Manifest.read(repo).precision}" if precision == "auto" else precision): repo
             for precision, repo in built.items()}
    tokenizer = get_family("esm2").load(checkpoint).tokenizer

    hf = HuggingFace(checkpoint)
    reference = {name: hf(sequences) for name, sequences in inputs.items()}
    cpp = {"fp32": EsmCpp(weights, False, calibration), "int8": EsmCpp(weights, True, calibration)}
    targets: dict[str, Embed | Callable[[list[str]], object]] = {"HF eager fp32": hf}
    targets.update({f"esm.cpp {kind}": model for kind, model in cpp.items()})
    accuracy: dict[str, dict[str, dict[str, float]]] = {}
    for kind, model in cpp.items():
        accuracy[f"esm.cpp {kind}"] = {name: cosines(model.embeddings(seqs), reference[name])
                                       for name, seqs in inputs.items()}
    encoders: dict[str, InProcessEncoder] = {}
    if shape in args.in_process:
        for precision, repo in repos.items():
            encoders[f"in process {precision}"] = InProcessEncoder(repo, "esm2", tokenizer)
            targets[f"in process {precision}"] = encoders[f"in process {precision}"].embeddings
    servers, clients = [], []
    try:
        for precision, repo in repos.items():
            server = TritonServer(repo, install=find_tritonserver(), log_file=work / f"{shape}_{precision}.log")
            server.start()
            servers.append(server)
            client = RepositoryClient("esm2", f"grpc://{server.endpoints.grpc_url}")
            clients.append(client)
            targets[f"served {precision}"] = client.seqs_to_embedding
            if precision.removeprefix("auto: ") in args.as_given:
                targets[f"served {precision}, rows as given"] = as_given(client)
        # Warm-up and accuracy of ours (HF's and esm.cpp's passes above were theirs).
        for label, target in targets.items():
            if label.startswith(("in process", "served")):
                accuracy[label] = {name: cosines(np.asarray(target(seqs)), reference[name])
                                   for name, seqs in inputs.items()}
        seconds: dict[str, dict[str, list[float]]] = {label: {name: [] for name in inputs} for label in targets}
        graph: dict[str, dict[str, list[float]]] = {label: {name: [] for name in inputs} for label in encoders}
        for round_ in range(args.rounds):
            for label, target in targets.items():
                for name, sequences in inputs.items():
                    if label in encoders:  # the same pass, with ONNX Runtime's share of it
                        _, timing = encoders[label].timed(sequences)
                        seconds[label][name].append(timing.total)
                        graph[label][name].append(timing.graph)
                        continue
                    began = time.perf_counter()
                    target(sequences)
                    seconds[label][name].append(time.perf_counter() - began)
            print(f"[esm_cpp] {shape}: round {round_ + 1}/{args.rounds} done", flush=True)
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.close()
    throughput = {label: {name: {"best": len(inputs[name]) / min(times),
                                 "median": len(inputs[name]) / statistics.median(times),
                                 "seconds": times} for name, times in per.items()}
                  for label, per in seconds.items()}
    # Where an in-process pass goes: ONNX Runtime's share; the rest is tokenizing, planning, copying.
    graph_share = {label: {name: sum(graph[label][name]) / sum(seconds[label][name]) for name in inputs}
                   for label in encoders}
    return {"shape": shape, "sizes": sizes, "throughput": throughput, "accuracy": accuracy,
            "graph_share": graph_share,
            "workloads": {name: {"lengths": workloads[name][0], "proteins": len(seqs),
                                 "mean_residues": float(np.mean([len(s) for s in seqs]))}
                          for name, seqs in inputs.items()}}


# ------------------------------------------------------------------------------ report
def host() -> dict:
    esm_cpp = esm_cpp_module()
    cpu = cpu_description()
    features = cast(list[str], cpu["features"])
    return {"platform": platform.platform(), "cpu": cpu["model"], "vnni": cpu["vnni"],
            "avx512": any(f.startswith("avx512") for f in features),
            "amx": any(f.startswith("amx") for f in features), "cores": available_cores(),
            "esm_cpp": package_version("esm-cpp"), "esm_cpp_isa": esm_cpp.current_isa(),
            "esm_cpp_threads": esm_cpp.Model.num_threads, "torch_threads": torch.get_num_threads(),
            "versions": {k: v for k, v in sorted(package_versions().items()) if v}}


def summary(results: dict) -> str:
    lines = ["# esm.cpp against bionemo-export (issue 47)", "",
             f"Command: `{results['command']}`  ", f"Host: {results['host']['cpu']}, {results['host']['cores']} cores, "
             f"AVX-512 {results['host']['avx512']}, VNNI {results['host']['vnni']}, AMX {results['host']['amx']}; "
             f"esm.cpp {results['host']['esm_cpp']} ({results['host']['esm_cpp_isa']}, "
             f"{results['host']['esm_cpp_threads']} threads), torch threads {results['host']['torch_threads']}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in results["host"]["versions"].items()), "",
             "Sequences/s, best of the interleaved rounds (median in brackets); `x int8` is the ratio to "
             "esm.cpp int8's best, `x fp32` to esm.cpp fp32's; accuracy is the min cosine of the embeddings "
             "against HF eager fp32 over the workload's proteins.", ""]
    for shape in results["shapes"]:
        names = list(shape["workloads"])
        lines += [f"## {shape['shape']} ({shape['sizes']['num_layers']} layers, width {shape['sizes']['hidden_size']})",
                  "", "| target | " + " | ".join(f"{n} ({shape['workloads'][n]['proteins']} x "
                                                  f"~{shape['workloads'][n]['mean_residues']:.0f})" for n in names)
                  + " | min cosine |", "|---|" + "---|" * (len(names) + 1)]
        base = {kind: shape["throughput"].get(f"esm.cpp {kind}") for kind in ("int8", "fp32")}
        for label, per in shape["throughput"].items():
            cells = []
            for name in names:
                figures = per[name]
                cell = f"{figures['best']:.2f} ({figures['median']:.2f})"
                kind = "fp32" if "fp32" in label and not label.startswith("esm.cpp") else "int8"
                if not label.startswith(("esm.cpp", "HF")) and base[kind]:
                    cell += f" {figures['best'] / base[kind][name]['best']:.2f}x {kind}"
                cells.append(cell)
            accuracy = shape["accuracy"].get(label)
            worst = "reference" if label == "HF eager fp32" else (
                f"{min(a['min_cosine'] for a in accuracy.values()):.5f}" if accuracy else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {worst} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["esm2_t12_35M", "esm2_t30_150M", "esm2_t33_650M"],
                        choices=sorted(ESM2_SHAPES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8"],
                        help="our repositories' precisions (fp32, int8, int8w, int4, auto)")
    parser.add_argument("--as-given", nargs="*", default=["int8"],
                        help="served precisions also measured with the client's rows in the workload's order")
    parser.add_argument("--in-process", nargs="*", default=["esm2_t12_35M", "esm2_t30_150M"],
                        help="shapes whose repositories also run in this process (each holds its own copy of the "
                             "weights: leave out the large ones on a 24 GB host)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-proteins", type=int, default=0,
                        help="at most this many proteins per workload (0: the workloads' own counts; the 650M "
                             "shape's baselines take minutes a pass on 2 cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="checkpoints and repositories (reused when present)")
    parser.add_argument("--out", type=Path, default=RESULTS / "esm_cpp")
    parser.add_argument("--quick", action="store_true", help="smoke: the 8M shape, a few proteins, results in --work")
    args = parser.parse_args()
    esm_cpp_module()
    if args.quick:
        args.shapes, args.in_process, args.rounds = ["esm2_t6_8M"], ["esm2_t6_8M"], 2
    with tempfile.TemporaryDirectory(prefix="esm-cpp-bench-") as temporary:
        work = args.work or Path(temporary)
        out = work / "esm_cpp" if args.quick else args.out
        results = {"command": " ".join(["python", *sys.argv]), "host": host(), "shapes": []}
        out.parent.mkdir(parents=True, exist_ok=True)
        for shape in args.shapes:  # written after each shape: a long run keeps what it measured
            results["shapes"].append(measure_shape(shape, args, work))
            out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
            text = summary(results)
            out.with_suffix(".md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
