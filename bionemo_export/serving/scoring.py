"""Variant-effect and pseudo-log-likelihood scores from a masked language model (the `N_scores` task).

Part of the served package, copied whole into generated Triton Python-backend model folders and imported there
as `import scoring`, so it imports only the standard library and numpy (never torch, transformers,
onnxruntime or bionemo_export). Everything the served model does besides calling the masked-LM
head is here, unit-tested without a server; the served model stays wiring:

    plan = scoring.plan_request(wild_type, variants, method, alphabet=ALPHABET, limits=LIMITS)
    sites = []
    for call in scoring.pack_passes([plan.passes], max_batch_size):
        for _, part in call:
            log_probs = run_logits(plan.inputs(MASK_CHAR, part))  # [n, L, A]: BOS/EOS rows dropped
            sites.append(plan.site_log_probs(log_probs, part))
    scores = plan.scores(np.concatenate(sites))      # FP32 [variants], or [1]: the PLL

A request of several wild types packs their sequences into the same calls (`pack_passes`: each
call a list of (plan, slice of its inputs)), so every call but the last is full whatever the rows.

Methods (the conventions of ESM's examples/variant-prediction/predict.py and AntiBERTy's runner):

- `wt-marginal` (default with variants) runs the unmasked wild type, once; a mutation's score is
  log p(mutant) - log p(wild type) at its position.
- `masked-marginal` runs one copy per DISTINCT mutated position, that position masked; a mutation's
  score is the same difference, read from the copy that masks the position.
- `variant-masked` (SaProt's zero-shot convention, `predict_mut` of westlake-repl/SaProt's
  SaprotFoldseekMutationModel; the default with variants of the saprot family) runs one copy per
  DISTINCT set of mutated positions, every mutated position of the variant masked at once; each
  mutation's difference is read from the copy of its own variant. For single mutants it equals
  masked-marginal.
- `pll` (default without variants) runs one copy per residue, that residue masked; the result is the
  MEAN over positions of log p(true residue) at the masked position.

A variant's score is the SUM of its mutations' scores (ESM's predict.py; ProteinGym's
multi-mutants; SaProt's predict_mut). The PLL is the mean, not the sum (AntiBERTy's
`pseudo_log_likelihood`). The default method with variants is `wt-marginal` unless the served model
says otherwise (its `default_method` parameter: `variant-masked` for SaProt).

Structure-aware wild types (SaProt: `plan_request`'s `split_structure`): the wild type is read as its
tokenizer reads it (tokenizers/structure_aware.py: `MdEvVp`, or plain residues with unknown structure), variants
index its RESIDUES (1-based, pairs, not characters), and the copies sent to the model are
structure-aware strings whose masked residues are the mask character `#` followed by the residue's
own 3Di letter (`#d`), as SaProt's predict_mut masks them.

Log-probabilities are rows over `alphabet` (column j is `alphabet[j]`; the characters that have a
column of their own, special tokens excluded from the softmax, as `N_logits` returns them). A
mutation's score is a difference at one position, so it is the same whether the softmax ran over
the alphabet or the model's whole vocabulary (the normalizer cancels); the PLL is not, and uses the
alphabet's softmax, as AntiBERTy's runner does (it sets the special tokens' logits to -inf).

Variants (input `variants`, one string each): `A42G` is the wild-type residue, its 1-based position
(ProteinGym's convention) and the mutant residue; `A42G:L43P` is a multi-mutant. The rules, each
broken rule a `ScoringError` naming the variant as `variants[i] = '...'` (i: 0-based index in the
request) and the problem:
- no whitespace anywhere, not even around the variant (the tokenizers strip nothing either; a
  client reading a CSV strips its cells): one canonical spelling, and an error that says so;
- the position is between 1 and the wild type's length, and the sequence holds the written
  wild-type residue there (predict.py asserts the same);
- both residues are in the alphabet (case matters: `a42g` is refused, as the tokenizers refuse `a`);
- a position is mutated at most once per variant; a mutation to the same residue (`A42A`) is
  allowed and scores 0.
Residues outside the alphabet in the wild type (e.g. `X` where the model has no column for it) are
context the model reads like any other token; a mutation at such a position is refused (there is no
log-probability to compare), and `pll` refuses such a sequence, naming the position, rather than
skipping it or returning -inf: a PLL over fewer residues than the sequence has would not be
comparable with others. A wild type that holds the mask character is refused (a wild type is not
a masked sequence).

Errors: `ScoringError` (a ValueError) is the request's fault: the served model answers
INVALID_ARGUMENT with its message. A plain ValueError from `site_log_probs` or `scores` (wrong
shapes) is the caller's bug, not the client's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

METHODS = ("wt-marginal", "masked-marginal", "variant-masked", "pll")
"""The scoring methods, in the order error messages list them."""

_MUTATION = re.compile(r"([^0-9:\s])([0-9]+)([^0-9:\s])", re.ASCII)
"""One mutation: wild-type residue, 1-based position, mutant residue (single characters)."""

_SHOWN = 60
"""Most characters of a variant that an error message quotes (a request may send megabytes)."""


class ScoringError(ValueError):
    """A request the scores cannot be computed for (bad variant, method or sequence, or over a
    limit): the served model answers INVALID_ARGUMENT with the message."""


# ----------------------------------------------------------------------------------- limits
@dataclass(frozen=True)
class ScoringLimits:
    """The most work one `N_scores` request may ask for: written into the model's config.pbtxt
    `parameters` (`parameters()`), read back when the model loads (`from_parameters()`) and
    checked by `plan_request` before any work, with a ScoringError naming the limit."""

    max_variants: int = 32768
    """Most variants per request. Parsing and scoring them is cheap (no model call per variant);
    32768 holds a full deep mutational scan of the longest ESM-2 input (19 x 1022 = 19418 single
    substitutions) in one request."""
    max_mutations_per_variant: int = 64
    """Most mutations in one variant (ProteinGym's multi-mutants have far fewer); with
    max_variants it bounds the parsing work of one request."""
    max_masked_copies: int = 1024
    """Most masked copies of the wild type one request runs through the model: the distinct
    mutated positions of `masked-marginal`, the residues of `pll`. Each copy is a full pass of the
    encoder, so this is the request's real cost; 1024 lets any sequence ESM-2 takes (1022
    residues) be scored in full. Lower it on a CPU host serving large models."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{item.name} must be an integer of at least 1, got {value!r}")

    def parameters(self) -> dict[str, str]:
        """Config.pbtxt `parameters`: every limit by name, as a string."""
        return {item.name: str(getattr(self, item.name)) for item in fields(self)}

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> ScoringLimits:
        """The limits in a config's `parameters` (other keys ignored; a missing limit takes its
        default). A value that is not an integer is a ValueError naming the parameter, so a
        hand-edited config fails the model's load with a clear message."""
        values = {}
        for item in fields(cls):
            if item.name in parameters:
                text = parameters[item.name]
                try:
                    values[item.name] = int(text)
                except (TypeError, ValueError):
                    raise ValueError(f"parameter {item.name} is {text!r}, not an integer") from None
        return cls(**values)


