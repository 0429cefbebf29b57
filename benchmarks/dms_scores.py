"""A full deep mutational scan scored with masked marginals: served N_scores vs the in-process
PyTorch loop a user would write with transformers, side by side in one run.

    .venv/bin/python benchmarks/dms_scores.py [--model esm2|antiberty] [--length 300] [--precisions fp32,int8]
    .venv/bin/python benchmarks/dms_scores.py --smoke      # 30 residues, to a temporary folder

About 6 minutes on 2 quiet cores (esm2, 300 residues, two builds included), 2 with `--model
antiberty`; `--smoke` about a minute.

Models (`--model`):
- `esm2` (default): an ESM-2 of the 35M size (12 layers, 480 wide, 20 heads; random weights: no
  weights can be downloaded here, and speed does not depend on them) and one random protein of
  `--length` residues (Swiss-Prot residue frequencies). Results: results/dms_scores.md, .json.
- `antiberty`: the real AntiBERTy (`antiberty==0.1.3` wheel) and one antibody-like heavy chain
  (pll_scores.heavy_chains; `--length` ignored): trained weights, so the int8 build's agreement
  with fp32 is a trained model's. Results: results/dms_scores_antiberty.md, .json.

Every single substitution (19 per position) is scored with `masked-marginal`: one masked copy per
position, log p(mutant) - log p(wild type) there.

- served <precision>: the repository built with the python backend and defaults (`--precision
  int8`: the encoder graph dynamically quantized), the real embedded tritonserver,
  `RepositoryClient.score_variants` sending the variants in one request; the server forms the
  masked copies and sends them to N_logits in calls of max_batch_size copies. Timed from the
  request to the answer (server started and warmed up with one small request before); the
  server's statistics say where the time went.
- pytorch-loop: ESM's examples/variant-prediction/predict.py way: for each position a masked copy,
  one forward of the masked LM (batch 1), log_softmax, the 19 differences.
- pytorch-batched: the same copies in batches of 32 (what a user who batches would write).

Every way's scores are compared with served fp32 (max abs difference; Spearman over the variants),
with the compute anchor of pll_scores.py (GFLOP per copy; this CPU's sgemm rate). Results go
under --out (default results/; with --smoke a temporary folder), with the command, machine and
versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from _scoring_bench import (
    RESULTS,
    SMOKE_RESULTS,
    annotate,
    bench_environment,
    gemm_gflops,
    gflop_per_pass,
    header,
    heavy_chains,
    report,
    serve_and_time,
)

from bionemo_export.bench.inputs import STANDARD_AMINO_ACIDS, random_proteins
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.testing.checkpoints import ESM2_35M_SIZES, save_random_checkpoint

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
BATCH = 32
LOOP, BATCHED = "pytorch-loop (batch 1)", f"pytorch-batched ({BATCH})"


@dataclass
class Subject:
    """The model and protein a scan runs on, and what the PyTorch loop needs to tokenize it."""

    family: str
    name: str
    checkpoint: Path
    model: Any
    """transformers' masked LM (EsmForMaskedLM, BertForMaskedLM), eval mode."""
    ids: dict[str, int]
    """Residue -> token id."""
    begin: int
    end: int
    mask: int
    protein: str
    what: str


def esm2_subject(work: Path, length: int) -> Subject:
    checkpoint = save_random_checkpoint("esm2", work / "esm2_35m", seed=0, **ESM2_35M_SIZES)
    protein = random_proteins(np.array([length]), np.random.default_rng(0))[0]
    return Subject("esm2", "esm2", checkpoint, transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval(),
                   {c: ESM_VOCAB.index(c) for c in STANDARD_AMINO_ACIDS}, ESM_VOCAB.index("<cls>"),
                   ESM_VOCAB.index("<eos>"), ESM_VOCAB.index("<mask>"), protein,
                   f"One random {length}-residue protein; ESM-2 35M-sized, random weights")


def antiberty_subject(length: int | None) -> Subject:
    checkpoint = antiberty_checkpoint()
    transformers.logging.set_verbosity_error()  # the checkpoint's unused heads (species, chain, graft)
    vocab = (checkpoint.parent / "vocab.txt").read_text().split()  # the wheel keeps it beside the model folder
    protein = heavy_chains(1, np.random.default_rng(0))[0][:length]
    return Subject("bert", "antiberty", checkpoint, transformers.BertForMaskedLM.from_pretrained(checkpoint).eval(),
                   {c: vocab.index(c) for c in STANDARD_AMINO_ACIDS}, vocab.index("[CLS]"), vocab.index("[SEP]"),
                   vocab.index("[MASK]"), protein,
                   f"One antibody-like {len(protein)}-residue heavy chain; the real AntiBERTy")


