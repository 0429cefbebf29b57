"""perf_analyzer `--input-data` for a served model's real inputs.

perf_analyzer's real-data JSON (documented in perf_analyzer's `input_data.md`) is

    {"data": [{"sequences": {"content": ["MKTAY..."], "shape": [1]}}, ...]}

one entry per request (batch 1), the shape without the batch axis; FP32 content may be given as
`{"b64": ...}` (raw little-endian bytes) to keep large tensors small. perf_analyzer cycles through
the entries, so the entries' mean length is the mean length of what it sends.

What is generated, by the model's inputs (from the server's model metadata):
- one BYTES input of shape [1] (`sequences`): protein sequences of random residues drawn with
  UniProtKB/Swiss-Prot amino-acid frequencies (the 20 standard residues only), with lengths from a
  distribution (`LENGTH_DISTRIBUTIONS`), or the sequences of a FASTA / one-per-line file;
- FP32 [-1, H] plus BOOL [-1] (`hiddens` + `mask`, a decodes model): standard-normal hidden
  states of the drawn lengths, every position real (mask all True).
Optional inputs are left out (the model's defaults apply). Everything is seeded.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bionemo_export.errors import UserError
from bionemo_export.tensors import DType, TensorSpec

# Amino-acid composition of UniProtKB/Swiss-Prot (its release statistics, percent; rounded), the
# 20 standard residues; normalized where used.
AMINO_ACID_FREQUENCIES = {
    "A": 8.25, "R": 5.53, "N": 4.06, "D": 5.45, "C": 1.37, "Q": 3.93, "E": 6.75, "G": 7.07,
    "H": 2.27, "I": 5.96, "L": 9.66, "K": 5.84, "M": 2.42, "F": 3.86, "P": 4.70, "S": 6.56,
    "T": 5.34, "W": 1.08, "Y": 2.92, "V": 6.87,
}
STANDARD_AMINO_ACIDS = "".join(AMINO_ACID_FREQUENCIES)

#: Named length distributions (`--lengths NAME`); `uniform:A-B`, `fixed:N` and
#: `lognormal:MEDIAN,SIGMA` are parsed as well.
LENGTH_DISTRIBUTIONS = {
    # UniProt-like proteins: log-normal with median 300 and sigma 0.6 (mean ~360 residues, close to
    # Swiss-Prot's; 5-95% ~110-800), clipped to 30-1000 so it fits ESM-2's 1022-residue limit.
    "uniprot": "lognormal:300,0.6",
    # Antibody variable domains (VH ~115-130, VL ~105-115 residues): uniform 110-130.
    "antibody": "uniform:110-130",
    # Drug-like SMILES / MegaMolBART token counts: log-normal median 40, sigma 0.35, 10-120.
    "smiles": "lognormal:40,0.35",
}
DEFAULT_LENGTHS = "uniprot"
DEFAULT_HIDDEN_LENGTHS = "smiles"
_LOGNORMAL_BOUNDS = {"uniprot": (30, 1000), "smiles": (10, 120)}


class InputError(UserError, ValueError):
    """Bad benchmark input: an unknown distribution, a bad file, or inputs we cannot generate."""


# -- length distributions ----------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDistribution:
    """Sequence lengths: `kind` is uniform, fixed or lognormal; lengths are clipped to [low, high]."""

    spec: str
    kind: str
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        text = spec.strip().lower()
        bounds = _LOGNORMAL_BOUNDS.get(text)
        resolved = LENGTH_DISTRIBUTIONS.get(text, text)
        kind, _, args = resolved.partition(":")
        try:
            if kind == "uniform":
                low, high = (int(v) for v in args.split("-"))
                dist = cls(spec, "uniform", low, high)
            elif kind == "fixed":
                n = int(args)
                dist = cls(spec, "fixed", n, n)
            elif kind == "lognormal":
                parts = args.split(",")
                median, sigma = float(parts[0]), float(parts[1])
                low, high = bounds or (1, max(1, int(round(median * math.exp(3 * sigma)))))
                if len(parts) == 3:
                    low, high = (int(v) for v in parts[2].split("-"))
                dist = cls(spec, "lognormal", low, high, median=median, sigma=sigma)
            else:
                raise ValueError
        except (ValueError, IndexError):
            raise InputError(
                f"unknown length distribution {spec!r}: use one of {', '.join(LENGTH_DISTRIBUTIONS)}, "
                "uniform:MIN-MAX, fixed:N or lognormal:MEDIAN,SIGMA[,MIN-MAX]"
            ) from None
        if dist.low < 1 or dist.high < dist.low or (kind == "lognormal" and (dist.median <= 0 or dist.sigma < 0)):
            raise InputError(f"bad length distribution {spec!r}: lengths must satisfy 1 <= MIN <= MAX")
        return dist

    def sample(self, count: int, rng: np.random.Generator, max_length: int | None = None) -> np.ndarray:
        """`count` lengths (int64), clipped to the distribution's bounds and to `max_length`."""
        if self.kind == "lognormal":
            lengths = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=count))
        else:
            lengths = rng.integers(self.low, self.high + 1, size=count)
        high = self.high if max_length is None else min(self.high, max_length)
        return np.clip(lengths, min(self.low, high), high).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "lognormal":
            return (f"{self.spec}: log-normal, median {self.median:g}, sigma {self.sigma:g}, "
                    f"clipped to {self.low}-{self.high}")
        if self.kind == "fixed":
            return f"{self.spec}: fixed {self.low}"
        return f"{self.spec}: uniform {self.low}-{self.high}"


