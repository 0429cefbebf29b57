"""The one tensor-spec type of the package: a named tensor's element type and dims, as the task
table declares public tensors, the families declare their graphs' tensors, the planners write
config.pbtxt tensors and `bench` generates inputs for a served model's tensors.

Importable without torch or Triton: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np


class DType(str, Enum):
    """A tensor's element type, by Triton's name; `.config`, `.numpy` and `.onnx` give the same
    type in config.pbtxt, numpy and ONNX terms (one map for the whole project)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    FP64 = "FP64"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT32 = "INT32"
    INT64 = "INT64"
    BOOL = "BOOL"
    BYTES = "BYTES"

    def __str__(self) -> str:  # FP32, not DType.FP32, wherever a type is written
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def config(self) -> str:
        """The name in config.pbtxt (ModelConfig's DataType): TYPE_FP32, ..., TYPE_STRING for BYTES."""
        return "TYPE_STRING" if self is DType.BYTES else f"TYPE_{self.value}"

    @property
    def numpy(self) -> type:
        """The numpy type (BYTES: object, holding bytes); BF16 has none."""
        if self not in _NUMPY:
            raise ValueError(f"{self.value} has no numpy type")
        return _NUMPY[self]

    @property
    def onnx(self) -> int:
        """ONNX's TensorProto.DataType number (onnx is not imported for it)."""
        return _ONNX[self]

    @classmethod
    def from_onnx(cls, number: int) -> DType:
        """The type of ONNX's TensorProto.DataType `number`."""
        for dtype, value in _ONNX.items():
            if value == number:
                return dtype
        raise ValueError(f"ONNX element type {number} has no Triton type here")

    @classmethod
    def of(cls, name: str) -> DType:
        """The type named as Triton (FP32), config.pbtxt (TYPE_FP32) or its metadata does; a
        ValueError lists the known names."""
        text = name.removeprefix("TYPE_")
        text = "BYTES" if text == "STRING" else text
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown tensor type {name!r}; known: {', '.join(t.value for t in cls)}") from None


_NUMPY = {DType.FP32: np.float32, DType.FP16: np.float16, DType.FP64: np.float64, DType.INT8: np.int8,
          DType.UINT8: np.uint8, DType.INT32: np.int32, DType.INT64: np.int64, DType.BOOL: np.bool_,
          DType.BYTES: np.object_}
# onnx.TensorProto's numbers (onnx/onnx.proto3), so that this module needs no onnx import.
_ONNX = {DType.FP32: 1, DType.UINT8: 2, DType.INT8: 3, DType.INT32: 6, DType.INT64: 7, DType.BYTES: 8,
         DType.BOOL: 9, DType.FP16: 10, DType.FP64: 11, DType.BF16: 16}

Dim = int | str
"""A size: a number, -1 (dynamic), or a name: the letter of a size fixed at build time (H, A, C) or
a graph's dynamic axis."""
SIZES_DOC = {"H": "the hidden size", "A": "the residue alphabet's size", "C": "the head's classes or values",
             "K": "a checkpoint ensemble's members (its member outputs only)"}


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor. `dims`: -1 for a dynamic axis, a positive size, or a name: a size the build
    fixes (`SIZES_DOC`: H, A, C, K, which task tensors use) or a graph's dynamic axis ("batch",
    "length": ONNX's dynamic_axes). Graph tensors (models/) include the batch axis; the tensors of
    a served model's config (tasks.py, model_repository/, bench) exclude it, every model being
    batched. `dtype` may be given by name (FP32, TYPE_FP32) and is a DType after."""

    name: str
    dtype: DType
    dims: tuple[Dim, ...]
    optional: bool = False
    """An input a request may leave out."""
    ragged: bool = False
    """allow_ragged_batch: the dynamic batcher may join requests whose shapes differ (the model
    handles the different lengths itself)."""
    doc: str = ""
    default: Any = None
    """For an optional input: what the model uses when it is left out (None: no single value, the
    doc says what happens)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.of(str(self.dtype)))
        object.__setattr__(self, "dims", tuple(self.dims))
        if not isinstance(self.optional, bool) or not isinstance(self.ragged, bool):
            raise TypeError(f"{self.name}: `optional` and `ragged` are booleans (the doc is the keyword `doc`)")
        for dim in self.dims:
            if isinstance(dim, int) and dim != -1 and dim < 1:
                raise ValueError(f"{self.name}: a dimension is -1 or positive, got {dim}")

    def shape(self, sizes: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """The dims with the named sizes filled in from `sizes` (-1 where a size is not given)."""
        sizes = sizes or {}
        return tuple(int(sizes.get(d, -1)) if isinstance(d, str) else d for d in self.dims)

    def written(self) -> str:
        """As the served-API table writes it: `sequences` BYTES [1]."""
        return f"`{self.name}` {self.dtype.value} [{', '.join(str(d) for d in self.dims)}]"