# ----------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Mutation:
    """One substitution as written: `wild_type` residue at 1-based `position` becomes `mutant`."""

    wild_type: str
    position: int
    mutant: str

    @property
    def index(self) -> int:
        """The 0-based index of the mutated residue in the sequence."""
        return self.position - 1

    def __str__(self) -> str:
        return f"{self.wild_type}{self.position}{self.mutant}"


@dataclass(frozen=True)
class Variant:
    """One requested variant: its text and its mutations, in the order written."""

    text: str
    mutations: tuple[Mutation, ...]


def _shown(text: str) -> str:
    """`text` quoted for an error message, cut to _SHOWN characters."""
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _alphabet_index(alphabet: Sequence[str]) -> dict[str, int]:
    """{character: column} for an alphabet of distinct single characters (a ValueError otherwise:
    the alphabet comes from the build, not from the client)."""
    index = {}
    for column, character in enumerate(alphabet):
        if not isinstance(character, str) or len(character) != 1:
            raise ValueError(f"alphabet entry {column} is {character!r}, not a single character")
        if character in index:
            raise ValueError(f"alphabet has {character!r} twice (columns {index[character]} and {column})")
        index[character] = column
    if not index:
        raise ValueError("the alphabet is empty")
    return index


def _text(value: str | bytes, what: str) -> str:
    """`value` as a str: bytes (a Triton BYTES element) are decoded as UTF-8."""
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ScoringError(f"{what} is not UTF-8 ({error.reason} at byte {error.start})") from None
    if isinstance(value, str):
        return value
    raise ScoringError(f"{what} must be a string, got {type(value).__name__}")


