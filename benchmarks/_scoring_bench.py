"""What the scoring benchmarks (dms_scores.py, pll_scores.py) share: serving one repository and
timing a request with the server's own account of where the time went, the compute anchor (the
model's FLOPs per masked copy and this CPU's sgemm rate at the model's own FFN shape), Spearman's
rank correlation, and the results' header (command, machine, versions).

Not a benchmark itself: the two scripts import it from their folder.
"""

from __future__ import annotations

import re
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from bionemo_export.bench.run import environment, read_statistics, statistics_delta
from bionemo_export.client import RepositoryClient
from bionemo_export.procfs import cpu_flags
from bionemo_export.runtime import TritonServer

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_RESULTS = Path(tempfile.gettempdir()) / "bionemo-export-bench-smoke"
"""Where --smoke writes unless --out says otherwise: never over the committed results."""


# ------------------------------------------------------------------------------ served
@dataclass
class Served:
    """One timed request stream against a repository, and the server's account of it."""

    scores: np.ndarray
    seconds: float
    models: dict[str, dict[str, float]]
    """Per model that ran: compute seconds (summed over its instances), executions, rows."""
    real_tokens: int
    padding_tokens: int

    def breakdown(self, name: str) -> dict[str, Any]:
        """Where the served time went: the encoder model's compute (tokenizing + the graph) and the
        head's as fractions of the wall time, the encoder's calls and rows per call, and the
        padding the encoder computed."""
        encoder, head = self.models.get(f"{name}_encoder", {}), self.models.get(f"{name}_lm_head", {})
        calls = encoder.get("executions", 0)
        total = self.real_tokens + self.padding_tokens
        return {"encoder_busy": encoder.get("seconds", 0.0) / self.seconds,
                "lm_head_busy": head.get("seconds", 0.0) / self.seconds,
                "encoder_calls": calls, "rows_per_encoder_call": encoder.get("rows", 0) / calls if calls else None,
                "padding_fraction": self.padding_tokens / total if total else None}


def token_counters(metrics_url: str) -> tuple[int, int]:
    """(real, padding) tokens the encoder graph computed so far (its Triton metric)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    totals = {"real": 0.0, "padding": 0.0}
    for line in text.splitlines():
        match = re.match(r'bionemo_export_encoder_tokens_total\{.*kind="(real|padding)".*\} (\S+)', line)
        if match:
            totals[match[1]] += float(match[2])
    return int(totals["real"]), int(totals["padding"])


def serve_and_time(repository: Path, name: str, run: Callable[[RepositoryClient], np.ndarray],
                   warm_up: Callable[[RepositoryClient], object], log: Path) -> Served:
    """Serve `repository` (the real embedded tritonserver), `warm_up`, then time `run` from the
    request to the answer, with the server's statistics and token counters read around it."""
    with TritonServer(repository, log_file=log) as server:
        import tritonclient.grpc as grpcclient

        raw = grpcclient.InferenceServerClient(server.endpoints.grpc_url)
        with RepositoryClient(name, f"grpc://{server.endpoints.grpc_url}", timeout_s=3600) as client:
            warm_up(client)
            before, tokens_before = read_statistics(raw), token_counters(server.endpoints.metrics_url)
            start = time.perf_counter()
            scores = run(client)
            seconds = time.perf_counter() - start
            after, tokens_after = read_statistics(raw), token_counters(server.endpoints.metrics_url)
        raw.close()
    models = {m.name: {"seconds": m.compute_us * m.requests / 1e6, "executions": m.executions, "rows": m.inferences}
              for m in statistics_delta(before, after)}
    return Served(scores, seconds, models, tokens_after[0] - tokens_before[0], tokens_after[1] - tokens_before[1])