def all_substitutions(protein: str) -> list[str]:
    return [f"{wt}{i + 1}{mt}" for i, wt in enumerate(protein) for mt in STANDARD_AMINO_ACIDS if mt != wt]


def pytorch_scores(subject: Subject, variants: list[str], batch: int) -> np.ndarray:
    """Masked marginals in PyTorch: one masked copy per position, `batch` copies per forward."""
    protein = subject.protein
    ids = torch.tensor([subject.begin, *(subject.ids[c] for c in protein), subject.end])
    token_probs: torch.Tensor | None = None
    with torch.inference_mode():
        for start in range(0, len(protein), batch):
            positions = torch.arange(start, min(start + batch, len(protein))) + 1
            copies = ids.repeat(len(positions), 1)
            copies[torch.arange(len(positions)), positions] = subject.mask
            logits = subject.model(input_ids=copies, attention_mask=torch.ones_like(copies)).logits
            if token_probs is None:
                token_probs = torch.empty(len(protein), logits.shape[-1])
            token_probs[positions - 1] = torch.log_softmax(logits[torch.arange(len(positions)), positions], dim=-1)
    assert token_probs is not None
    return np.array([float(token_probs[int(v[1:-1]) - 1, subject.ids[v[-1]]]
                           - token_probs[int(v[1:-1]) - 1, subject.ids[v[0]]]) for v in variants])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=("esm2", "antiberty"), default="esm2")
    parser.add_argument("--length", type=int, default=300, help="residues of the esm2 protein")
    parser.add_argument("--precisions", default="fp32,int8", help="served builds, comma-separated (fp32 first)")
    parser.add_argument("--smoke", action="store_true", help="30 residues, results to a temporary folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or (SMOKE_RESULTS if args.smoke else RESULTS)
    precisions = args.precisions.split(",")
    if precisions[0] != "fp32":
        parser.error("--precisions must start with fp32 (every way is compared with it)")
    length = 30 if args.smoke else args.length
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bionemo-dms-") as work:
        subject = (esm2_subject(Path(work), length) if args.model == "esm2"
                   else antiberty_subject(30 if args.smoke else None))
        protein = subject.protein
        variants = all_substitutions(protein)
        config = subject.model.config
        shape = (BATCH * (len(protein) + 2), config.hidden_size, config.intermediate_size)
        sgemm_before = gemm_gflops(*shape)
        for precision in precisions:
            repository = Path(work) / f"{subject.name}_{precision}"
            build_repository(BuildRequest(family=subject.family, checkpoint=subject.checkpoint, name=subject.name,
                                          out=repository, backend="python", tasks=("logits", "scores"),
                                          precision=precision))
            served = serve_and_time(
                repository, subject.name, lambda client: client.score_variants(protein, variants, "masked-marginal"),
                lambda client: client.score_variants(protein[:20], all_substitutions(protein[:2]), "masked-marginal"),
                Path(work) / f"server_{precision}.log")
            results[f"served {precision}"] = {"seconds": served.seconds, "scores": served.scores.tolist(),
                                              "server": served.breakdown(subject.name)}
        for label, batch in ((BATCHED, BATCH), (LOOP, 1)):
            start = time.perf_counter()
            scores = pytorch_scores(subject, variants, batch)
            results[label] = {"seconds": time.perf_counter() - start, "scores": scores.tolist()}
    annotate(results, items=len(variants), item="variant", copies=len(protein),
             gflop=len(protein) * gflop_per_pass(config, len(protein) + 2))
    sgemm = max(sgemm_before, gemm_gflops(*shape))  # the CPU's rate when least disturbed
    env = bench_environment()
    command = " ".join(["python", *sys.argv])
    stem = "dms_scores" if args.model == "esm2" else f"dms_scores_{args.model}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        {"command": command, "environment": env, "model": args.model, "protein": protein, "variants": len(variants),
         "sgemm_gflops": sgemm, "results": results}, indent=2) + "\n")
    lines = header(f"Deep mutational scan, masked marginals: served N_scores vs PyTorch ({args.model})", command, env,
                   f"{subject.what}; all {len(variants)} single substitutions, `masked-marginal` ({len(protein)} "
                   "masked copies, one forward each).")
    lines += report(results, item="variant", loop=LOOP, batched=BATCHED, sgemm=sgemm,
                    gemm_shape=f"[{shape[0]}, {shape[1]}] x [{shape[1]}, {shape[2]}]")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
