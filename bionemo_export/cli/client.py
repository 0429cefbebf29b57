"""Query served models: BioNeMo's client_encode / client_decode flags, plus files of any size.

Works against a generated repository (`bionemo-export serve`) and a dev server
(`bionemo-export dev-server`) alike. Inputs go in requests of the model's max_batch_size (read from
the server), several in flight, and the answers are written in input order.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from . import debugging, reason

if TYPE_CHECKING:
    from bionemo_export.client.triton import Inferrer

app = typer.Typer(help=__doc__, no_args_is_help=True)

URL_HELP = "http://host:port, or grpc://host:port for gRPC."
OUTPUT_HELP = ("Write the outputs here: .npz (arrays; with the record ids under `ids` for --input), else JSON "
               "{output_name: nested lists} as BioNeMo's client writes it (strings as strings; `ids` added for "
               "--input).")
INPUT_HELP = ("A FASTA file, a CSV/TSV with a header naming a sequence column (sequence, seq, smiles, protein) "
              "and an id column (id, name, accession), or one sequence per line (`SMILES [name]`); .gz read "
              "directly.")
SHARD_HELP = ("I/N: only the records whose position in --input is I modulo N (0 <= I < N): N jobs with I = 0..N-1 "
              "(a Slurm array, a Kubernetes Indexed Job) cover the file once.")
BATCH_HELP = "Sequences per request (default: the model's max_batch_size, read from the server)."
IN_FLIGHT_HELP = "Requests in flight at once."
STOP_HELP = "Stop at the first record the server refuses (default: report it by id and keep the others)."


@app.command("encode")
def encode(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Public model, e.g. esm2nv_embeddings or esm2nv_hiddens."),
    sequences: list[str] | None = typer.Option(None, "--sequences", "-s", help="A sequence; repeat for a batch."),
    input: str | None = typer.Option(None, "--input", "-i", help=INPUT_HELP + " Bulk jobs also read "
                                     "s3://bucket/path/file (downloaded once)."),
    shard: str = typer.Option("0/1", help=SHARD_HELP),
    triton_url: list[str] = typer.Option(["http://localhost:8000"], help=URL_HELP + " Bulk jobs: repeat it for "
                                         "several servers of the same repository (work goes to the least loaded; "
                                         "a busy or dead server's requests are sent again elsewhere)."),
    in_name: str = typer.Option("sequences", help="Name of the model's string input."),
    output: str | None = typer.Option(None, help=OUTPUT_HELP + " A folder, .h5 or .parquet runs a bulk job; "
                                      "s3://bucket/path/ (or s3://bucket/path/file.h5, .parquet) a bulk job whose "
                                      "output is kept in object storage."),
    batch_size: int | None = typer.Option(None, min=1, help=BATCH_HELP),
    in_flight: int = typer.Option(4, min=1, help=IN_FLIGHT_HELP),
    stop_on_error: bool = typer.Option(False, help=STOP_HELP),
    chunk_size: int = typer.Option(1024, min=1, help="Bulk jobs (--output DIR, .h5 or .parquet): records per "
                                   "part; a stopped job resumes after its last finished part."),
    precision: str = typer.Option("fp32", help="Bulk jobs: the stored values' precision, fp32 or fp16."),
    include: str | None = typer.Option(None, help="Bulk jobs: what to store of each record, comma-separated (ESM "
                                       "extract.py's names): mean, bos (the BOS/CLS token), max (pooled rows), "
                                       "per_tok (per-residue states), contacts (the [L, L] contact map). An "
                                       "N_embeddings model answers mean only; an N_hiddens model any of them from one "
                                       "pass, e.g. --include mean,per_tok; contacts asks the repository's N_contacts "
                                       "(built with --tasks ...,contacts) beside the model, e.g. --include "
                                       "mean,contacts, or alone. Default: what the model answers. Outside a bulk job "
                                       "(-s, or --input without a bulk --output) it asks the repository's N_layers, "
                                       "as --layers does, and N_contacts for contacts (outputs contacts [batch, L, "
                                       "L], 0-padded, and contacts_mask [batch, L])."),
    sequence_column: str | None = typer.Option(None, help="CSV/TSV input: the sequence column (default: sequence, "
                                               "seq, smiles, protein)."),
    id_column: str | None = typer.Option(None, help="CSV/TSV input: the id column (default: id, name, accession)."),
    allow_partial: bool = typer.Option(False, help="Bulk jobs: exit 0 when some records were refused (they are "
                                       "listed in the errors file) instead of 3: for schedulers that retry any "
                                       "other status (a Kubernetes Job)."),
    layers: str | None = typer.Option(None, help="Layers to answer, comma-separated, e.g. -1,20 (ESM's numbering: 0 "
                                      "the embedding layer's output, 1..N the blocks, negative from the end): asks "
                                      "the repository's N_layers model (built with --tasks ...,layers) whatever "
                                      "--model names, with --include mean (default), bos, max, per_tok (and "
                                      "contacts: N_contacts' maps beside them); outputs embeddings, embeddings_bos, "
                                      "embeddings_max [layers, H], hiddens [layers, T, H] and mask. A bulk job stores "
                                      "each pooling of each layer: the last under today's names, others with a "
                                      "_layer<i> suffix (embeddings_layer20)."),
) -> None:
    """Send sequences to a model and print (or save) every output: embeddings, or hiddens and mask
    (--include contacts: contact maps too, from the repository's N_contacts).

    With --input and --output DIR/, FILE.h5 or FILE.parquet it runs a bulk job: the input is
    streamed, answers are written as they come, duplicates are sent once, records the server
    refuses are listed in an errors file (exit status 3: partial), and the same command again
    resumes a stopped job where it stopped."""
    from bionemo_export.tasks import sibling_model

    bulk = input is not None and output is not None and _is_job_output(output)
    # --layers, or --include outside a bulk job (bos, max, contacts of a sequence asked at once): N_layers
    # and N_contacts answer them
    if layers is not None or model.endswith("_layers") or (include is not None and not bulk):
        if bulk:  # N_layers' poolings of each layer, one dataset/column per layer and pooling
            assert input is not None and output is not None
            _encode_job(ctx, model=sibling_model(model, "layers"), input=input, output=output, shard=shard,
                        triton_urls=triton_url, in_name=in_name, batch_size=batch_size, in_flight=in_flight,
                        chunk_size=chunk_size, precision=precision, include=include, sequence_column=sequence_column,
                        id_column=id_column, allow_partial=allow_partial, layers=layers or "-1")
            return
        _query(ctx, asks=_encode_asks(model, layers, include, in_name), sequences=sequences, input=_existing(input),
               shard=shard, triton_url=triton_url[0], output=Path(output) if output is not None else None,
               batch_size=batch_size, in_flight=in_flight, stop_on_error=stop_on_error)
        return
    if bulk:
        assert input is not None and output is not None
        _encode_job(ctx, model=model, input=input, output=output, shard=shard, triton_urls=triton_url,
                    in_name=in_name, batch_size=batch_size, in_flight=in_flight, chunk_size=chunk_size,
                    precision=precision, include=include, sequence_column=sequence_column, id_column=id_column,
                    allow_partial=allow_partial)
        return
    if len(triton_url) > 1 or (input is not None and input.startswith("s3://")):
        Console().print("[red]several --triton-url and s3:// inputs are for bulk jobs: give --input and --output "
                        "DIR/, .h5, .parquet or s3://bucket/path/[/red]", highlight=False)
        raise typer.Exit(2)
    _query(ctx, asks=[_Ask(model, lambda column: lambda rows, _: {in_name: column[rows]})], sequences=sequences,
           input=_existing(input), shard=shard, triton_url=triton_url[0],
           output=Path(output) if output is not None else None,
           batch_size=batch_size, in_flight=in_flight, stop_on_error=stop_on_error)


@app.command("sample")
def sample(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Public samplings model, e.g. megamolbart_samplings."),
    sequences: list[str] | None = typer.Option(None, "--sequences", "-s", help="A sequence; repeat for a batch."),
    input: Path | None = typer.Option(None, "--input", "-i", help=INPUT_HELP, exists=True, dir_okay=False),
    shard: str = typer.Option("0/1", help=SHARD_HELP),
    num_samples: int | None = typer.Option(None, help="Outputs per sequence (server default 1)."),
    sampling_method: str | None = typer.Option(
        None, help="greedy-perturbate (server default), topkp-perturbate, beam-search-perturbate, "
                   "beam-search-single-sample, beam-search-perturbate-sample."),
    scaled_radius: float | None = typer.Option(None, help="Noise scale on the hidden states (server default 1.0)."),
    seed: int | None = typer.Option(None, help="Random seed: the same seed and inputs give the same samples "
                                       "(request i of a split batch uses seed + i)."),
    top_k: int | None = typer.Option(None, help="topkp-perturbate: keep the k most likely tokens (0: off)."),
    top_p: float | None = typer.Option(None, help="topkp-perturbate: nucleus probability mass."),
    temperature: float | None = typer.Option(None, help="topkp-perturbate: softmax temperature."),
    beam_size: int | None = typer.Option(None, help="beam-search-perturbate(-sample): beams per search."),
    triton_url: str = typer.Option("http://localhost:8000", help=URL_HELP),
    output: Path | None = typer.Option(None, help=OUTPUT_HELP),
    batch_size: int | None = typer.Option(None, min=1, help=BATCH_HELP),
    in_flight: int = typer.Option(4, min=1, help=IN_FLIGHT_HELP),
    stop_on_error: bool = typer.Option(False, help=STOP_HELP),
) -> None:
    """Sample new sequences around each input (MegaMolBART's N_samplings); writes {"generated": [[...], ...]}."""
    from bionemo_export.client.repository import sampling_inputs

    extra = sampling_inputs(sampling_method=sampling_method, num_samples=num_samples, scaled_radius=scaled_radius,
                            seed=seed, top_k=top_k, top_p=top_p, temperature=temperature, beam_size=beam_size)
    _query(ctx, asks=[_Ask(model, lambda column: lambda rows, index: {"sequences": column[rows],
                                                                      **extra(rows, index)})],
           sequences=sequences, input=input, shard=shard, triton_url=triton_url, output=output,
           batch_size=batch_size, in_flight=in_flight, stop_on_error=stop_on_error)


@app.command("decode")
def decode(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Public decodes model, e.g. megamolbart_decodes."),
    input: Path = typer.Option(..., "--input", "-i", exists=True, dir_okay=False,
                               help="Hidden states: JSON as `client encode` (or BioNeMo's client) writes them, "
                                    "{NAME: [[[...]]], \"mask\": [[...]]}, or .npz; mask optional (all True)."),
    triton_url: str = typer.Option("http://localhost:8000", help=URL_HELP),
    in_name: str = typer.Option("hiddens", help="Name of the hidden states in the input file."),
    output: Path | None = typer.Option(None, help="Write the strings here: JSON list (BioNeMo's format), or "
                                          ".npz with `sequences` (and `ids` when the input had them)."),
    batch_size: int | None = typer.Option(None, min=1, help=BATCH_HELP),
    in_flight: int = typer.Option(4, min=1, help=IN_FLIGHT_HELP),
) -> None:
    """Decode hidden states into sequences (MegaMolBART's N_decodes)."""

    from bionemo_export.client import TritonClient, infer_rows
    from bionemo_export.client.files import read_hiddens, to_jsonable, write_outputs

    console = Console()
    _check_output(console, output)
    with _reported(ctx, console):
        hiddens, mask, ids = read_hiddens(input, in_name)
        if mask is None:
            mask = np.ones(hiddens.shape[:2], dtype=bool)
        with TritonClient(triton_url, concurrency=in_flight) as client, _progress(len(hiddens)) as advance:
            results = infer_rows(client, model, len(hiddens), lambda rows, _: {"hiddens": hiddens[rows],
                                                                               "mask": mask[rows]},
                                 outputs=["sequences"], batch_size=batch_size, in_flight=in_flight, progress=advance)
    strings = [row[0] for row in to_jsonable(results.outputs["sequences"])]
    if output is None:
        for string in strings:
            typer.echo(string)
    elif output.suffix == ".npz":
        write_outputs(output, {"sequences": results.outputs["sequences"][:, 0]}, ids)
        console.print(f"wrote {len(strings)} sequences to {output}", highlight=False)
    else:
        output.write_text(json.dumps(strings))
        console.print(f"wrote {len(strings)} sequences to {output}", highlight=False)


@app.command("score")
def score(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Public scores model, e.g. esm2nv_scores."),
    fasta: Path = typer.Option(..., "--fasta", exists=True, dir_okay=False,
                               help="The wild type(s): a FASTA file (one record, or several named by --id-column)."),
    variants: Path = typer.Option(..., "--variants", exists=True, dir_okay=False,
                                  help="A CSV with a `mutant` column (A42G, A42G:L43P; 1-based, as ProteinGym); "
                                       "other columns are kept."),
    output: Path = typer.Option(..., "--output", "-o", help="Write the CSV with the score column added here."),
    method: str | None = typer.Option(None, help="wt-marginal (one pass), masked-marginal (one masked pass "
                                      "per mutated position) or variant-masked (one pass per variant, all its "
                                      "positions masked: SaProt's); default: the model's default_method "
                                      "(variant-masked for SaProt, wt-marginal otherwise)."),
    column: str = typer.Option("mutant", help="The variants column."),
    id_column: str | None = typer.Option(None, help="The column naming each row's FASTA record (needed when "
                                            "the FASTA file holds several)."),
    score_column: str | None = typer.Option(None, help="Name of the added column (default: <method>_score)."),
    triton_url: str = typer.Option("http://localhost:8000", help=URL_HELP),
    in_flight: int = typer.Option(4, min=1, help=IN_FLIGHT_HELP),
    chunk_size: int = typer.Option(50_000, min=1, help="Rows read, scored and written at a time; a stopped run "
                                   "resumes after its last chunk written."),
    member_scores: bool = typer.Option(False, "--member-scores", help="A checkpoint ensemble's repository (`build "
                                       "repo` with --checkpoint once per member): also write each member's score, "
                                       "in columns <score column>_member1 ... _memberK beside the mean, from the "
                                       "same requests."),
) -> None:
    """Score every variant of a CSV against its wild type (N_scores), writing the CSV with a score
    column (with --member-scores, an ensemble's: one more per member). The CSV (.gz read directly)
    is read and written in chunks of 50,000 rows: a saturation scan of a proteome costs the client
    a chunk's memory, not the file's. A stopped run (Ctrl-C, kill, a server gone) resumes when the
    same command is run again, after its last chunk written."""
    from bionemo_export.client.records import read_records
    from bionemo_export.client.repository import RepositoryClient
    from bionemo_export.client.variants import (
        ScoredTableWriter,
        group_by_wild_type,
        iter_variant_tables,
        member_columns,
        score_fingerprint,
        wild_type_of_rows,
    )
    from bionemo_export.errors import InvalidInputError

    console = Console()
    if not model.endswith("_scores"):
        console.print(f"[red]--model {model}: a scores model's name ends in _scores[/red]", highlight=False)
        raise typer.Exit(2)
    _check_output(console, output)
    with _reported(ctx, console):
        records = read_records(fasta)
        tables = iter_variant_tables(variants, column, rows=chunk_size)
        first = next(tables)
        with RepositoryClient(model.removesuffix("_scores"), triton_url, in_flight=in_flight) as client, \
                _progress(0) as advance:
            members = client.members() if member_scores else 1
            if member_scores and members < 2:
                raise InvalidInputError(f"--member-scores: {model} serves one checkpoint (it has no member_scores "
                                        "output), so there are no members' scores to write; leave --member-scores "
                                        "out, or score with a checkpoint ensemble's repository (`build repo` with "
                                        "--checkpoint once per member)")
            method = method or client.default_scoring_method()
            run = score_fingerprint(model, client.client.model_config(model), fasta, variants, method=method,
                                    column=column, id_column=id_column, score_column=score_column,
                                    chunk_size=chunk_size,
                                    # only when asked: a plain run's journal reads as before
                                    **({"member_scores": True} if member_scores else {}))
            mean_column = score_column or f"{method}_score"
            columns = [mean_column, *(member_columns(mean_column, members) if member_scores else [])]
            with ScoredTableWriter(output, first.header, columns, run) as writer:
                if writer.resumed_rows:
                    console.print(f"resuming after {writer.resumed_rows} rows scored by an earlier run",
                                  highlight=False)
                for table in itertools.chain([first], tables):
                    if writer.skips(table):
                        continue
                    wild_types = wild_type_of_rows(table, records, id_column)
                    scores = np.zeros((len(table.rows), len(columns)), dtype=np.float32)
                    listed = table.variants()
                    for wild_type, rows in group_by_wild_type(wild_types).items():
                        asked = [listed[i] for i in rows]
                        if member_scores:
                            mean, each = client.scores_with_members(wild_type, asked, method, progress=advance)
                            scores[rows] = np.column_stack([mean, each.T])
                        else:
                            scores[rows, 0] = client.score_variants(wild_type, asked, method, progress=advance)
                    writer.write(table, scores)
    console.print(f"wrote {writer.rows} scores ({method})" + (f" and each of its {members} members'" if member_scores
                                                              else "") + f" to {output}", highlight=False)


@app.command("merge")
def merge(
    ctx: typer.Context,
    shards: list[str] = typer.Argument(..., help="The finished outputs of every shard of one job (--shard I/N): "
                                       "directories, .h5 or .parquet files, or s3://bucket/path/ folders."),
    output: Path = typer.Option(..., "--output", "-o", help="The merged output: a directory (parts and "
                                "manifest.json), FILE.h5 or FILE.parquet."),
) -> None:
    """Put the shards of one bulk job back together, in the input's order: the result is what the
    job run unsharded writes. Refuses shards of different jobs, a missing or repeated shard, and a
    shard that has not finished (rerun its command: it resumes)."""
    import tempfile

    from bionemo_export.client.merge import merge_shards
    from bionemo_export.runtime.job_storage import fetch_output, is_s3

    console = Console()
    with _reported(ctx, console), tempfile.TemporaryDirectory(prefix="bionemo-export-merge-") as downloads:
        # Shards in object storage are copied here first (an Indexed Job's pods wrote them there).
        local = [fetch_output(shard, Path(downloads) / str(number)) if is_s3(shard) else Path(shard)
                 for number, shard in enumerate(shards)]
        for shard, path in zip(shards, local, strict=True):
            if not path.exists():
                raise FileNotFoundError(f"{shard}: no such shard output")
        summary = merge_shards(local, output)
    console.print(f"merged {len(shards)} shards: " + summary.line(), highlight=False)
    if summary.partial:
        raise typer.Exit(3)


# ------------------------------------------------------------------------------------ helpers
def _is_job_output(output: str) -> bool:
    from bionemo_export.client.job_files import FORMATS

    return output.startswith("s3://") or Path(output).suffix in FORMATS or not Path(output).suffix


def _existing(input: str | None) -> Path | None:
    """--input as a file that exists, else the usage error typer gives for a missing path."""
    if input is None:
        return None
    if not Path(input).is_file():
        Console().print(f"[red]Invalid value for '--input' / '-i': File '{input}' does not exist.[/red]",
                        highlight=False)
        raise typer.Exit(2)
    return Path(input)


def _encode_job(ctx: typer.Context, *, model: str, input: str, output: str, shard: str, triton_urls: list[str],
                in_name: str, batch_size: int | None, in_flight: int, chunk_size: int, precision: str,
                include: str | None, sequence_column: str | None, id_column: str | None, allow_partial: bool,
                layers: str | None = None) -> None:
    """client encode as a bulk job (client/jobs.py), with a progress line of records/s, residues/s,
    bad records and retries. Another run holding the output: one red line naming it, exit status 2."""
    from bionemo_export.client.job_files import FORMATS
    from bionemo_export.client.job_lock import JobLockedError
    from bionemo_export.client.jobs import EncodeJob, JobProgress
    from bionemo_export.client.records import parse_shard
    from bionemo_export.client.server_pool import ServerPool
    from bionemo_export.errors import InvalidInputError
    from bionemo_export.runtime.job_storage import OutputMirror, fetch_input, is_s3, local_folder

    console = Console()
    with _reported(ctx, console):
        try:
            # The bar follows the input's bytes (known up front, unlike its records): its share done
            # and the time left; the rates are this run's (a resumed run skips what is done at once).
            columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                       TextColumn("{task.fields[records]} records, {task.fields[rates]}{task.fields[trouble]}"),
                       TimeElapsedColumn())
            with Progress(*columns, console=Console(stderr=True)) as bar:
                task = bar.add_task("encoding", total=1.0, records=0, rates="", trouble="")
                started, records, residues = time.monotonic(), 0, 0

                def advance(progress: JobProgress) -> None:
                    nonlocal records, residues
                    records, residues = records + progress.records, residues + progress.residues
                    seconds = max(time.monotonic() - started, 1e-9)
                    trouble = "".join([f", {progress.errors} bad" if progress.errors else "",
                                       f", {progress.retries} retried" if progress.retries else ""])
                    bar.update(task, completed=progress.fraction, records=records, trouble=trouble,
                               rates=f"{records / seconds:.1f} records/s, {residues / seconds:.0f} residues/s")

                def notice(line: str) -> None:
                    bar.console.print(f"[yellow]{line}[/yellow]", highlight=False)

                local_output, mirror = Path(output), None
                if is_s3(output):
                    name = output.rstrip("/").rpartition("/")[2]
                    if Path(name).suffix and Path(name).suffix not in FORMATS:
                        raise InvalidInputError(f"--output {output}: give s3://bucket/path/ (a folder of parts) or "
                                                f"a file ending in {', '.join(FORMATS)}")
                    local_output = local_folder(output) / name if Path(name).suffix else local_folder(output)
                    mirror = OutputMirror(output, local_output)
                    console.print(f"job folder: {local_output} (mirrored to {output})", highlight=False)
                local_input = fetch_input(input, local_folder(output) / "input") if is_s3(input) else _existing(input)
                assert local_input is not None  # given: a bulk job has an input
                job = EncodeJob(model=model, input=local_input, output=local_output, in_name=in_name,
                                shard=parse_shard(shard), chunk_size=chunk_size, batch_size=batch_size,
                                in_flight=in_flight, precision=precision, include=include, layers=layers,
                                sequence_column=sequence_column, id_column=id_column, progress=advance,
                                notice=notice, source=input if is_s3(input) else None, mirror=mirror)
                with ServerPool(triton_urls, concurrency=in_flight) as servers:
                    summary = job.run(servers)
        except JobLockedError as err:  # another run holds the output: not this run's failure (exit 2)
            if debugging(ctx):
                raise
            console.print(f"[red]{reason(err)}[/red]", highlight=False)
            raise typer.Exit(2) from None
    console.print(summary.line(), highlight=False)
    if summary.partial and not allow_partial:
        raise typer.Exit(3)


@dataclass(frozen=True)
class _Ask:
    """One model a query asks for every row, and the names its outputs are written under."""

    model: str
    make_inputs: Callable[[np.ndarray], Callable]
    """The query's strings column -> infer_rows' make_inputs."""
    outputs: list[str] | None = None
    """The outputs asked for; None: every output the model answers."""
    names: dict[str, str] = field(default_factory=dict)
    """Output -> the name it is written under, where that is not its own (two models' `mask`)."""
    check: Callable[[Inferrer], object] | None = None
    """Called with the client before anything is sent: refuses a model the server does not serve."""


def _encode_asks(model: str, layers: str | None, include: str | None, in_name: str) -> list[_Ask]:
    """encode --layers / --include outside a bulk job: the repository's N_layers for the layers'
    choices (mean, bos, max, per_tok), its N_contacts for contacts (written as contacts and
    contacts_mask)."""
    from bionemo_export.client.pooling import CONTACTS, include_choices, served_contacts_model
    from bionemo_export.tasks import sibling_model

    choices = include_choices(include) if include is not None else []
    others = [choice for choice in choices if choice != CONTACTS]
    asks = []
    if layers is not None or others or not choices:
        asks.append(_layer_request(model, layers, ",".join(others) or None, in_name))
    if CONTACTS in choices:
        asks.append(_Ask(sibling_model(model, CONTACTS), lambda column: lambda rows, _: {"sequences": column[rows]},
                         ["contacts", "mask"], names={"mask": "contacts_mask"},
                         check=lambda client: served_contacts_model(client, model)))
    return asks


def _layer_request(model: str, layers: str | None, include: str | None, in_name: str) -> _Ask:
    """The N_layers model of `model`'s repository asked for --layers and --include (its choices)."""
    import numpy as np

    from bionemo_export.errors import InvalidInputError
    from bionemo_export.tasks import LAYER_INCLUDE, LAYER_OUTPUTS, sibling_model

    try:
        values = [int(part) for part in (layers or "-1").split(",") if part.strip()]
    except ValueError:
        raise InvalidInputError(f"--layers {layers!r}: comma-separated layer numbers, e.g. -1,20") from None
    choices = [part.strip() for part in (include or "mean").split(",") if part.strip()]
    unknown = [c for c in choices if c not in LAYER_INCLUDE]
    if unknown or not choices or not values:
        raise InvalidInputError(f"--layers {layers} --include {include}: name at least one layer, and include among "
                                f"{', '.join(LAYER_INCLUDE)}")
    layer_column = np.array(values, dtype=np.int32)
    include_column = np.array([c.encode("utf-8") for c in choices], dtype=np.object_)

    def make_inputs(column):
        return lambda rows, _: {in_name: column[rows], "layers": np.tile(layer_column, (len(rows), 1)),
                                "include": np.tile(include_column, (len(rows), 1))}

    outputs = [name for choice, name in LAYER_OUTPUTS.items() if choice in choices]
    return _Ask(sibling_model(model, "layers"), make_inputs,
                outputs + (["hiddens", "mask"] if "per_tok" in choices else []))


def _query(ctx: typer.Context, *, asks: list[_Ask], sequences: list[str] | None, input: Path | None, shard: str,
           triton_url: str, output: Path | None, batch_size: int | None, in_flight: int, stop_on_error: bool) -> None:
    """encode and sample: strings from -s or --input through the `asks` models (most often one;
    `client encode --include mean,contacts`: N_layers and N_contacts for the same rows), outputs
    printed or written.

    From --input, a record the server refuses is reported by its id and left out (or ends the
    run with --stop-on-error), and the outputs carry the ids of the records they belong to; a
    record any of the models refuses is left out of all. -s sequences are one batch, as in
    BioNeMo's client: a refused sequence fails the command."""
    from bionemo_export.client import TritonClient, infer_rows
    from bionemo_export.client.batches import answered_together
    from bionemo_export.client.files import write_outputs
    from bionemo_export.client.records import Record, iter_records, parse_shard
    from bionemo_export.client.repository import strings_column

    console = Console()
    if (sequences is None) == (input is None):
        console.print("[red]give the sequences with -s/--sequences or a file with --input (one of them)[/red]")
        raise typer.Exit(2)
    _check_output(console, output)
    model = asks[0].model
    with _reported(ctx, console):
        if input is not None:
            records = list(iter_records(input, shard=parse_shard(shard)))
        else:
            assert sequences is not None  # one of the two, checked above
            records = [Record(f"sequence {i}", s, 0) for i, s in enumerate(sequences)]
        if input is not None and not records:
            from bionemo_export.errors import InvalidInputError

            raise InvalidInputError(f"{input}: no sequences in the file" + (f" for shard {shard}" if shard != "0/1"
                                                                               else ""))
        # Records with no sequence are not sent, unless the run stops at the first bad record: then
        # the server's refusal of it keeps the file's order of bad records.
        sent = [record for record in records if record.sequence] if input and not stop_on_error else records
        column = strings_column([record.sequence for record in sent])
        with TritonClient(triton_url, concurrency=in_flight) as client, \
                _progress(len(records) * len(asks) if input else 0) as advance:
            for ask in asks:
                if ask.check is not None:
                    ask.check(client)
            advance((len(records) - len(sent)) * len(asks))  # records with no sequence: done, nothing to send
            answers = answered_together([
                infer_rows(client, ask.model, len(sent), ask.make_inputs(column), outputs=ask.outputs,
                           batch_size=batch_size, in_flight=in_flight, isolate=input is not None,
                           stop_on_failure=stop_on_error, progress=advance) for ask in asks])
    skipped = [record for record in records if not record.sequence] if len(sent) < len(records) else []
    failures = [(record, "no sequence after its header") for record in skipped]
    failures += [(sent[row], message) for row, message in answers[0].failures]
    for record, message in sorted(failures, key=lambda failure: failure[0].line):
        console.print(f"[red]bad record {record.id} (line {record.line}): {message}[/red]", highlight=False)
    if failures and stop_on_error:
        raise typer.Exit(1)
    ids = [sent[row].id for row in answers[0].rows] if input else None
    outputs = {ask.names.get(name, name): value for ask, answer in zip(asks, answers)
               for name, value in answer.outputs.items()}
    if model.endswith("_logits"):  # log_probs' last axis, named: the config's alphabet (tasks.py: N_logits)
        with TritonClient(triton_url) as client:
            alphabet = (client.model_config(model).get("parameters") or {}).get("alphabet", {}).get("string_value")
        if alphabet:
            outputs["alphabet"] = np.array([token.encode("utf-8") for token in json.loads(alphabet)], dtype=np.object_)
    if input:
        console.print(f"{len(answers[0].rows)} of {len(records)} records answered"
                      + (f"; {len(failures)} bad records left out" if failures else ""), highlight=False)
    if output:
        write_outputs(output, outputs, ids)
        console.print(f"wrote {', '.join(outputs) or 'nothing'} to {output}", highlight=False)
        return
    _print_outputs(console, outputs)


def _print_outputs(console: Console, outputs: dict[str, np.ndarray]) -> None:
    from bionemo_export.client.files import to_jsonable

    for name, value in outputs.items():
        console.print(f"{name}: shape {list(value.shape)} {value.dtype}", highlight=False)
        console.print(np.array2string(value, threshold=20, precision=4) if value.dtype != object
                      else str(to_jsonable(value)), highlight=False)


@contextmanager
def _reported(ctx: typer.Context, console: Console) -> Iterator[None]:
    """Errors a user can act on (the server's refusal, an unreachable server, a bad input file)
    as one red line and exit status 1; --debug re-raises them with the traceback."""
    from bionemo_export.client import InferenceError

    try:
        yield
    except (InferenceError, ValueError, ConnectionError, OSError) as err:
        if debugging(ctx):
            raise
        console.print(f"[red]{reason(err)}[/red]", highlight=False)
        raise typer.Exit(1) from None


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr over `total` rows (none for 0); yields the function that advances it."""
    if not total:
        yield lambda done: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("records", total=total)
        yield lambda done: progress.advance(task, done)


def _check_output(console: Console, output: Path | None) -> None:
    if output is not None and (problem := _unwritable(output)):
        console.print(f"[red]--output {output}: {problem}[/red]", highlight=False)
        raise typer.Exit(2)


def _unwritable(path: Path) -> str | None:
    """Why a JSON file cannot be written at `path` (checked before the request is sent), or None."""
    if path.is_dir():
        return "is a folder; give a file name"
    if not path.parent.is_dir():
        return f"{path.parent} is not an existing folder"
    return None