def _describe_alphabet(alphabet: Iterable[str]) -> str:
    return "".join(alphabet)


def parse_variant(text: str | bytes, wild_type: str, alphabet: Sequence[str] | dict[str, int], *, index: int = 0,
                  max_mutations: int | None = None) -> Variant:
    """The variant `text` (`A42G`, or `A42G:L43P`) checked against `wild_type` and `alphabet` (or
    its index, character -> column, which parse_variants passes to index it once per request);
    `index` is its place in the request, for the error messages (see the module docstring for
    the rules). `max_mutations`: the server's max_mutations_per_variant (None: no limit)."""
    columns = alphabet if isinstance(alphabet, dict) else _alphabet_index(alphabet)
    text = _text(text, f"variants[{index}]")
    where = f"variants[{index}] = {_shown(text)}"
    if not text:
        raise ScoringError(f"variants[{index}] is empty; write a variant like A42G, or A42G:L43P for a multi-mutant")
    if any(character.isspace() for character in text):
        raise ScoringError(f"{where}: contains whitespace; write a variant like A42G or A42G:L43P, with no spaces")
    parts = text.split(":")
    if max_mutations is not None and len(parts) > max_mutations:
        raise ScoringError(f"{where}: {len(parts)} mutations; the server's max_mutations_per_variant is "
                           f"{max_mutations}")
    mutations: list[Mutation] = []
    seen: dict[int, Mutation] = {}
    for number, part in enumerate(parts, 1):
        # A single mutation's errors need no prefix: the variant is the mutation.
        prefix = f"{where}: " if len(parts) == 1 else f"{where}: mutation {number} {_shown(part)}: "
        if not part:
            raise ScoringError(f"{where}: mutation {number} is empty; join mutations with a single ':', "
                               "like A42G:L43P")
        match = _MUTATION.fullmatch(part)
        if match is None:
            raise ScoringError(f"{prefix}not a mutation; write the wild-type residue, its 1-based position "
                               "and the mutant residue, like A42G")
        # More digits than any sequence has residues are out of range before int() (which refuses
        # over 4300 digits with a ValueError of its own).
        digits = match[2].lstrip("0") or "0"
        if len(digits) > len(str(len(wild_type))) or not 1 <= int(digits) <= len(wild_type):
            raise ScoringError(f"{prefix}position {_shown(match[2])[1:-1]} is out of range: the wild type has "
                               f"{len(wild_type)} residues (positions 1 to {len(wild_type)})")
        mutation = Mutation(match[1], int(digits), match[3])
        actual = wild_type[mutation.index]
        if actual != mutation.wild_type:
            raise ScoringError(f"{prefix}position {mutation.position} is {actual} in the wild type, "
                               f"not {mutation.wild_type}")
        if mutation.wild_type not in columns:
            raise ScoringError(f"{prefix}the wild-type residue {mutation.wild_type!r} at position {mutation.position} "
                               f"is not in the model's alphabet ({_describe_alphabet(columns)}): it has no "
                               "log-probability to compare with")
        if mutation.mutant not in columns:
            raise ScoringError(f"{prefix}the mutant residue {mutation.mutant!r} is not in the model's alphabet "
                               f"({_describe_alphabet(columns)})")
        if mutation.position in seen:
            raise ScoringError(f"{where}: position {mutation.position} is mutated twice "
                               f"({seen[mutation.position]} and {mutation}); a variant mutates a position once")
        seen[mutation.position] = mutation
        mutations.append(mutation)
    return Variant(text, tuple(mutations))


