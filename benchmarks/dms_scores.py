"""A full deep mutational scan scored with masked marginals: served N_scores vs the in-process
PyTorch loop a user would write with transformers' EsmForMaskedLM, side by side in one run.

    .venv/bin/python benchmarks/dms_scores.py [--length 300] [--out benchmarks/results]

An ESM-2 of the 35M size (12 layers, 480 wide, 20 heads; random weights: no weights can be
downloaded here, and speed does not depend on them) and one random protein of `--length` residues
(Swiss-Prot residue frequencies). Every single substitution (19 per position) is scored with
`masked-marginal`: one masked copy per position, log p(mutant) - log p(wild type) there.

- served: the repository built with the python backend (fp32, defaults), the real embedded
  tritonserver, `RepositoryClient.score_variants` sending the variants in one request; the server
  forms the masked copies and sends them to N_logits in max_batch_size calls. Timed from the
  request to the answer (server started and warmed up with one small request before).
- pytorch-loop: ESM's examples/variant-prediction/predict.py way: for each position a masked copy,
  one forward of EsmForMaskedLM (batch 1), log_softmax, the 19 differences.
- pytorch-batched: the same copies in batches of 32 (what a user who batches would write).

The scores of every way are compared (max abs difference). Results: results/dms_scores.md and
.json, with the command, machine and versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bionemo_export.bench.inputs import STANDARD_AMINO_ACIDS, random_proteins
from bionemo_export.bench.run import environment
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import RepositoryClient
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import ESM2_35M_SIZES, save_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]


def all_substitutions(protein: str) -> list[str]:
    return [f"{wt}{i + 1}{mt}" for i, wt in enumerate(protein) for mt in STANDARD_AMINO_ACIDS if mt != wt]


def pytorch_scores(model, protein: str, variants: list[str], batch: int) -> np.ndarray:
    """Masked marginals in PyTorch: one masked copy per position, `batch` copies per forward."""
    ids = torch.tensor([0, *(VOCAB.index(c) for c in protein), 2])
    token_probs = torch.empty(len(protein), len(VOCAB))
    with torch.inference_mode():
        for start in range(0, len(protein), batch):
            positions = list(range(start, min(start + batch, len(protein))))
            copies = ids.repeat(len(positions), 1)
            for row, i in enumerate(positions):
                copies[row, 1 + i] = VOCAB.index("<mask>")
            logits = model(input_ids=copies, attention_mask=torch.ones_like(copies)).logits
            for row, i in enumerate(positions):
                token_probs[i] = torch.log_softmax(logits[row, 1 + i], dim=-1)
    return np.array([float(token_probs[int(v[1:-1]) - 1, VOCAB.index(v[-1])]
                           - token_probs[int(v[1:-1]) - 1, VOCAB.index(v[0])]) for v in variants])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    protein = random_proteins(np.array([args.length]), np.random.default_rng(0))[0]
    variants = all_substitutions(protein)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bionemo-dms-") as work:
        checkpoint = save_random_checkpoint("esm2", Path(work) / "esm2_35m", seed=0, **ESM2_35M_SIZES)
        model = transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval()
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2", out=Path(work) / "repo",
                                      backend="python", tasks=("logits", "scores")))
        with TritonServer(Path(work) / "repo", log_file=Path(work) / "server.log") as server:
            with RepositoryClient("esm2", f"grpc://{server.endpoints.grpc_url}", timeout_s=3600) as client:
                client.score_variants(protein[:20], all_substitutions(protein[:2]), "masked-marginal")  # warm-up
                start = time.perf_counter()
                served = client.score_variants(protein, variants, "masked-marginal")
                results["served"] = {"seconds": time.perf_counter() - start}
        for label, batch in (("pytorch-batched", 32), ("pytorch-loop", 1)):
            start = time.perf_counter()
            scores = pytorch_scores(model, protein, variants, batch)
            results[label] = {"seconds": time.perf_counter() - start,
                              "max_abs_difference_from_served": float(np.abs(scores - served).max())}
    for result in results.values():
        result["variants_per_second"] = len(variants) / result["seconds"]
        result["masked_copies_per_second"] = args.length / result["seconds"]
    env = {**environment(), "torch": torch.__version__, "transformers": transformers.__version__}
    command = " ".join(["python", *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dms_scores.json").write_text(json.dumps({"command": command, "environment": env,
                                                          "length": args.length, "variants": len(variants),
                                                          "results": results}, indent=2) + "\n")
    loop = results["pytorch-loop"]["seconds"]
    lines = [
        "# Deep mutational scan, masked marginals: served N_scores vs PyTorch", "",
        f"Command: `{command}`. One random {args.length}-residue protein, all {len(variants)} single "
        f"substitutions, `masked-marginal` ({args.length} masked copies); ESM-2 35M-sized, random weights.",
        f"Machine: {env['processor']}, {env['cores']} cores, {env['platform']}; python {env['python']}, "
        f"onnxruntime {env['onnxruntime']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"tritonserver from nvidia-pytriton {env['nvidia-pytriton']}.", "",
        "| way | seconds | variants/s | masked copies/s | vs pytorch-loop | max abs diff from served |",
        "|---|---|---|---|---|---|",
    ]
    for label, result in results.items():
        lines.append(f"| {label} | {result['seconds']:.1f} | {result['variants_per_second']:.0f} | "
                     f"{result['masked_copies_per_second']:.1f} | {loop / result['seconds']:.2f}x | "
                     f"{result.get('max_abs_difference_from_served', 0.0):.1e} |")
    (args.out / "dms_scores.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
