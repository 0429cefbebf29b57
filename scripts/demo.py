"""The main job on the embedded default, end to end, on the real pretrained AntiBERTy model.

1. build a model repository from the AntiBERTy checkpoint shipped in the antiberty==0.1.3 wheel
   (the same as `bionemo-export build repo --model bert --checkpoint <that folder> ...`);
2. serve it with the real tritonserver from nvidia-pytriton (`bionemo-export serve`);
3. query `antiberty_embeddings` and `antiberty_hiddens` over gRPC and HTTP;
4. compare the served answers with PyTorch (`bionemo-export verify`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import EncoderClient
from bionemo_export.kits.encoder import verify_served
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.runtime import TritonServer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "demo_out"
HEAVY_CHAIN = "EVQLVESGGGLVQPGGSLRLSCAASGFTFSSYAMSWVRQAPGKGLEWVSAISGSGGSTYYADSVKGRFTISRDNSKNTLYLQMNSLRAEDTAVYYCAK"
LIGHT_CHAIN = "DIQMTQSPSSLSASVGDRVTITCRASQSISSYLNWYQQKPGKAPKLLIYAASSLQSGVPSRFSGSGSGTDFTLTISSLQPEDFATYYCQQSYSTP"


def main() -> int:
    console = Console()
    checkpoint = antiberty_checkpoint()
    repository = OUT / "model_repository"
    console.rule("1. build")
    console.print(f"bionemo-export build repo --model bert --checkpoint {checkpoint} --name antiberty "
                  f"--out {repository} --force")
    started = time.perf_counter()
    result = build_repository(
        BuildRequest(family="bert", checkpoint=checkpoint, name="antiberty", out=repository, force=True),
        progress=lambda message: console.log(message),
    )
    worst = max(output["max_abs_error"] for report in result.manifest.verification["graphs"].values()
                for output in report["outputs"])
    console.print(f"built {', '.join(result.models)} in {time.perf_counter() - started:.1f} s "
                  f"(ONNX vs PyTorch: max abs error {worst:.1e})")

    console.rule("2. serve")
    with TritonServer(repository, log_file=OUT / "tritonserver.log") as server:
        ep = server.endpoints
        console.print(f"tritonserver {server.metadata()['version']}: http://{ep.http_url} grpc://{ep.grpc_url}")

        console.rule("3. query")
        with EncoderClient("antiberty", f"grpc://{ep.grpc_url}") as client:
            embeddings = client.seqs_to_embedding([HEAVY_CHAIN, LIGHT_CHAIN])
        with EncoderClient("antiberty", f"http://{ep.http_url}") as client:
            hiddens, mask = client.seqs_to_hidden([HEAVY_CHAIN, LIGHT_CHAIN])
        first = ", ".join(f"{value:.4f}" for value in embeddings[0, :4])
        console.print(f"antiberty_embeddings (gRPC): shape {list(embeddings.shape)}, heavy chain [:4] = {first}")
        console.print(f"antiberty_hiddens (HTTP): hiddens {list(hiddens.shape)}, mask {list(mask.shape)} "
                      f"with {mask.sum(1).tolist()} residues")

        console.rule("4. verify against PyTorch")
        family = get_family("bert")
        loaded = family.load(checkpoint)
        samples = family.sample_sequences()
        with EncoderClient("antiberty", f"grpc://{ep.grpc_url}") as client:
            checks = verify_served(client, loaded, ["embeddings", "hiddens"], [samples, [HEAVY_CHAIN]],
                                   family.atol, family.min_cosine)
    table = Table()
    for column in ("model", "batch", "max abs error", "min cosine", "mask exact", "ok"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.model, check.batch, f"{check.max_abs_error:.2e}", f"{check.min_cosine:.6f}",
                      "" if check.mask_exact is None else str(check.mask_exact), "yes" if check.passed else "NO")
    console.print(table)
    ok = all(check.passed for check in checks)
    console.print("demo passed" if ok else "[red]served outputs differ from PyTorch[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