def parse_variants(variants: Sequence[str | bytes], wild_type: str, alphabet: Sequence[str], *,
                   limits: ScoringLimits | None = None) -> list[Variant]:
    """Every variant of a request parsed and checked (`parse_variant`), after the count is checked
    against `limits.max_variants` (so an oversized request costs no parsing)."""
    limits = limits or ScoringLimits()
    if len(variants) > limits.max_variants:
        raise ScoringError(f"input variants: {len(variants)} variants; the server's max_variants is "
                           f"{limits.max_variants}")
    columns = _alphabet_index(alphabet)
    return [parse_variant(text, wild_type, columns, index=index, max_mutations=limits.max_mutations_per_variant)
            for index, text in enumerate(variants)]


def resolve_method(method: str | bytes | None, has_variants: bool, default: str = "wt-marginal") -> str:
    """The method a request asked for (None or empty: the default, `default` with variants (the
    served model's `default_method`), `pll` without), checked against what it sent: `pll` scores
    the sequence itself and takes no variants; the others need some."""
    method = _text(method, "input method") if method is not None else ""
    if not method:
        return default if has_variants else "pll"
    if method not in METHODS:
        raise ScoringError(f"input method: unknown method {_shown(method)}; methods: {', '.join(METHODS)}")
    if method == "pll" and has_variants:
        raise ScoringError("input method: pll scores the wild-type sequence itself and takes no variants; "
                           "use wt-marginal, masked-marginal or variant-masked to score variants, or send each "
                           "mutant sequence with method pll")
    if method != "pll" and not has_variants:
        raise ScoringError(f"input method: {method} scores variants, and the request has none; send "
                           "variants (like A42G), or use method pll to score the sequence itself")
    return method


# ----------------------------------------------------------------------------------- positions
def mutated_positions(variants: Sequence[Variant]) -> np.ndarray:
    """The 0-based indices of the residues the variants mutate: sorted, each once. These are the
    positions whose log-probabilities the marginal scores read, and the copies masked-marginal
    runs (one per distinct position, not per variant or mutation)."""
    return np.unique(np.fromiter((m.index for v in variants for m in v.mutations), dtype=np.int64))


def masked_sequences(wild_type: str, positions: Sequence[int] | np.ndarray, mask_char: str) -> list[str]:
    """One copy of `wild_type` per entry of `positions` (0-based), that residue replaced by
    `mask_char` (`_` in this project: the public models' tokenizers turn it into the mask token)."""
    return [wild_type[:p] + mask_char + wild_type[p + 1:] for p in np.asarray(positions, dtype=np.int64).tolist()]


def masked_copy(residues: str, masked: Iterable[int], mask_char: str, structure: str | None = None) -> str:
    """`residues` with the residues at the 0-based indices `masked` replaced by `mask_char`; with a
    `structure` (one 3Di letter per residue), the structure-aware string, each residue followed by
    its letter (a masked one: `mask_char` + its letter, SaProt's `#d`)."""
    chosen = set(masked)
    shown = [mask_char if i in chosen else residue for i, residue in enumerate(residues)]
    if structure is None:
        return "".join(shown)
    return "".join(residue + letter for residue, letter in zip(shown, structure))


def variant_copies(variants: Sequence[Variant]) -> tuple[tuple[int, ...], ...]:
    """The copies `variant-masked` runs: each variant's mutated positions (0-based, sorted), each
    distinct set once, in the order the variants first name them."""
    return tuple(dict.fromkeys(tuple(sorted(m.index for m in v.mutations)) for v in variants))