def random_proteins(lengths: np.ndarray, rng: np.random.Generator) -> list[str]:
    """Protein sequences of the given lengths, residues drawn with Swiss-Prot frequencies."""
    letters = np.frombuffer(STANDARD_AMINO_ACIDS.encode(), dtype=np.uint8)
    p = np.array(list(AMINO_ACID_FREQUENCIES.values()))
    p = p / p.sum()
    return [letters[rng.choice(len(letters), size=int(n), p=p)].tobytes().decode() for n in lengths]


# -- files -------------------------------------------------------------------------------------

_PROTEIN = re.compile(r"^[A-Z]+$")


def substitutions(sequence: str, count: int, rng: np.random.Generator) -> list[str]:
    """`count` single substitutions of `sequence` (`A42G`, 1-based), at random positions, each to
    another of the 20 standard amino acids (residues outside them are not mutated)."""
    positions = [i for i, residue in enumerate(sequence) if residue in STANDARD_AMINO_ACIDS]
    if not positions:
        return []
    chosen = rng.choice(positions, size=count, replace=count > len(positions))
    variants = []
    for i in chosen.tolist():
        others = [a for a in STANDARD_AMINO_ACIDS if a != sequence[i]]
        variants.append(f"{sequence[i]}{i + 1}{others[int(rng.integers(len(others)))]}")
    return variants


