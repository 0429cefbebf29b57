"""Checkpoint ensembles: several masked-LM checkpoints of one family served as one model (ESM-1v's
five seeds, `build repo --checkpoint a.pt --checkpoint b.pt ...`).

Each member keeps its own encoder and masked-LM head; what the members must share is what the
served model shares: the sequences go through one tokenizer, and their log-probabilities are
averaged column by column, so every member must have the same family, the same tokenizer (token
ids, special tokens, residues, length limit, mask character) and the same alphabet (log_probs'
columns, in order), and a masked-LM head. Hidden sizes may differ (an ESM-2 35M and 150M ensemble
is served as well): no member's hidden states meet another's.

`check_members` compares the members' `MemberFacts` and raises `MemberMismatch` naming the member
that differs from the first, and how. It needs nothing but the facts (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bionemo_export.errors import UserError

ENSEMBLE_TASKS = ("logits", "scores")
"""What an ensemble build serves: the tasks computed from the members' log-probabilities. The
others (embeddings, hiddens, contacts, predictions) read one model's hidden states or attention,
which independently trained members do not share (each seed has its own coordinates): averaging
them means nothing, and serving one member's would hide which."""


class MemberMismatch(UserError, ValueError):
    """The checkpoints of an ensemble cannot be served as one; the message names the member and
    what differs."""


@dataclass(frozen=True)
class MemberFacts:
    """What an ensemble's members must agree on, read from a loaded checkpoint (`of`)."""

    path: Path
    family: str
    alphabet: tuple[str, ...]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """The tokenizer as its served file writes it (`Tokenizer.to_dict()`): vocabulary, specials,
    residues, max_length, mask character."""
    lm_head: bool = True
    hidden_size: int = 0
    form: str = ""

    @classmethod
    def of(cls, loaded: Any) -> MemberFacts:
        """The facts of a LoadedModel (models/base.py)."""
        return cls(path=Path(loaded.checkpoint), family=loaded.family.name, alphabet=tuple(loaded.alphabet),
                   tokenizer=dict(loaded.tokenizer.to_dict()), lm_head=loaded.lm_head is not None,
                   hidden_size=int(loaded.hidden_size), form=str(loaded.description.get("checkpoint_form", "")))


def _shown(value: Any, most: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def _first_difference(first: Sequence[Any], other: Sequence[Any]) -> str:
    """Where two sequences (vocabularies, alphabets) first differ: 'entry 5 is 'X', not 'A''."""
    for index, (a, b) in enumerate(zip(first, other)):
        if a != b:
            return f"entry {index} is {b!r}, not {a!r}"
    return f"{len(other)} entries, not {len(first)}"


def describe_difference(first: MemberFacts, other: MemberFacts) -> str | None:
    """How `other` differs from `first` in what an ensemble shares (None: it does not)."""
    if other.family != first.family:
        return f"it is a {other.family} checkpoint, the first is {first.family}"
    if not other.lm_head:
        return "it has no masked-LM head (an ensemble serves the members' log-probabilities)"
    if other.alphabet != first.alphabet:
        return f"its alphabet (log_probs' columns) differs: {_first_difference(first.alphabet, other.alphabet)}"
    for key in sorted(first.tokenizer.keys() | other.tokenizer.keys()):
        mine, theirs = first.tokenizer.get(key), other.tokenizer.get(key)
        if mine == theirs:
            continue
        if key == "vocab" and isinstance(mine, list) and isinstance(theirs, list):
            return f"its tokenizer's vocabulary differs: {_first_difference(mine, theirs)}"
        return f"its tokenizer's {key} is {_shown(theirs)}, the first's is {_shown(mine)}"
    return None


def check_members(members: Sequence[MemberFacts]) -> None:
    """MemberMismatch unless every member agrees with the first (see the module docstring); also
    refused: fewer than two members, a first member without a masked-LM head, or one checkpoint
    given twice."""
    if len(members) < 2:
        raise MemberMismatch(f"an ensemble needs at least two checkpoints, got {len(members)}; give "
                             "`checkpoint` once per member")
    if not members[0].lm_head:
        raise MemberMismatch(f"ensemble member 1 ({members[0].path}) has no masked-LM head: an ensemble serves its "
                             "members' log-probabilities; give checkpoints with the head (a masked-LM checkpoint), "
                             "or serve this one on its own")
    seen: dict[Path, int] = {}
    for number, member in enumerate(members, 1):
        if member.path in seen:
            raise MemberMismatch(f"member {number} ({member.path}) is member {seen[member.path]} again: an ensemble "
                                 "of one checkpoint twice weighs it twice; give each checkpoint once")
        seen[member.path] = number
    for number, member in enumerate(members[1:], 2):
        check_member(members[0], member, number)


def check_member(first: MemberFacts, member: MemberFacts, number: int) -> None:
    """MemberMismatch naming member `number` (1-based) when it differs from the first in what an
    ensemble shares (a build checks each member as it loads it, before exporting it)."""
    difference = describe_difference(first, member)
    if difference is not None:
        raise MemberMismatch(f"ensemble member {number} ({member.path}) cannot be served with member 1 "
                             f"({first.path}): {difference}. An ensemble's members share one tokenizer and one "
                             "alphabet; build this checkpoint on its own, or give members of one kind (ESM-1v's "
                             "five seeds)")


def member_label(number: int) -> str:
    """The name part of member `number` (1-based) in the repository: `m1` -> models N_m1_encoder,
    N_m1_lm_head, and graphs m1_encoder, m1_lm_head in manifest.json."""
    return f"m{number}"