SplitStructure = Callable[[str], "tuple[str, str]"]
"""A structure-aware wild type -> (residues, 3Di letters), one character each per residue; a
ValueError naming the problem otherwise (tokenizers/structure_aware.split_pairs: scoring.py imports
no tokenizer, its caller hands the reader over)."""


def split_structure_aware(text: str, split: SplitStructure) -> tuple[str, str]:
    """(residues, 3Di letters) of a structure-aware (or plain) wild type, as `split` reads it;
    ScoringError naming the input otherwise."""
    try:
        return split(text)
    except ValueError as err:  # the tokenizer's TokenizationError
        raise ScoringError(f"input sequences: the wild type {_shown(text)} {str(err).replace('sequence 0 ', '', 1)}"
                           ) from None


def pack_passes(passes: Sequence[int], size: int) -> list[list[tuple[int, slice]]]:
    """The model calls of a request of several plans, each of at most `size` sequences: the plans'
    inputs in order (plan 0's, then plan 1's, ...) cut into calls of `size`, each call a list of
    (plan index, slice of that plan's inputs). Packing across plans keeps every call but the last
    full: 32 wild types scored by wt-marginal are one call of 32 rows, not 32 calls of one, and a
    PLL of short sequences (a CDR, a peptide) fills its calls with the next sequence's copies."""
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    calls: list[list[tuple[int, slice]]] = []
    room = 0
    for plan, count in enumerate(passes):
        start = 0
        while start < count:
            if room == 0:
                calls.append([])
                room = size
            stop = min(count, start + room)
            calls[-1].append((plan, slice(start, stop)))
            room -= stop - start
            start = stop
    return calls