def read_sequences(path: str | Path) -> list[tuple[str, str]]:
    """(id, sequence) pairs from a FASTA file (any line starts with `>`), or from a file with one
    sequence (SMILES, protein) per line (first whitespace-separated field; blank lines and `#` comments skipped).

    FASTA records may span lines; residues are upper-cased and a trailing `*` is dropped. A record
    that is empty or holds anything but letters (gaps, digits, ...) is an error; every bad record
    is named by its id in one `InputError`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise InputError(f"{path}: {err.strerror or err}") from None
    lines = text.splitlines()
    is_fasta = any(line.lstrip().startswith(">") for line in lines)
    records = _parse_fasta(lines) if is_fasta else _parse_lines(lines)
    problems = [f"{rid}: {problem}" for rid, _, problem in records if problem]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InputError(f"{path}: {len(problems)} bad record(s):\n  {shown}{more}")
    if not records:
        raise InputError(f"{path}: no sequences")
    return [(rid, seq) for rid, seq, _ in records]


def _parse_fasta(lines: list[str]) -> list[tuple[str, str, str | None]]:
    records: list[tuple[str, list[str], int]] = []
    orphan = 0
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith(">"):
            header = line[1:].split()
            records.append((header[0] if header else f"<record at line {number}>", [], number))
        elif not records:
            orphan += 1
        else:
            records[-1][1].append(line)
    out: list[tuple[str, str, str | None]] = []
    if orphan:
        out.append(("<before the first header>", "", f"{orphan} sequence line(s) before the first '>' header"))
    for rid, parts, _ in records:
        seq = "".join(parts).replace(" ", "").upper()
        if seq.endswith("*"):
            seq = seq[:-1]
        if not seq:
            problem = "empty sequence"
        elif not _PROTEIN.match(seq):
            bad = sorted({c for c in seq if not ("A" <= c <= "Z")})
            problem = f"invalid character(s) {''.join(bad)!r}"
        else:
            problem = None
        out.append((rid, seq, problem))
    return out


def _parse_lines(lines: list[str]) -> list[tuple[str, str, str | None]]:
    out: list[tuple[str, str, str | None]] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        rid = fields[1] if len(fields) > 1 else f"line {number}"
        out.append((rid, fields[0], None))
    return out


# -- tensors and the JSON ----------------------------------------------------------------------


@dataclass
class InputSpec:
    """What to send: a length distribution (random sequences / hiddens) or a file's sequences."""

    lengths: str | None = None  # None: DEFAULT_LENGTHS (strings) / DEFAULT_HIDDEN_LENGTHS (hiddens)
    file: Path | None = None
    count: int = 256  # entries in the JSON (requests perf_analyzer cycles through)
    seed: int = 0
    max_length: int | None = None  # clip generated lengths (residues) to this
    variants: int = 32
    """For a scores model (an optional `variants` input): single substitutions per request, at
    random positions of its sequence (wt-marginal, the server's default method)."""
    layers: tuple[int, ...] = ()
    """For a layers model (N_layers: optional `layers` and `include` inputs): the layers every request
    asks for (ESM's numbering, -1 the last); () leaves them out (the server's default: the last)."""
    include: tuple[str, ...] = ()
    """For a layers model: what every request asks for (mean, bos, max, per_tok); (): the default, mean."""
    heads: tuple[int, ...] = ()
    """For an attentions model (N_attentions: optional `layers` and `heads` inputs): the heads every
    request asks for; (): left out, every head. Its `layers` are the blocks (1..N, -1 the last)."""


@dataclass
class InputData:
    """Generated perf_analyzer input data plus what the report needs to know about it."""

    entries: list[dict]
    lengths: list[int]  # tokens (residues, SMILES characters, hidden positions) per request
    description: str
    kind: str  # "sequences" or "hiddens"
    notes: list[str] = field(default_factory=list)

    @property
    def mean_length(self) -> float:
        return float(np.mean(self.lengths)) if self.lengths else 0.0

    def to_json(self) -> dict:
        return {"data": self.entries}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path


def _bytes_entry(name: str, text: str) -> dict:
    return {name: {"content": [text], "shape": [1]}}


