"""The input of the bulk-job tests and benchmarks: a gzipped FASTA of random proteins with what a
real dataset holds that a job must handle (sequences repeated under other ids, a record the model
refuses), so that each module does not write its own."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

AMINO_ACIDS = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype="S1")
BAD_RECORD = ("bad_char", "MKTJAK")
"""A record ESM-2's alphabet refuses (J): the one line of an errors file."""


def write_proteins(path: Path, count: int, seed: int = 0, *, longest: int = 60,
                   bad_at: int | None = None) -> list[tuple[str, str]]:
    """(id, sequence) of `count` proteins of 5 to `longest` - 1 residues written to `path` (gzipped
    FASTA, a description after each id): every 17th from the 7th repeats an earlier sequence under its
    own id, and the record at `bad_at` (default: the middle one) is BAD_RECORD."""
    rng = np.random.default_rng(seed)
    records = [(f"p{i:05d}", AMINO_ACIDS[rng.integers(0, len(AMINO_ACIDS), size=int(n))].tobytes().decode())
               for i, n in enumerate(rng.integers(5, longest, size=count))]
    for i in range(7, count, 17):
        records[i] = (records[i][0], records[i // 3][1])
    records[count // 2 if bad_at is None else bad_at] = BAD_RECORD
    with gzip.open(path, "wt") as handle:
        handle.write("".join(f">{i} description\n{s}\n" for i, s in records))
    return records
