"""Antibody pseudo-log-likelihoods on the real AntiBERTy: served N_scores (method pll) vs the
in-process PyTorch loop a user would write with transformers' BertForMaskedLM, side by side in one run.

    .venv/bin/python benchmarks/pll_scores.py [--sequences 64] [--precisions fp32,int8] [--out DIR]
    .venv/bin/python benchmarks/pll_scores.py --smoke      # 2 sequences, to a temporary folder

About 40 minutes on 2 quiet cores for 64 sequences (~7700 masked copies; the batch-1 loop about
half of it); `--smoke` 2-3 minutes.

The real AntiBERTy (`antiberty==0.1.3` wheel: 8 layers, hidden 512, 8 heads) and `--sequences`
antibody-like heavy chains of 111-130 residues (`heavy_chains`: a human IGHV germline with ~3%
point mutations, a random CDR3 core, IGHJ4). The PLL of a sequence is the MEAN over its residues
of log p(residue) with that residue masked, the special tokens excluded from the softmax
(AntiBERTy's own `pseudo_log_likelihood`): one masked copy per residue, a full forward each.

- served <precision>: the repository built with the python backend and defaults (`--precision
  int8`: the encoder graph dynamically quantized), the real embedded tritonserver,
  `RepositoryClient.pseudo_log_likelihood` with every sequence (requests of max_batch_size
  sequences, several in flight); the server forms the masked copies and sends them to N_logits
  in calls of max_batch_size copies. Timed from the request to the answer (server started and
  warmed up with one short sequence before). The server's statistics say where the time went:
  the encoder model's compute (tokenizing + graph) and the head's, as fractions of the wall time.
- pytorch-loop: the loop a user writes from AntiBERTy's runner: BertForMaskedLM from the
  checkpoint folder, torch.inference_mode, one masked copy per forward (batch 1).
- pytorch-batched: the same with 32 masked copies per forward.

Every way's PLLs are compared with served fp32 (max abs difference; Spearman over the sequences).
The compute anchor: the model's GFLOP per copy (the same for every way: the same copies, the head
at every position) and this CPU's sgemm rate at the model's feed-forward shape, so a rate can be
read as a fraction of what the CPU can do. Results: results/pll_scores.md and .json (with
--smoke: a temporary folder), with the command, machine and versions.
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

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.models.bert import antiberty_checkpoint

BATCH = 32
LOOP, BATCHED = "pytorch-loop (batch 1)", f"pytorch-batched ({BATCH})"


def pytorch_plls(model, tokenizer, sequences: list[str], batch: int) -> np.ndarray:
    """AntiBERTy's pseudo_log_likelihood in PyTorch: for each sequence, one masked copy per residue,
    `batch` copies per forward, the special tokens' logits set to -inf, the mean log-probability
    of the true residues."""
    special = torch.tensor(tokenizer.all_special_ids)
    plls = []
    with torch.inference_mode():
        for sequence in sequences:
            ids = torch.tensor(tokenizer.encode(" ".join(sequence)))  # [CLS] residues [SEP]
            total = 0.0
            for start in range(0, len(sequence), batch):
                positions = torch.arange(start, min(start + batch, len(sequence))) + 1
                copies = ids.repeat(len(positions), 1)
                copies[torch.arange(len(positions)), positions] = tokenizer.mask_token_id
                logits = model(input_ids=copies, attention_mask=torch.ones_like(copies)).logits
                site = logits[torch.arange(len(positions)), positions]
                site[:, special] = -float("inf")
                total += float(torch.log_softmax(site, dim=-1)[torch.arange(len(positions)), ids[positions]].sum())
            plls.append(total / len(sequence))
    return np.array(plls)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--precisions", default="fp32,int8", help="served builds, comma-separated (fp32 first)")
    parser.add_argument("--smoke", action="store_true", help="2 sequences, results to a temporary folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    count = 2 if args.smoke else args.sequences
    out = args.out or (SMOKE_RESULTS if args.smoke else RESULTS)
    precisions = args.precisions.split(",")
    if precisions[0] != "fp32":
        parser.error("--precisions must start with fp32 (every way is compared with it)")
    sequences = heavy_chains(count, np.random.default_rng(0))
    copies = sum(len(s) for s in sequences)
    checkpoint = antiberty_checkpoint()
    transformers.logging.set_verbosity_error()  # the checkpoint's unused heads (species, chain, graft)
    model = transformers.BertForMaskedLM.from_pretrained(checkpoint).eval()
    tokenizer = transformers.BertTokenizer(str(checkpoint.parent / "vocab.txt"), do_lower_case=False)
    results: dict[str, dict] = {}
    shape = (BATCH * 122, model.config.hidden_size, model.config.intermediate_size)
    sgemm_before = gemm_gflops(*shape)
    with tempfile.TemporaryDirectory(prefix="bionemo-pll-") as work:
        for precision in precisions:
            repository = Path(work) / f"antiberty_{precision}"
            build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="antiberty", out=repository,
                                          backend="python", tasks=("logits", "scores"), precision=precision))
            served = serve_and_time(repository, "antiberty", lambda client: client.pseudo_log_likelihood(sequences),
                                    lambda client: client.pseudo_log_likelihood([sequences[0][:20]]),
                                    Path(work) / f"server_{precision}.log")
            results[f"served {precision}"] = {"seconds": served.seconds, "scores": served.scores.tolist(),
                                              "server": served.breakdown("antiberty")}
        for label, batch in ((BATCHED, BATCH), (LOOP, 1)):
            start = time.perf_counter()
            scores = pytorch_plls(model, tokenizer, sequences, batch)
            results[label] = {"seconds": time.perf_counter() - start, "scores": scores.tolist()}
    gflop = sum(len(s) * gflop_per_pass(model.config, len(s) + 2) for s in sequences)  # one pass per residue
    annotate(results, items=count, item="sequence", copies=copies, gflop=gflop)
    sgemm = max(sgemm_before, gemm_gflops(*shape))  # the CPU's rate when least disturbed
    env = bench_environment()
    command = " ".join(["python", *sys.argv])
    out.mkdir(parents=True, exist_ok=True)
    (out / "pll_scores.json").write_text(json.dumps(
        {"command": command, "environment": env, "sequences": sequences, "masked_copies": copies,
         "gflop_per_run": gflop, "sgemm_gflops": sgemm, "results": results}, indent=2) + "\n")
    lengths = f"{min(map(len, sequences))}-{max(map(len, sequences))}"
    lines = header("Antibody pseudo-log-likelihoods: served N_scores vs PyTorch", command, env,
                   f"The real AntiBERTy; {count} antibody-like heavy chains of {lengths} residues, `pll` ({copies} "
                   "masked copies, one forward each).")
    lines += report(results, item="sequence", loop=LOOP, batched=BATCHED, sgemm=sgemm,
                    gemm_shape=f"[{shape[0]}, {shape[1]}] x [{shape[1]}, {shape[2]}]")
    (out / "pll_scores.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