def generate_inputs(inputs: list[TensorSpec], spec: InputSpec) -> InputData:
    """perf_analyzer input data for a model with these (required) inputs."""
    required = [t for t in inputs if not t.optional]
    # A scores model (tasks.py: N_scores) gets generated variants; its other optional inputs keep their defaults.
    sends_variants = spec.variants > 0 and any(t.name == "variants" and t.optional and t.dtype is DType.BYTES
                                               for t in inputs)
    # A layers model (tasks.py: N_layers) gets the layers and poolings asked for, an attentions model
    # (N_attentions) the blocks and heads, the same in every request.
    optional = {t.name for t in inputs if t.optional}
    choices = {name: values for name, values in (("layers", spec.layers), ("include", spec.include),
                                                 ("heads", spec.heads)) if values and name in optional}
    skipped = [t.name for t in inputs if t.optional and not (sends_variants and t.name == "variants")
               and t.name not in choices]
    notes = [f"optional input(s) left out: {', '.join(skipped)}"] if skipped else []
    rng = np.random.default_rng(spec.seed)
    if spec.count < 1:
        raise InputError("the number of generated inputs must be at least 1")

    strings = [t for t in required if t.dtype is DType.BYTES]
    if len(required) == 1 and strings and strings[0].dims in ((1,), (-1,)):
        name = strings[0].name
        if spec.file is not None:
            records = read_sequences(spec.file)
            sequences = [seq for _, seq in records]
            if spec.max_length is not None:
                too_long = [rid for rid, seq in records if len(seq) > spec.max_length]
                if too_long:
                    raise InputError(f"{spec.file}: {len(too_long)} sequence(s) longer than the model's "
                                     f"{spec.max_length}: {', '.join(too_long[:10])}")
            description = f"{len(sequences)} sequences from {spec.file}"
        else:
            dist = LengthDistribution.parse(spec.lengths or DEFAULT_LENGTHS)
            lengths = dist.sample(spec.count, rng, spec.max_length)
            sequences = random_proteins(lengths, rng)
            description = (f"{spec.count} random proteins (Swiss-Prot residue frequencies, seed {spec.seed}), "
                           f"lengths {dist.describe()}")
            if spec.max_length is not None and spec.max_length < dist.high:
                notes.append(f"lengths clipped to the model's maximum of {spec.max_length} residues")
        entries = [_bytes_entry(name, s) for s in sequences]
        if sends_variants:
            for entry, sequence in zip(entries, sequences):
                variants = substitutions(sequence, spec.variants, rng)
                entry["variants"] = {"content": variants, "shape": [len(variants)]}
            description += f"; {spec.variants} random single substitutions each (variants)"
        for name, values in choices.items():
            content = [str(v) for v in values] if name == "include" else [int(v) for v in values]
            for entry in entries:
                entry[name] = {"content": content, "shape": [len(content)]}
            description += f"; {name} {','.join(str(v) for v in content)}"
        return InputData(entries, [len(s) for s in sequences], description, "sequences", notes)

    floats = [t for t in required if t.dtype is DType.FP32 and len(t.dims) == 2]
    bools = [t for t in required if t.dtype is DType.BOOL and len(t.dims) == 1]
    if len(required) == 2 and floats and bools:
        hiddens, mask = floats[0], bools[0]
        width = hiddens.dims[1]
        if not isinstance(width, int) or width < 1:
            raise InputError(f"input {hiddens.name!r} has no fixed hidden width: {list(hiddens.dims)}")
        if spec.file is not None:
            raise InputError(f"`file` gives sequences; the model's inputs are {hiddens.name!r} and {mask.name!r} "
                             "(hidden states): use `lengths`")
        dist = LengthDistribution.parse(spec.lengths or DEFAULT_HIDDEN_LENGTHS)
        lengths = dist.sample(spec.count, rng, spec.max_length)
        entries = []
        for n in lengths:
            values = rng.standard_normal((int(n), width), dtype=np.float32)
            entries.append({
                hiddens.name: {"content": {"b64": base64.b64encode(values.astype("<f4").tobytes()).decode()},
                               "shape": [int(n), width]},
                mask.name: {"content": [True] * int(n), "shape": [int(n)]},
            })
        description = (f"{spec.count} random hidden states N(0, 1) of width {width} (seed {spec.seed}), "
                       f"lengths {dist.describe()}, mask all True")
        return InputData(entries, [int(n) for n in lengths], description, "hiddens", notes)

    described = ", ".join(f"{t.name} {t.dtype} {list(t.dims)}" for t in required)
    raise InputError(
        f"cannot generate inputs for a model whose inputs are: {described}. Supported: one BYTES [1] "
        "input (sequences), or FP32 [-1, H] + BOOL [-1] (hiddens + mask)"
    )
