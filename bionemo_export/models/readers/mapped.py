"""Which loaded weights are pages of a checkpoint file, and handing those pages back to the kernel.

Readers map their weight files rather than copy them (safetensors_files.py: a read-only shared
mapping; torch's `mmap=True` in torch_files.py: a private, read-only-in-practice one): a tensor's
bytes are then pages of the file, which the kernel fills as the model computes and can drop and
read again at any time.
A build uses that to hold the model's weights and an ONNX Runtime session's copy of them one at a
time rather than both (exporters/verification.py): once the PyTorch reference answers are computed,
`page_out` asks the kernel to reclaim the model's pages (madvise MADV_PAGEOUT), which frees them
without losing anything: the next forward pass reads them from the file again.

Only pages of file mappings are advised, found in /proc/self/maps: anonymous memory (a weight the
family computed) is never touched, and MADV_PAGEOUT never discards data in any case (anonymous
pages would go to swap, not away).

A half-precision checkpoint (ESM C's bf16) computes in fp32, and widening its weights in memory
would make them anonymous: 25 GB for ESM C 6B, more than a 24 GB host has. `widened` writes the
fp32 copies into one unlinked file instead and maps it, so they are pages of a file like an fp32
checkpoint's (WIDEN_ON_DISK_BYTES decides when).

That file is as large as the fp32 weights, and beside the checkpoint it is more disk than a host
has for the largest models (ESM-2 15B in fp16: 30 GB read, 60 GB widened, on ~75 GB). A streamed
build reads each weight once and the model's blocks one at a time, so under `widening_deferred`
(`assign_widened`) the weights of the model's repeated blocks (each child of its outermost
ModuleLists: the transformer layers) are not written: their fp32 tensors are views of a hole of
the file (zeros, no disk), and a block's fp32 copies are made in memory only while it computes
(forward hooks) or while a weight is read (`widened_while_used`), then dropped again. The rest
(embeddings, final norm, heads: a few hundred MB at most) is widened into the file as before.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
import tempfile
from collections import abc
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bionemo_export.memory_plan import EXTERNAL_DATA_THRESHOLD_BYTES

if TYPE_CHECKING:
    import torch

MADV_PAGEOUT = 21
"""Linux 5.4+: reclaim these pages now (file pages are dropped, anonymous ones swapped)."""
PAGE = mmap.PAGESIZE
WIDEN_ON_DISK_BYTES = EXTERNAL_DATA_THRESHOLD_BYTES
"""Half-precision weights whose fp32 copies would exceed this are widened into a file (`widened`):
the threshold above which a build keeps weights on disk."""


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps that maps a file."""

    start: int
    end: int
    path: str


def file_mappings() -> list[Mapping]:
    """This process's mappings of files (not anonymous memory, not the heap or stack), by address."""
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                    continue  # no inode: anonymous, [heap], [stack], [vdso]
                start, end = (int(part, 16) for part in fields[0].split("-"))
                found.append(Mapping(start, end, fields[5].rstrip("\n").removesuffix(" (deleted)")))
    except OSError:  # no /proc: nothing is known to be mapped
        return []
    return sorted(found, key=lambda mapping: mapping.start)


def mapped_file(tensor: torch.Tensor, mappings: list[Mapping] | None = None) -> str | None:
    """The file whose mapping holds `tensor`'s bytes, or None where they are anonymous memory."""
    mappings = file_mappings() if mappings is None else mappings
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    index = bisect.bisect_right([m.start for m in mappings], start) - 1
    if index >= 0 and mappings[index].start <= start and end <= mappings[index].end:
        return mappings[index].path
    return None