# ----------------------------------------------------------------------------------- the plan
@dataclass(frozen=True, eq=False)
class ScoringPlan:
    """One request's work, checked: which sequences to run and how their log-probabilities
    become scores.

    `positions` are the 0-based residue indices whose log-probabilities the scores read (sorted,
    distinct): the mutated positions for the marginals, every residue for pll. The scores read
    one "site" row of log-probabilities per position, [len(positions), A]: from the unmasked
    wild type (`wt-marginal`) or from the copy that masks that position (`masked-marginal`,
    `pll`). For `variant-masked`, `copies` are the runs (each a set of masked positions) and
    `positions` every copy's positions in turn (a position may come more than once): one site row
    per (copy, masked position).

    `wild_type` is one character per residue; `structure` (structure-aware models) one 3Di letter
    per residue, None otherwise."""

    method: str
    wild_type: str
    variants: tuple[Variant, ...]
    positions: np.ndarray
    alphabet: tuple[str, ...]
    structure: str | None = None
    copies: tuple[tuple[int, ...], ...] = ()

    @property
    def masked(self) -> bool:
        """True when every position needs its own masked copy (masked-marginal and pll)."""
        return self.method in ("masked-marginal", "pll")

    @property
    def passes(self) -> int:
        """Sequences the model runs for this request (rows of `inputs`)."""
        if self.method == "variant-masked":
            return len(self.copies)
        return int(self.positions.size) if self.masked else 1

    def inputs(self, mask_char: str, part: slice | None = None) -> list[str]:
        """The sequences to run, in order: the masked copies (one per position), or the wild type;
        `part`: only those of inputs[part] (formed when their call is sent, not all up front).

        Strings, so the served model can send them to the public log-probability model (or the
        fused encoder) as they are, with the mask character where the tokenizer expects it, and
        needs no tokenizer of its own."""
        chosen = part or slice(None)
        if self.method == "variant-masked":
            return [masked_copy(self.wild_type, copy, mask_char, self.structure) for copy in self.copies[chosen]]
        if not self.masked:
            return [masked_copy(self.wild_type, (), mask_char, self.structure)][chosen]
        if self.structure is None:
            return masked_sequences(self.wild_type, self.positions[chosen], mask_char)
        return [masked_copy(self.wild_type, (int(p),), mask_char, self.structure) for p in self.positions[chosen]]

    def site_log_probs(self, log_probs: np.ndarray, part: slice | None = None) -> np.ndarray:
        """The site rows that `log_probs` of `inputs[part]` (None: all of them) provide:
        `log_probs` is [n, L, A] (BOS/EOS rows dropped, columns over the alphabet), or [L, A] for
        the one pass of wt-marginal. Returns [k, A]: for masked methods, row positions[j] of the
        copy that masks it; for wt-marginal, the wild type's rows at every position. Concatenating
        the results of consecutive parts in order gives `scores` its input, so a served model
        keeps [positions, A] and never every copy's [L, A]."""
        log_probs = np.asarray(log_probs)
        if log_probs.ndim == 2:
            log_probs = log_probs[None]
        start, stop, _ = (part or slice(None)).indices(self.passes)
        count = stop - start
        expected = (count, len(self.wild_type), len(self.alphabet))
        if log_probs.shape != expected:
            raise ValueError(f"log_probs of inputs[{start}:{stop}] must have shape {expected} "
                             f"(copies, residues, alphabet), got {log_probs.shape}")
        if self.method == "variant-masked":
            return np.concatenate([log_probs[j, list(copy)] for j, copy in enumerate(self.copies[start:stop])])
        if not self.masked:
            return log_probs[0, self.positions]
        return log_probs[np.arange(count), self.positions[start:stop]]

    def scores(self, site_log_probs: np.ndarray) -> np.ndarray:
        """The request's answer, FP32: one score per variant (the sum over its mutations of
        log p(mutant) - log p(wild type) at the mutated position), or [1], the PLL (the mean over
        residues of log p(true residue) with the residue masked). `site_log_probs` is
        [len(positions), A], as `site_log_probs` gives it."""
        sites = np.asarray(site_log_probs, dtype=np.float64)
        expected = (self.positions.size, len(self.alphabet))
        if sites.shape != expected:
            raise ValueError(f"site log-probabilities must have shape {expected} (positions, alphabet), "
                             f"got {sites.shape}")
        columns = {character: column for column, character in enumerate(self.alphabet)}
        if self.method == "pll":
            true = np.fromiter((columns[residue] for residue in self.wild_type), dtype=np.int64,
                               count=len(self.wild_type))
            return np.asarray([sites[np.arange(self.positions.size), true[self.positions]].mean()], dtype=np.float32)
        if self.method == "variant-masked":
            return copy_scores(self.variants, self.copies, sites, columns)
        return variant_scores(self.variants, self.positions, sites, columns)


def variant_scores(variants: Sequence[Variant], positions: np.ndarray, sites: np.ndarray,
                   columns: Mapping[str, int]) -> np.ndarray:
    """Each variant's score, FP32: the sum over its mutations of sites[k, mutant] -
    sites[k, wild type], where k is the mutation's index in `positions` (ESM's predict.py)."""
    site_of = {int(position): k for k, position in enumerate(np.asarray(positions).tolist())}
    return _summed_differences(variants, lambda _, mutation: site_of[mutation.index], sites, columns)


def copy_scores(variants: Sequence[Variant], copies: Sequence[tuple[int, ...]], sites: np.ndarray,
                columns: Mapping[str, int]) -> np.ndarray:
    """variant-masked's scores, FP32: each variant's sum over its mutations of sites[k, mutant] -
    sites[k, wild type], where k is the site row of that position in the copy that masks exactly
    the variant's positions (`copies`, whose site rows follow one another in order)."""
    offsets, start = {}, 0
    for copy in copies:
        offsets[copy] = start
        start += len(copy)

    def site(variant: Variant, mutation: Mutation) -> int:
        copy = tuple(sorted(m.index for m in variant.mutations))
        return offsets[copy] + copy.index(mutation.index)

    return _summed_differences(variants, site, sites, columns)


