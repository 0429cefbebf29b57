"""What weight-only quantization keeps of a random-weight model, layer by layer, at ESM C 6B's width:
why a random checkpoint cannot show ESM C 6B's int4 accuracy (issue 46).

    .venv/bin/python benchmarks/int4_random_depth.py [--layers 1 2 4] [--out benchmarks/results/int4_random_depth.json]

For each depth, a random ESM C checkpoint of the 6B's width (hidden 2560, 40 heads, SwiGLU 6912;
bf16 as released, weights drawn as bionemo_export/testing/large_checkpoints.py draws them) is read
by the project's ESM C loader, exported once to a plain fp32 graph, and quantized the way a build
quantizes it (exporters/optimize/candidates.py's `optimize_onnx`: onnxruntime's MatMulNBits, block
32, accuracy level 4; int4 also with every feed-forward product kept at 8 bits, the build's last
int4 candidate; and int8w). Each graph's embeddings and hidden states, run under ONNX Runtime on the
same batch, are compared with the fp32 graph's (min cosine over sequences / residues). The build's
own tolerances: int4 embeddings 0.97 (0.973 with its margin), int8w 0.9995.

A random model has no redundancy: every weight matters as much as every other, so 4-bit rounding
noise (about 8% of a Gaussian weight's spread at block 32) reaches its outputs in full. The real
AntiBERTy, the one trained protein model here, keeps 0.991 (full heavy chains) at int4:
results/weight_only.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "int4_random_depth.json"
WIDTH = {"hidden_size": 2560, "num_heads": 40, "intermediate_size": 6912}
"""ESM C 6B's (bionemo_export/testing/large_checkpoints.py ESMC_SHAPES["esmc_6b"]), depth aside."""
SEQUENCES = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSP",
    "MSLKRKNIALIPAAGIGVRFG",
    "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG",
]
VARIANTS: dict[str, dict[str, Any]] = {
    "int4": {"precision": "int4"},
    "int4, feed-forward at 8 bits": {"precision": "int4", "keep_int8": 1.0},
    "int8w": {"precision": "int8w"},
}


def min_cosines(answers: dict[str, np.ndarray], reference: dict[str, np.ndarray], valid: np.ndarray) -> dict:
    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))

    return {"embeddings": float(cos(answers["embeddings"], reference["embeddings"]).min()),
            "hiddens": float(cos(answers["hiddens"], reference["hiddens"])[valid].min())}


def one_depth(layers: int, work: Path) -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    from bionemo_export.exporters import export_onnx
    from bionemo_export.exporters.optimize.candidates import optimize_onnx
    from bionemo_export.exporters.runtime_session import served_session_options
    from bionemo_export.models import get_family
    from bionemo_export.testing.large_checkpoints import write_random_checkpoint

    checkpoint = write_random_checkpoint("esmc", work / "checkpoint", {**WIDTH, "num_layers": layers})
    loaded = get_family("esmc").load(checkpoint)
    encoded = loaded.tokenizer.encode(SEQUENCES)
    batch = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
             "residue_mask": encoded.residue_mask}
    plain = work / "plain" / "model.onnx"
    plain.parent.mkdir(parents=True)
    export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, batch, plain)
    del loaded
    torch.set_num_threads(2)

    def run(path: Path) -> dict[str, np.ndarray]:
        session = ort.InferenceSession(str(path), served_session_options("ORT_ENABLE_BASIC", 2),
                                       providers=["CPUExecutionProvider"])
        names = [value.name for value in session.get_inputs()]
        outputs = [value.name for value in session.get_outputs()]
        answers = session.run(None, {n: batch[n] for n in names})
        return {name: np.asarray(value) for name, value in zip(outputs, answers)}

    reference = run(plain)
    valid = batch["attention_mask"] != 0
    row: dict[str, Any] = {"layers": layers}
    for label, options in VARIANTS.items():
        start = time.perf_counter()
        graph = optimize_onnx(plain, work / label.replace(" ", "_").replace(",", "") / "model.onnx",
                              num_heads=WIDTH["num_heads"], hidden_size=WIDTH["hidden_size"], **options).path
        row[label] = {**min_cosines(run(graph), reference, valid), "seconds": round(time.perf_counter() - start, 1)}
        print(f"{layers} layers, {label}: {row[label]}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="int4-depth-") as work:
            rows.append(one_depth(layers, Path(work)))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name")), platform.processor()),
                    "cores": len(__import__("os").sched_getaffinity(0))},
        "versions": {name: importlib.metadata.version(name) for name in ("onnxruntime", "torch", "transformers")},
        "width": WIDTH,
        "sequences": [len(s) for s in SEQUENCES],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