def mapped_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(bytes of `tensors` that are pages of a file, bytes that are anonymous memory)."""
    mappings = file_mappings()
    in_files = anonymous = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if mapped_file(tensor, mappings) is not None:
            in_files += size
        else:
            anonymous += size
    return in_files, anonymous


def page_out(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the resident pages of those `tensors` that are pages of a file
    (see the module); returns the bytes advised. Nothing is lost: the pages are read from the file
    again when the tensors are next used. Does nothing where madvise or /proc is missing."""
    libc = _libc()
    if libc is None:
        return 0
    mappings = file_mappings()
    advised = 0
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.data_ptr() in seen or mapped_file(tensor, mappings) is None:
            continue
        seen.add(tensor.data_ptr())
        start = -(-tensor.data_ptr() // PAGE) * PAGE  # whole pages inside the tensor only
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
        if end > start and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the whole pages inside `tensors` that this process has in memory now (the present
    bit of /proc/self/pagemap), counting each tensor once: how much of a mapped model its resident
    memory holds. 0 where /proc is missing."""
    total = 0
    seen: set[int] = set()
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            for tensor in tensors:
                if tensor.data_ptr() in seen:
                    continue
                seen.add(tensor.data_ptr())
                start = -(-tensor.data_ptr() // PAGE) * PAGE
                end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
                if end <= start:
                    continue
                pagemap.seek(start // PAGE * 8)
                entries = pagemap.read((end - start) // PAGE * 8)
                present = sum(entries[index + 7] >> 7 for index in range(0, len(entries), 8))  # bit 63
                total += present * PAGE
    except OSError:
        return 0
    return total


def widened(weights: abc.Mapping[str, torch.Tensor], directory: str | None = None,
            threshold: int | None = None) -> dict[str, torch.Tensor]:
    """`weights` in fp32. Where the half-precision ones' fp32 copies exceed `threshold` bytes, they
    are written, one tensor at a time, into a file in `directory` (the temporary directory: TMPDIR)
    that is mapped and unlinked at once: the copies are then pages of a file the kernel can drop and
    read again (page_out), and the disk space is given back when the last tensor is freed. Under
    the threshold (None: WIDEN_ON_DISK_BYTES), or where no file can be written, they are widened in
    memory."""
    return _widened(weights, directory, threshold)[0]


def assign_widened(module: torch.nn.Module, weights: abc.Mapping[str, torch.Tensor]) -> None:
    """Give `module` `weights` (its parameter names) widened to fp32 (`widened`), the tensors
    themselves rather than copies (load_state_dict's `assign`). Under `widening_deferred`, the
    weights of its repeated blocks are widened only while used (the module's docstring)."""
    defer = block_parameter_names(module) if _DEFERRING.get() else frozenset()
    fp32, holes = _widened(weights, defer=defer)
    module.load_state_dict(fp32, strict=False, assign=True)
    if holes:
        _defer(module, {name: weights[name] for name in holes})


@contextmanager
def widening_deferred(deferred: bool = True) -> Iterator[None]:
    """Within this block, `assign_widened` widens a half-precision model's block weights only while
    they are used: what a build that reads each weight once (a streamed build) loads its model under."""
    token = _DEFERRING.set(deferred)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


@contextmanager
def widened_while_used(parameters: Iterable[torch.Tensor]) -> Iterator[None]:
    """Within this block, those of `parameters` whose widening was deferred hold their fp32 values
    (in memory); after it, their placeholders again. Other tensors are left as they are."""
    held = [deferred for p in parameters if (deferred := _deferred(p)) is not None]
    for deferred in held:
        deferred.hold()
    try:
        yield
    finally:
        for deferred in held:
            deferred.release()


@contextmanager
def deferred_widening_paused() -> Iterator[None]:
    """Within this block the blocks' hooks widen nothing: for tracing (torch.export reads the
    weights' dtypes and shapes, never their values)."""
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)


def is_deferred(parameter: torch.Tensor) -> bool:
    """Whether `parameter`'s widening is deferred (its values are zeros outside `widened_while_used`)."""
    return _deferred(parameter) is not None


def block_parameter_names(module: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters of `module`'s repeated blocks: the children of its outermost
    ModuleLists (the layers of a transformer)."""
    return frozenset(f"{prefix}.{name}" for prefix, block in _blocks(module)
                     for name, _ in block.named_parameters())


_DEFERRING: ContextVar[bool] = ContextVar("bionemo_export_widening_deferred", default=False)
_PAUSED: ContextVar[bool] = ContextVar("bionemo_export_deferred_widening_paused", default=False)


@dataclass(eq=False)
class _Deferred:
    """One parameter widened only while used: its half-precision source (pages of the checkpoint)
    and its placeholder (an fp32 view of a hole in the widened file)."""

    parameter: torch.nn.Parameter
    half: torch.Tensor
    placeholder: torch.Tensor
    users: int = field(default=0)

    def hold(self) -> None:
        import torch

        if self.users == 0:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode the caller is in
                self.parameter.data = self.half.float()
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.parameter.data = self.placeholder


_DEFERRED_ATTRIBUTE = "_bionemo_export_deferred_widening"
"""The attribute of a parameter whose widening is deferred: its `_Deferred`."""


def _deferred(parameter: torch.Tensor) -> _Deferred | None:
    return getattr(parameter, _DEFERRED_ATTRIBUTE, None)


def _blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) for each child of `module`'s outermost ModuleLists."""
    import torch

    lists: list[str] = []
    blocks = []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and not any(name.startswith(f"{outer}.") for outer in lists):
            lists.append(name)
            blocks.extend((f"{name}.{index}" if name else str(index), block) for index, block in enumerate(child))
    return blocks


def _defer(module: torch.nn.Module, halves: abc.Mapping[str, torch.Tensor]) -> None:
    """Record `module`'s parameters named in `halves` (now placeholders) as deferred, and hook each
    block to widen its own while it computes."""
    for name, half in halves.items():
        parameter = module.get_parameter(name)
        setattr(parameter, _DEFERRED_ATTRIBUTE, _Deferred(parameter, half, parameter.data))
    for prefix, block in _blocks(module):
        parameters = [p for name, p in block.named_parameters() if f"{prefix}.{name}" in halves]
        if not parameters:
            continue
        block.register_forward_pre_hook(_holding(parameters))
        block.register_forward_hook(_releasing(parameters), always_call=True)


def _holding(parameters: abc.Sequence[torch.Tensor]) -> abc.Callable[[object, object], None]:
    """A block's forward pre-hook: widen its deferred `parameters`."""
    def hook(_module: object, _args: object) -> None:
        if not _PAUSED.get():
            for parameter in parameters:
                getattr(parameter, _DEFERRED_ATTRIBUTE).hold()
    return hook


def _releasing(parameters: abc.Sequence[torch.Tensor]) -> abc.Callable[[object, object, object], None]:
    """A block's forward hook (run however the forward ends): drop its widened `parameters`."""
    def hook(_module: object, _args: object, _output: object) -> None:
        if not _PAUSED.get():
            for parameter in parameters:
                getattr(parameter, _DEFERRED_ATTRIBUTE).release()
    return hook


def _widened(weights: abc.Mapping[str, torch.Tensor], directory: str | None = None, threshold: int | None = None,
             defer: Collection[str] = ()) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`widened`, and the names of the half-precision weights in `defer` left as holes of the file
    (their fp32 tensors read zeros; empty where the weights were widened in memory)."""
    import torch

    half = {key: t for key, t in weights.items() if t.is_floating_point() and t.dtype != torch.float32}
    sizes = {key: t.numel() * 4 for key, t in half.items()}
    if sum(sizes.values()) <= (WIDEN_ON_DISK_BYTES if threshold is None else threshold):
        return {key: t.float() for key, t in weights.items()}, []
    offsets, end = {}, 0
    for key, size in sizes.items():
        offsets[key] = end
        end = -(-(end + size) // 64) * 64  # each tensor 64-byte aligned
    try:
        handle = tempfile.TemporaryFile(prefix=".bionemo-export-fp32-", dir=directory)
    except OSError:
        return {key: t.float() for key, t in weights.items()}, []
    holes = [key for key in half if key in defer]
    with handle:
        for key, tensor in half.items():
            if key in defer:
                continue  # a hole: no disk until written, and it never is
            handle.seek(offsets[key])
            handle.write(tensor.float().contiguous().numpy().data)  # one tensor in memory at a time
        handle.truncate(max(end, 1))
        handle.flush()
        # A shared mapping: the tensors are writable as torch expects and are pages of the file (clean,
        # droppable: nothing writes them, and a write would only change this unlinked file). Not a
        # private one: the kernel charges a private writable mapping against its commit limit, and
        # refused ESM C 6B's 25 GB that way (ENOMEM) on a 24 GB host without swap.
        mapping = mmap.mmap(handle.fileno(), max(end, 1), access=mmap.ACCESS_WRITE)
    out = {}
    for key, tensor in weights.items():
        if key in half:
            out[key] = torch.frombuffer(mapping, dtype=torch.float32, count=tensor.numel(),
                                        offset=offsets[key]).view(tensor.shape)
        else:
            out[key] = tensor.float()
    return out, holes


WORTH_COLLECTING_BYTES = 256 << 20
"""Below this many bytes of weights, `return_freed_memory` leaves them to Python's own collections:
a full collection walks every object torch and transformers made (0.38 s a call on a 2-core AVX-512
host, measured: 3.4 s of a 4.3 s build of a tiny ESM-2 whose graphs came from the graph cache),
while such a graph's garbage is a few MB against the GBs a host has."""


def return_freed_memory(freed_bytes: int) -> None:
    """Collect Python's garbage (an exported ONNX program is a graph of cycles that reference
    counting never frees) and hand the C heap's free pages back to the kernel (glibc's
    malloc_trim): arrays of a few MB freed by a step otherwise stay resident in the heap.
    `freed_bytes`: the weights of what was let go; below WORTH_COLLECTING_BYTES nothing is done."""
    import gc

    if freed_bytes < WORTH_COLLECTING_BYTES:
        return
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def _libc() -> ctypes.CDLL | None:
    if not os.path.exists("/proc/self/maps"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
