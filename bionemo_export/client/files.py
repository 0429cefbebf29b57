"""The files the `client` commands read and write (input records: records.py).

Inputs: hidden states as BioNeMo's JSON (`{"hiddens": ..., "mask": ...}`) or
`.npz`. Outputs: JSON in BioNeMo's shape, `{output_name: nested lists}` (strings as strings),
or `.npz` for big results (strings as unicode arrays, so `np.load` needs no pickle), with the
record ids under `ids` when the input was a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bionemo_export.errors import InvalidInputError


def to_jsonable(array: np.ndarray) -> list:
    """An output as nested lists; BYTES (UTF-8) as strings."""
    if array.dtype == np.object_:
        return np.vectorize(lambda item: item.decode("utf-8") if isinstance(item, bytes) else item,
                            otypes=[object])(array).tolist()
    return array.tolist()


def write_outputs(path: Path, outputs: dict[str, np.ndarray], ids: list[str] | None = None) -> None:
    """`outputs` into `path`: `.npz` (arrays; strings as unicode) or JSON (nested lists); with
    `ids` (one per row) under "ids"."""
    path = Path(path)
    if path.suffix == ".npz":
        arrays = {name: np.array(to_jsonable(array), dtype=np.str_) if array.dtype == np.object_ else array
                  for name, array in outputs.items()}
        if ids is not None:
            arrays["ids"] = np.array(ids, dtype=np.str_)
        with path.open("wb") as handle:  # np.savez would add ".npz" to any other name
            np.savez(handle, **arrays)
        return
    document = {name: to_jsonable(array) for name, array in outputs.items()}
    if ids is not None:
        document["ids"] = list(ids)
    path.write_text(json.dumps(document))


def read_hiddens(path: Path, in_name: str = "hiddens") -> tuple[np.ndarray, np.ndarray | None, list[str] | None]:
    """(hiddens FP32 [batch, length, hidden], mask BOOL [batch, length] or None, ids or None) from
    BioNeMo's JSON (`{in_name: ..., "mask": ...}`, as `client encode` writes it) or an `.npz`."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            document = {name: archive[name] for name in archive.files}
    else:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise InvalidInputError(f"{path}: not JSON ({err})") from None
        if not isinstance(document, dict):
            raise InvalidInputError(f"{path}: expected a JSON object with {in_name!r} (and optionally 'mask')")
    if in_name not in document:
        raise InvalidInputError(f"{path} has no {in_name!r} (it has {', '.join(map(repr, document)) or 'nothing'}); "
                                f"name the hidden states with `in_name`")
    hiddens = _array(path, in_name, document[in_name], np.float32)
    if hiddens.ndim != 3:
        raise InvalidInputError(f"{path}: {in_name!r} must be [batch, length, hidden], got shape {list(hiddens.shape)}")
    mask = _array(path, "mask", document["mask"], np.bool_) if document.get("mask") is not None else None
    if mask is not None and mask.shape != hiddens.shape[:2]:
        raise InvalidInputError(f"{path}: 'mask' shape {list(mask.shape)} does not match {in_name!r} [batch, length] "
                                f"{list(hiddens.shape[:2])}")
    ids = [str(item) for item in np.asarray(document["ids"]).tolist()] if "ids" in document else None
    return hiddens, mask, ids


def _array(path: Path, name: str, value: object, dtype: type) -> np.ndarray:
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"{path}: {name!r} is not a rectangular array of numbers ({err})") from None
