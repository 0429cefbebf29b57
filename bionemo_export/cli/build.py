"""Build Triton model repositories from model checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.build_precision import AUTO_INT8_MIN_SPEEDUP, describe_choice
from bionemo_export.choices import DEFAULT_WEIGHT_BLOCK_SIZE, BuildPrecision, Device, Exporter, Layout, build_precision
from bionemo_export.errors import UserError
from bionemo_export.model_repository.backends import AUTO, BackendChoice, backend_help, device_help
from bionemo_export.model_repository.options import GenerationLimits, ServingOptions

from . import debugging, reason

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.command("repo")
def repo(
    ctx: typer.Context,
    family: str | None = typer.Option(None, "--model", "-m", help="Model family: esm2, esm1, prott5, bert, "
                                      "megamolbart (see `bionemo-export build families`); optional for a .nemo "
                                      "archive, a NeMo 2 or an nv_esm directory, which name it."),
    checkpoint: list[Path] = typer.Option(..., help="Checkpoint: a Hugging Face model directory, a BioNeMo .nemo "
                                          "archive (model-parallel ones merged), a BioNeMo 2 / NeMo 2 directory "
                                          "(context/ + weights/), NVIDIA's nv_esm directory, a fair-esm .pt file, or "
                                          "the project's saved form. `bionemo-export inspect` shows what is read. "
                                          "Given several times: one ensemble of masked-LM checkpoints with one "
                                          "tokenizer (ESM-1v's five seeds), serving logits and scores averaged over "
                                          "the members (and each member's on request).",
                                          exists=True, resolve_path=True, metavar="PATH"),
    name: str = typer.Option(..., help="Name prefix of the served models: N_embeddings, N_hiddens, ..."),
    out: Path = typer.Option(..., help="Repository folder to create.", resolve_path=True),
    tasks: str | None = typer.Option(None, help="Comma-separated public tasks (default: all the family serves that "
                                     "the checkpoint can: logits and scores need a masked-LM head; contacts, "
                                     "ESM's contact head, only when named)."),
    backend: BackendChoice = typer.Option(AUTO, help=backend_help()),
    device: Device | None = typer.Option(ServingOptions.device, help=device_help()),
    exporter: Exporter = typer.Option(Exporter.TORCH, help="ONNX exporter: torch (torch.onnx) or navigator (Triton "
                                      "Model Navigator)."),
    precision: BuildPrecision = typer.Option(
        "fp32", help="Encoder graph precision: fp32; int8 (dynamic quantization, for CPU hosts: the fastest there); "
        "int8w, int4 (weight-only 8- or 4-bit blocks, for CPU hosts: int8w is the closest to fp32, int4 the "
        "smallest); fp16 (for GPU hosts); auto (the build chooses for this host: on a CPU int8 where it meets its "
        f"gate and runs at least {AUTO_INT8_MIN_SPEEDUP:g}x fp32 here, else fp32; on a GPU fp16, else fp32; tried "
        "in turn, recorded in manifest.json). A quantized graph is kept only with a margin over its tolerance; its "
        "accuracy cost against fp32 is written in manifest.json."),
    block_size: int = typer.Option(DEFAULT_WEIGHT_BLOCK_SIZE, help="int8w, int4: weights per quantization block "
                                   "(16, 32, 64, 128 or 256; smaller is closer to fp32, larger a little smaller)."),
    optimize: bool = typer.Option(True, help="Store the graphs optimized for ONNX Runtime (attention and transformer "
                                  "fusions, offline graph optimization), kept only if they verify against PyTorch."),
    memory_check: bool = typer.Option(True, help="Refuse at once a checkpoint whose build needs more memory than this "
                                      "host has, instead of being killed mid-build: about 1.3x its fp32 weights "
                                      "for models over 256 MB (their weights stay on disk; 1.5x to quantize), 9.5x "
                                      "below, plus 0.8 GiB; the build says which path it takes. The disk it "
                                      "writes beside --out is checked too (about 4x the fp32 weights in fp32)."),
    min_cosine: float | None = typer.Option(None, help="int8, int8w, int4, fp16: the least cosine against "
                                            "PyTorch fp32 the encoder's outputs must keep, in place of the "
                                            "precision's own tolerance (int4: embeddings 0.97); a lower value "
                                            "accepts a graph further from fp32, recorded in manifest.json and held "
                                            "by `verify` and the served model's load-time check."),
    stream_weights: bool | None = typer.Option(None, "--stream-weights/--no-stream-weights", help="int8w, int4: "
                                               "write the encoder's graph weight by weight from the checkpoint, "
                                               "quantized as it goes, for checkpoints whose fp32 weights do not "
                                               "fit in memory (ESM C 6B, ESM-2 15B); serves embeddings, hiddens "
                                               "and the heads. Default: when the memory check finds the other "
                                               "path does not fit here."),
    max_batch_size: int = typer.Option(ServingOptions.max_batch_size, help="Largest batch any model accepts "
                                       "(requests and dynamic batches)."),
    max_length: int | None = typer.Option(None, help="Maximum tokens per sequence, specials included "
                                          "(default: the model's own limit)."),
    truncate: bool = typer.Option(ServingOptions.truncate, help="Truncate sequences over the maximum length instead "
                                  "of refusing them."),
    tokenizer_instances: int = typer.Option(ServingOptions.tokenizer_instances, help="Instances of the tokenizer "
                                            "model (ensemble layout)."),
    decode_instances: int = typer.Option(ServingOptions.decode_instances, help="Instances of N_decodes (one joins "
                                         "every queued request into one batch)."),
    sampling_instances: int = typer.Option(ServingOptions.sampling_instances, help="Instances of N_samplings (a "
                                           "second answers while one runs a long request)."),
    encoder_instances: int = typer.Option(ServingOptions.encoder_instances, help="Instances of each graph model "
                                          "(encoder, cross_kv, decoder_step)."),
    intra_op_threads: int = typer.Option(ServingOptions.intra_op_threads, help="ONNX Runtime threads per graph-model "
                                         "instance (0: auto, the serving host's cores divided among the instances, "
                                         "at load time)."),
    max_queue_delay_microseconds: int = typer.Option(ServingOptions.max_queue_delay_microseconds, "--queue-delay-us",
                                                     help="Dynamic batcher's maximum queue delay in microseconds."),
    max_queue_size: int = typer.Option(ServingOptions.max_queue_size, help="Admission control: most requests "
                                       "waiting for each batched model; more are answered at once with "
                                       "UNAVAILABLE / HTTP 503 (0: no bound)."),
    queue_timeout_s: float = typer.Option(ServingOptions.queue_timeout_s, help="Admission control: most seconds "
                                          "a request waits in a queue before it is answered UNAVAILABLE / HTTP 503 "
                                          "(0: no bound)."),
    layout: Layout = typer.Option(ServingOptions.layout, help="fused (the encoder model tokenizes; python backend), "
                                  "ensemble (tokenizer model -> encoder model), or auto (fused with python, ensemble "
                                  "with native)."),
    length_bucket: int = typer.Option(ServingOptions.length_bucket, help="Encoder rows are padded to a multiple of "
                                      "this many tokens (1: each to its own length; 0: all to the longest, plain "
                                      "dynamic batching)."),
    token_budget: int = typer.Option(ServingOptions.token_budget, help="Most tokens (rows x padded length) in one "
                                     "encoder graph call (0: no limit)."),
    max_sub_batch: int = typer.Option(ServingOptions.max_sub_batch, min=0, help="Most rows in one encoder graph "
                                      "call (0: no row limit; `bionemo-export tune` finds the host's best)."),
    max_residues: int = typer.Option(ServingOptions.max_residues, min=0, help="Serve proteins up to this many "
                                     "residues (e.g. 10000) by overlapping windows of the model's length, merged by "
                                     "a documented rule (--backend python). 0: longer input stays an error."),
    window_overlap: int = typer.Option(ServingOptions.window_overlap, min=0, help="With --max-residues: residues "
                                       "consecutive windows share at least (0: a quarter of the window)."),
    response_cache: bool = typer.Option(ServingOptions.response_cache, help="Enable Triton's response cache on the "
                                        "public models (serve with --response-cache-mb)."),
    warmup: bool = typer.Option(ServingOptions.warmup, help="Warm the encoder up when the server loads it."),
    max_decode_length: int | None = typer.Option(None, help="Decoding families: most tokens one decode "
                                                 "produces (default: the model's limit)."),
    max_num_samples: int = typer.Option(GenerationLimits.max_num_samples, help="Samplings: most num_samples per "
                                        "request."),
    max_beam_size: int = typer.Option(GenerationLimits.max_beam_size, help="Samplings: most beam_size per request."),
    max_samples_x_beams: int = typer.Option(GenerationLimits.max_samples_x_beams, help="Samplings: most hypotheses "
                                            "decoded per sequence, num_samples x beam_size."),
    max_decode_tokens: int = typer.Option(GenerationLimits.max_decode_tokens, help="Decodes/samplings: most tokens "
                                          "of hidden states one decode attends to, rows x hypotheses x length."),
    max_attention_values: int = typer.Option(ServingOptions.max_attention_values, min=1, help="Attentions: most "
                                             "values one request's answer holds, rows x blocks x heads x tokens^2 "
                                             "(N_attentions' config parameter of the same name)."),
    force: bool = typer.Option(False, help="Replace OUT if it exists."),
    graph_cache: Path | None = typer.Option(None, help="A folder of exported graphs to reuse and fill: a rebuild of "
                                            "the same checkpoint with other serving options copies its graphs "
                                            "instead of exporting them again (each still checked against PyTorch). "
                                            "Default: the folder $BIONEMO_EXPORT_GRAPH_CACHE names, else none.",
                                            resolve_path=True),
) -> None:
    """Export a checkpoint and write a model repository that tritonserver serves directly."""
    from bionemo_export.build import BuildInterrupted, BuildRequest, build_repository
    from bionemo_export.build_staging import quiet_finalizers_after_an_interrupt

    console = Console()
    try:
        serving = ServingOptions(
            device=device, max_batch_size=max_batch_size, tokenizer_instances=tokenizer_instances,
            encoder_instances=encoder_instances, max_queue_delay_microseconds=max_queue_delay_microseconds,
            max_queue_size=max_queue_size, queue_timeout_s=queue_timeout_s,
            response_cache=response_cache, truncate=truncate, intra_op_threads=intra_op_threads, warmup=warmup,
            layout=layout, length_bucket=length_bucket, token_budget=token_budget, max_sub_batch=max_sub_batch,
            decode_instances=decode_instances,
            max_residues=max_residues, window_overlap=window_overlap,
            sampling_instances=sampling_instances, max_attention_values=max_attention_values,
            limits=GenerationLimits(max_num_samples=max_num_samples, max_beam_size=max_beam_size,
                                    max_samples_x_beams=max_samples_x_beams, max_decode_tokens=max_decode_tokens),
        )
        request = BuildRequest(
            family=family, checkpoint=checkpoint[0], members=tuple(checkpoint[1:]), name=name, out=out,
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None,
            exporter=exporter, backend=backend, max_length=max_length, force=force, serving=serving,
            max_decode_length=max_decode_length, precision=build_precision(precision), optimize=optimize,
            check_memory=memory_check, streamed=stream_weights, min_cosine=min_cosine,
            block_size=block_size,
        )
        if graph_cache is not None:  # else the request's default: $BIONEMO_EXPORT_GRAPH_CACHE
            request = dataclasses.replace(request, graph_cache=graph_cache)
        with console.status("building") as status:
            def progress(message: str) -> None:
                status.update(message)
                console.log(message)

            result = build_repository(request, progress=progress)
    except (UserError, ValueError) as err:  # a non-user ValueError is shown with its type (errors.reason)
        if debugging(ctx):
            raise
        console.print(f"[red]build failed:[/red] {reason(err)}", highlight=False)
        raise typer.Exit(1) from None
    except BuildInterrupted as err:
        quiet_finalizers_after_an_interrupt()  # the exit prints nothing after the one-line message
        console.print(f"[red]{err}[/red]", highlight=False)
        raise typer.Exit(128 + err.signum) from None  # the shell's status for "ended by this signal"
    manifest = result.manifest
    table = Table(title=f"ONNX vs PyTorch fp32 ({manifest.exporter} exporter, {manifest.precision})")
    for column in ("graph", "output", "max abs error", "min cosine", "tolerance", "ok"):
        table.add_column(column)
    for graph, report in manifest.verification["graphs"].items():
        for figures in report["outputs"]:
            tolerance = (f"cosine >= {figures['tolerance']['min_cosine']:g}" if "tolerance" in figures
                         else f"{report['atol']:.0e}")
            table.add_row(graph, figures["name"], f"{figures['max_abs_error']:.2e}", f"{figures['min_cosine']:.6f}",
                          tolerance, "yes" if figures["passed"] else "NO")
    console.print(table)
    if manifest.precision_choice:
        console.print(f"precision auto chose {manifest.precision} ({describe_choice(manifest.precision_choice)})",
                      highlight=False)
    if manifest.members:
        console.print(f"An ensemble of {len(manifest.members)} members: "
                      + ", ".join(f"{m['member']} {m['path']}" for m in manifest.members), highlight=False)
    console.print(f"Repository {result.repository} ({manifest.backend} backend): {', '.join(result.models)}")
    console.print(f"Serve it with: bionemo-export serve {result.repository}")


@app.command("families")
def families() -> None:
    """List the model families and the tasks each serves."""
    from bionemo_export.models import REGISTRY
    from bionemo_export.tasks import Requirement, get_task

    needs_head = {Requirement.LM_HEAD: "with a masked-LM head", Requirement.CLASSIFIER: "with a fine-tuned head",
                  Requirement.CONTACT_HEAD: "with the contact head"}

    def described(name: str) -> str:
        """The task with the head it needs ("with a masked-LM head"), and "when named" for a task
        a build leaves out unless --tasks names it."""
        task = get_task(name)
        needs = [needs_head[r] for r in task.requires if r in needs_head]
        notes = ([", ".join(needs)] if needs else []) + ([] if task.by_default else ["when named"])
        return f"{name} ({'; '.join(notes)})" if notes else name

    table = Table()
    for column in ("family", "checkpoint forms", "tasks", "description"):
        table.add_column(column)
    for family_name in sorted(REGISTRY):
        family = REGISTRY[family_name]
        tasks = [described(t) for t in family.possible_tasks()]
        table.add_row(family_name, ", ".join(family.forms()), ", ".join(tasks), family.description)
    Console().print(table)
