"""Character-level SentencePiece vocabularies (ESM-1nv, ProtT5nv, Hugging Face ProtT5), numpy only.

Part of the served package, copied whole into generated Triton Python-backend model folders, beside
character.py, and imported there as a top-level module (its name must not shadow the
`sentencepiece` package). It imports only the standard library and its sibling.

The protein models that use SentencePiece use it one residue per piece, so encoding is a
character lookup (CharacterTokenizer) over the piece vocabulary; what differs is the piece each
residue maps to:
- `bare` pieces (BioNeMo's ESM-1nv and ProtT5nv vocabularies: `L`, `A`, ...);
- `word` pieces (Hugging Face ProtT5, whose residues are separated by spaces, so every residue is
  a word-initial piece `▁L`, `▁A`, ...). Such models are used with space-separated input; this
  tokenizer accepts residues with or without the spaces.

`read_pieces` reads the piece list, in id order, from any of the files such models ship: a
SentencePiece `.model` (protobuf, parsed here without the sentencepiece library), a `.vocab`
(`piece<TAB>score` lines) or a Hugging Face `tokenizer.json` (Unigram model plus added tokens).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from .character import CharacterTokenizer, Encoded

WORD_START = "\u2581"  # "▁": SentencePiece's marker of a piece that starts a word


class SentencePieceTokenizer(CharacterTokenizer):
    """A CharacterTokenizer over a SentencePiece piece vocabulary (see the module docstring).

    `pieces` are the vocabulary in id order; `residues` the accepted characters; `word_pieces`
    selects `▁X` pieces (and lets spaces separate residues); `aliases` map residues to another
    residue's piece (ProtT5: U Z O B -> X). Special tokens are pieces; `mask_token`/`mask_char`
    as in CharacterTokenizer.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        *,
        residues: str,
        word_pieces: bool = False,
        pad_token: str,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None,
        max_length: int,
        aliases: Mapping[str, str] = {},
        mask_token: str | None = None,
        mask_char: str | None = None,
    ) -> None:
        self.word_pieces = bool(word_pieces)
        prefix = WORD_START if self.word_pieces else ""
        pieces_of = {residue: prefix + aliases.get(residue, residue) for residue in residues}
        missing = sorted(residue for residue, piece in pieces_of.items() if piece not in pieces)
        if missing:
            raise ValueError(f"the vocabulary has no piece for residue(s) {''.join(missing)} "
                             f"(looked for {[pieces_of[m] for m in missing]})")
        self._residue_aliases = dict(aliases)
        super().__init__(pieces, residues=residues, pad_token=pad_token, bos_token=bos_token,
                         eos_token=eos_token, unk_token=unk_token, max_length=max_length, aliases=pieces_of,
                         mask_token=mask_token, mask_char=mask_char)

    def _aliased_residues(self) -> set[str]:
        return set(self._residue_aliases)

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        if self.word_pieces:  # "M K T" and "MKT" are the same protein here
            sequences = [_without_spaces(s) for s in sequences]
        return super().encode(sequences, truncate=truncate)

    def to_dict(self) -> dict[str, Any]:
        settings = super().to_dict()
        settings["pieces"] = settings.pop("vocab")
        settings["aliases"] = self._residue_aliases
        return {"type": "sentencepiece", "word_pieces": self.word_pieces, **settings}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SentencePieceTokenizer:
        settings = dict(d)
        if settings.pop("type", None) != "sentencepiece":
            raise ValueError(f"not a SentencePiece tokenizer: type is {d.get('type')!r}")
        return cls(settings.pop("pieces"), **settings)


def _without_spaces(sequence: Any) -> Any:
    if isinstance(sequence, str):
        return sequence.replace(" ", "")
    if isinstance(sequence, (bytes, bytearray)):
        return bytes(sequence).replace(b" ", b"")
    return sequence  # not text: CharacterTokenizer reports it


# ----------------------------------------------------------------------------- vocabularies
def read_pieces(data: bytes, name: str) -> list[str]:
    """The pieces, in id order, of a `.model`, `.vocab` or `tokenizer.json` file's content."""
    if name.endswith(".json"):
        return _tokenizer_json_pieces(data, name)
    if name.endswith(".vocab"):
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not UTF-8 text") from None
        return [line.split("\t", 1)[0] for line in lines if line]
    return _model_pieces(data, name)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message; value is bytes for wire type 2."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated message")
        yield number, wire, value


def _model_pieces(data: bytes, name: str) -> list[str]:
    """ModelProto.pieces (field 1), each a SentencePiece message whose field 1 is the piece."""
    try:
        pieces = []
        for number, wire, value in _fields(data):
            # Wire type 2 values are bytes (the isinstance checks say so to the type checker).
            if number == 1 and wire == 2 and isinstance(value, bytes):
                piece = next((v for n, w, v in _fields(value) if n == 1 and w == 2 and isinstance(v, bytes)), b"")
                pieces.append(piece.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, struct.error) as err:
        raise ValueError(f"{name} is not a SentencePiece model ({err})") from None
    if not pieces:
        raise ValueError(f"{name} is not a SentencePiece model (no pieces)")
    return pieces


def _tokenizer_json_pieces(data: bytes, name: str) -> list[str]:
    try:
        spec = json.loads(data.decode("utf-8"))
        vocab = spec["model"]["vocab"]
        if isinstance(vocab, dict):  # WordPiece/BPE: {token: id}
            by_id = {int(i): token for token, i in vocab.items()}
        else:  # Unigram: [[piece, score], ...] in id order
            by_id = {i: entry[0] for i, entry in enumerate(vocab)}
        for added in spec.get("added_tokens", []):
            by_id[int(added["id"])] = added["content"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:  # ValueError: JSON, UTF-8, ids
        raise ValueError(f"{name} is not a Hugging Face tokenizer.json with a model vocabulary "
                         f"({type(err).__name__}: {err})") from None
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{name}: token ids are not contiguous from 0")
    return [by_id[i] for i in range(len(by_id))]