# ------------------------------------------------------------------------------ compute anchor
def gflop_per_pass(config: Any, tokens: int) -> float:
    """GFLOP of one forward of a BERT/ESM masked LM over `tokens` tokens: the layers' matrix
    products (4 H x H projections, the H x I feed-forward pair), attention's two tokens x tokens
    products, and the masked-LM head (H x H, then H x vocabulary) at every position, as both
    PyTorch and the served N_lm_head compute it."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    linear = 2 * tokens * layers * (4 * h * h + 2 * h * i)
    attention = 2 * layers * 2 * tokens * tokens * h
    head = 2 * tokens * (h * h + h * vocab)
    return (linear + attention + head) / 1e9


def gemm_gflops(rows: int, hidden: int, intermediate: int, seconds: float = 2.0) -> float:
    """This CPU's fp32 matrix-product rate at the model's own feed-forward shape ([rows, H] x
    [H, I], torch's BLAS, torch's threads): what a compute-bound forward can approach."""
    a, b = torch.randn(rows, hidden), torch.randn(hidden, intermediate)
    torch.mm(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * rows * hidden * intermediate * count / (time.perf_counter() - start) / 1e9


# ------------------------------------------------------------------------------ agreement
def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        ranked = np.empty(x.size)
        ranked[order] = np.arange(x.size)
        _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=ranked)
        return (sums / counts)[inverse]
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


# ------------------------------------------------------------------------------ report
def annotate(results: dict[str, dict], *, items: int, item: str, copies: int, gflop: float) -> None:
    """Each way's rates (`item`s/s, masked copies/s, useful GFLOP/s: `gflop` of real tokens per
    run) and its agreement with served fp32: max abs difference, Spearman over the items."""
    reference = np.array(results["served fp32"]["scores"])
    for result in results.values():
        scores = np.array(result["scores"])
        result["max_abs_difference_from_served_fp32"] = float(np.abs(scores - reference).max())
        result["spearman_with_served_fp32"] = spearman(scores, reference) if items > 2 else None
        result[f"{item}_per_second"] = items / result["seconds"]
        result["masked_copies_per_second"] = copies / result["seconds"]
        result["useful_gflops"] = gflop / result["seconds"]


def report(results: dict[str, dict], *, item: str, loop: str, batched: str, sgemm: float, gemm_shape: str) -> list[str]:
    """The results' tables: every way against the two PyTorch loops, where the served time went,
    and each served build against the >= 2x target, saying what bounds it where it is not met."""
    base, wide = results[loop]["seconds"], results[batched]["seconds"]
    lines = [f"| way | seconds | {item}s/s | masked copies/s | useful GFLOP/s | vs {loop} | vs {batched} | "
             "max abs diff from served fp32 | Spearman with served fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        rho = "" if r["spearman_with_served_fp32"] is None else f"{r['spearman_with_served_fp32']:.4f}"
        lines.append(f"| {label} | {r['seconds']:.1f} | {r[f'{item}_per_second']:.2f} | "
                     f"{r['masked_copies_per_second']:.1f} | {r['useful_gflops']:.0f} | {base / r['seconds']:.2f}x | "
                     f"{wide / r['seconds']:.2f}x | {r['max_abs_difference_from_served_fp32']:.1e} | {rho} |")
    lines += ["", f"Compute anchor: this CPU's sgemm at the model's feed-forward shape ({gemm_shape}, torch; the "
              f"better of a measurement before the ways and one after) runs {sgemm:.0f} GFLOP/s. Useful "
              "GFLOP/s counts the real tokens of the masked copies (the same copies "
              "for every way, the masked-LM head at every position; padding not counted).", "",
              "Where the served time went (the server's statistics; busy: compute seconds / wall seconds; the "
              "encoder model's compute is tokenizing + the graph):", "",
              "| build | encoder busy | head busy | encoder calls | copies per call | padding computed |",
              "|---|---|---|---|---|---|"]
    for label, r in results.items():
        if "server" in r:
            s = r["server"]
            per_call = "" if s["rows_per_encoder_call"] is None else f"{s['rows_per_encoder_call']:.1f}"
            padding = "" if s["padding_fraction"] is None else f"{100 * s['padding_fraction']:.1f}%"
            lines.append(f"| {label} | {100 * s['encoder_busy']:.0f}% | {100 * s['lm_head_busy']:.1f}% | "
                         f"{s['encoder_calls']} | {per_call} | {padding} |")
    lines += ["", "Targets (served >= 2x the in-process PyTorch loop):", ""]
    for label, r in results.items():
        if "server" in r:
            lines.append(target_line(label, r, base, wide, loop, batched, sgemm))
    return lines


def target_line(label: str, served: dict, base: float, wide: float, loop: str, batched: str, sgemm: float) -> str:
    """Whether `served` meets >= 2x the loop (`base` seconds), and when it does not, what bounds it."""
    ratio = base / served["seconds"]
    line = (f"- {label}: {ratio:.2f}x {loop}, {wide / served['seconds']:.2f}x {batched}: "
            f"{'MET' if ratio >= 2 else 'NOT met'}")
    if ratio >= 2:
        return line + "."
    busy = served["server"]["encoder_busy"]
    return (line + f". The encoder model was busy {100 * busy:.0f}% of the wall time, at "
            f"{served['useful_gflops']:.0f} useful GFLOP/s ({100 * served['useful_gflops'] / sgemm:.0f}% of this "
            "CPU's sgemm rate): the served time is the graph's compute on the same copies PyTorch runs, so the "
            "ratio is ONNX Runtime's speed against PyTorch's on this CPU at this precision, not serving overhead"
            + ("; a 2x needs fewer FLOPs or cheaper ones (the int8 build)." if "fp32" in label else "."))


# ------------------------------------------------------------------------------ header
def bench_environment() -> dict[str, Any]:
    """bench.run.environment() with the PyTorch side's versions and threads and the CPU's vector units."""
    flags = cpu_flags()
    units = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return {**environment(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "cpu_flags": units}


def header(title: str, command: str, env: dict[str, Any], what: str) -> list[str]:
    return [f"# {title}", "", f"Command: `{command}`. {what}",
            f"Machine: {env['processor']}, {env['cores']} cores ({', '.join(env['cpu_flags']) or 'no AVX2'}), "
            f"{env['platform']}; python {env['python']}, onnxruntime {env['onnxruntime']}, torch {env['torch']} "
            f"({env['torch_threads']} threads), transformers {env['transformers']}, tritonserver from "
            f"nvidia-pytriton {env['nvidia-pytriton']}.", ""]


# Human heavy-chain germlines (IMGT): V genes to the end of framework 3 (...CAR/CAK), and IGHJ4.
IGHV = {
    "IGHV1-2": "QVQLVQSGAEVKKPGASVKVSCKASGYTFTGYYMHWVRQAPGQGLEWMGWINPNSGGTNYAQKFQGRVTMTRDTSISTAYMELSRLRSDDTAVYYCAR",
    "IGHV1-69": "QVQLVQSGAEVKKPGSSVKVSCKASGGTFSSYAISWVRQAPGQGLEWMGGIIPIFGTANYAQKFQGRVTITADESTSTAYMELSSLRSEDTAVYYCAR",
    "IGHV3-23": "EVQLLESGGGLVQPGGSLRLSCAASGFTFSSYAMSWVRQAPGKGLEWVSAISGSGGSTYYADSVKGRFTISRDNSKNTLYLQMNSLRAEDTAVYYCAK",
    "IGHV3-30": "QVQLVESGGGVVQPGRSLRLSCAASGFTFSSYAMHWVRQAPGKGLEWVAVISYDGSNKYYADSVKGRFTISRDNSKNTLYLQMNSLRAEDTAVYYCAR",
    "IGHV4-34": "QVQLQQWGAGLLKPSETLSLTCAVYGGSFSGYYWSWIRQPPGKGLEWIGEINHSGSTNYNPSLKSRVTISVDTSKNQFSLKLSSVTAADTAVYYCAR",
}
IGHJ4 = "YFDYWGQGTLVTVSS"
RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
CDR3_RESIDUES = "GGGYYYYSSSDDRRAAVTLPFWEN"
"""A CDR3 core's residues, weighted roughly as human CDR3s are (glycine, tyrosine, serine rich)."""


def heavy_chains(count: int, rng: np.random.Generator, lengths: tuple[int, int] = (111, 130)) -> list[str]:
    """`count` antibody-like heavy chains: a germline V gene with ~3% random point mutations
    (somatic hypermutation), a random CDR3 core and IGHJ4, each of a length drawn uniformly
    from `lengths` (inclusive)."""
    chains = []
    genes = list(IGHV.values())
    for _ in range(count):
        v = list(genes[rng.integers(len(genes))])
        for position in np.flatnonzero(rng.random(len(v)) < 0.03):
            v[position] = RESIDUES[rng.integers(len(RESIDUES))]
        length = int(rng.integers(max(lengths[0], len(v) + len(IGHJ4) + 1), lengths[1] + 1))
        core = "".join(CDR3_RESIDUES[i] for i in rng.integers(len(CDR3_RESIDUES), size=length - len(v) - len(IGHJ4)))
        chains.append("".join(v) + core + IGHJ4)
    return chains