def _summed_differences(variants: Sequence[Variant], site: Callable[[Variant, Mutation], int], sites: np.ndarray,
                        columns: Mapping[str, int]) -> np.ndarray:
    """Each variant's sum over its mutations of sites[k, mutant] - sites[k, wild type], k =
    site(variant, mutation): summed in float64, then one rounding to FP32."""
    owner, rows, mutant, wild = [], [], [], []
    for number, variant in enumerate(variants):
        for mutation in variant.mutations:
            owner.append(number)
            rows.append(site(variant, mutation))
            mutant.append(columns[mutation.mutant])
            wild.append(columns[mutation.wild_type])
    values = np.asarray(sites, dtype=np.float64)
    differences = values[rows, mutant] - values[rows, wild]
    return np.bincount(np.asarray(owner, dtype=np.int64), weights=differences,
                       minlength=len(variants)).astype(np.float32)


def plan_request(wild_type: str | bytes, variants: Sequence[str | bytes] | None, method: str | bytes | None, *,
                 alphabet: Sequence[str], mask_char: str | None = None,
                 limits: ScoringLimits | None = None, default_method: str = "wt-marginal",
                 split_structure: SplitStructure | None = None) -> ScoringPlan:
    """One `N_scores` request checked and planned (ScoringError naming the input otherwise):
    the method (`resolve_method`, `default_method` with variants when the request names none;
    `variants` None or empty: no variants), the wild type (not empty; with `split_structure`, a
    structure-aware model's: read by it into residues and 3Di letters; without `mask_char`; for pll every
    residue in the alphabet), the variants (`parse_variants`, against the residues), and the
    masked copies against `limits.max_masked_copies`."""
    limits = limits or ScoringLimits()
    wild_type = _text(wild_type, "input sequences")
    variants = list(variants) if variants is not None else []
    method = resolve_method(method, bool(variants), default_method)
    if not wild_type:
        raise ScoringError("input sequences: the wild-type sequence is empty")
    structure = None
    if split_structure is not None:
        wild_type, structure = split_structure_aware(wild_type, split_structure)
    if mask_char and mask_char in wild_type:
        raise ScoringError(f"input sequences: position {wild_type.index(mask_char) + 1} is the mask character "
                           f"{mask_char!r}; a wild type to score has no masked residues")
    columns = _alphabet_index(alphabet)
    parsed = parse_variants(variants, wild_type, alphabet, limits=limits)
    if method == "pll":
        for position, residue in enumerate(wild_type, 1):
            if residue not in columns:
                raise ScoringError(f"input sequences: method pll: residue {position} is {residue!r}, which is not in "
                                   f"the model's alphabet ({_describe_alphabet(alphabet)}): it has no "
                                   "log-probability, so the sequence has no PLL")
        positions = np.arange(len(wild_type), dtype=np.int64)
        why = "one per residue"
    elif method == "variant-masked":
        copies = variant_copies(parsed)
        if len(copies) > limits.max_masked_copies:
            raise ScoringError(f"method {method}: {len(copies)} masked copies of the sequence (one per distinct set "
                               f"of mutated positions); the server's max_masked_copies is {limits.max_masked_copies}")
        positions = np.fromiter((p for copy in copies for p in copy), dtype=np.int64)
        return ScoringPlan(method, wild_type, tuple(parsed), positions, tuple(alphabet), structure, copies)
    else:
        positions = mutated_positions(parsed)
        why = "one per distinct mutated position"
    if method != "wt-marginal" and positions.size > limits.max_masked_copies:
        raise ScoringError(f"method {method}: {positions.size} masked copies of the sequence ({why}); the "
                           f"server's max_masked_copies is {limits.max_masked_copies}")
    return ScoringPlan(method, wild_type, tuple(parsed), positions, tuple(alphabet), structure)
