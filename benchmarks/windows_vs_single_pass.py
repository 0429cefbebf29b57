"""How far the windowed answer for a long protein is from a single pass, where a single pass is
possible: served-style windows (serving/windows.py's plan and merge rule) vs one pass of the whole
protein, both in PyTorch on the same model.

    .venv/bin/python benchmarks/windows_vs_single_pass.py [--window 254] [--out benchmarks/results]

A 35M-sized ESM-2 (12 layers, 480 wide; random weights: none can be downloaded here, so the
figures describe the merge on this architecture, not a pretrained model's accuracy) and random
proteins (Swiss-Prot residue frequencies) longer than the window but within ESM-2's 1022 residues,
so that the single pass exists. Reported per length: per-residue cosine of the merged hiddens to
the single pass (min, mean), the embeddings' cosine, and the largest absolute difference of the
log-probabilities over the residue alphabet. Results: results/windows_vs_single_pass.md/.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from bionemo_export.bench.inputs import random_proteins
from bionemo_export.bench.run import environment
from bionemo_export.serving import windows
from bionemo_export.testing.checkpoints import ESM2_35M_SIZES, save_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]


def run(model, residues: str) -> tuple[np.ndarray, np.ndarray]:
    """(hiddens, log_probs over the residue letters) of <cls> residues <eos>."""
    ids = torch.tensor([[0, *(VOCAB.index(c) for c in residues), 2]])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    columns = [VOCAB.index(c) for c in "LAGVSERTIDPKQNFYMHWCXBUZO"]
    return out.hidden_states[-1][0].numpy(), torch.log_softmax(out.logits[0][:, columns], dim=-1).numpy()


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=254, help="residues per window")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    overlap = windows.default_overlap(args.window)
    lengths = [args.window + 1, args.window + args.window // 2, 2 * args.window, 1022]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bionemo-windows-") as work:
        checkpoint = save_random_checkpoint("esm2", Path(work) / "esm2_35m", seed=0, **ESM2_35M_SIZES)
        model = transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval()
        for length, protein in zip(lengths, random_proteins(np.array(lengths), np.random.default_rng(1))):
            spans = windows.plan_windows(length, args.window, overlap=overlap, max_residues=10000)
            parts = [run(model, protein[start:end]) for start, end in spans]
            hiddens = windows.merge_rows([h for h, _ in parts], spans, has_bos=True, has_eos=True)
            log_probs = windows.merge_rows([p for _, p in parts], spans, has_bos=True, has_eos=True)
            single_hiddens, single_log_probs = run(model, protein)
            cosines = cosine_rows(hiddens[1:-1], single_hiddens[1:-1])
            embedding = float(cosine_rows(hiddens[1:-1].mean(0), single_hiddens[1:-1].mean(0)))
            rows.append({"residues": length, "windows": len(spans), "cosine_min": float(cosines.min()),
                         "cosine_mean": float(cosines.mean()), "embedding_cosine": embedding,
                         "log_probs_max_abs": float(np.abs(log_probs - single_log_probs).max())})
    env = {**environment(), "torch": torch.__version__, "transformers": transformers.__version__}
    command = " ".join(["python", *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "windows_vs_single_pass.json").write_text(json.dumps(
        {"command": command, "environment": env, "window": args.window, "overlap": overlap, "rows": rows},
        indent=2) + "\n")
    lines = ["# Windows vs a single pass (ESM-2 35M-sized, random weights)", "",
             f"Command: `{command}`. Windows of {args.window} residues, overlap at least {overlap} "
             "(serving/windows.py's plan and merge rule), against one pass of the whole protein.",
             f"Machine: {env['processor']}, {env['cores']} cores; torch {env['torch']}, transformers "
             f"{env['transformers']}.", "",
             "| residues | windows | per-residue cosine min | mean | embedding cosine | log-probs max abs |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['residues']} | {r['windows']} | {r['cosine_min']:.4f} | {r['cosine_mean']:.4f} | "
              f"{r['embedding_cosine']:.5f} | {r['log_probs_max_abs']:.3f} |" for r in rows]
    (args.out / "windows_vs_single_pass.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
