"""Checkpoint loading for the diffusers / Hugging Face directory layouts.

A checkpoint directory holds ``config.json`` plus either one
``<weights_name>`` safetensors file or a ``<index_name>`` JSON index whose
``weight_map`` maps every tensor name to the shard file that holds it
(what ``save_pretrained(max_shard_size=...)`` writes). Both the Wan DiT and
every language-model family load through here, so a broken checkpoint gets the same
kind of message whichever model it was meant for.

Every tensor read is checked where it is read, with the file it came from:
it must have a floating-point dtype the models compute in and hold finite
values. An integer tensor would otherwise be cast to float without a word,
and a NaN or Inf would only show up later, in the outputs. Casts to the
model's dtypes happen in one place, :func:`load_into_module`, which logs them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from numaov import NumaovError

logger = logging.getLogger(__name__)

# Long name lists are cut in the message (the count is always stated in full) so that
# pointing a model at the wrong checkpoint gives a readable error, not a page of names.
_MAX_NAMES_SHOWN = 12

# The dtypes a weight may have on disk: the ones the models compute in, and float64 (still a
# float weight, only stored wider). float8 is refused along with the integers: float8
# checkpoints carry per-block scales that a plain cast would drop.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CheckpointError(NumaovError):
    """A checkpoint directory, config or tensor set does not fit the model."""


def _require_directory(directory: str | Path, what: str) -> Path:
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"{what}: checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"{what}: checkpoint path {str(path)!r} is a file; expected a directory holding "
            "config.json and the safetensors weights"
        )
    return path


def read_config(
    directory: str | Path, name: str = "config.json", what: str = "checkpoint"
) -> dict[str, Any]:
    """Read ``directory/name`` as a JSON object, with a clear error for each way it can fail."""
    path = _require_directory(directory, what) / name
    if not path.is_file():
        raise CheckpointError(f"{what}: {name} not found in {str(path.parent)!r}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what}: {str(path)!r} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{what}: {str(path)!r} holds a JSON {type(config).__name__}; expected an object "
            "of configuration keys"
        )
    return config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_CHECK_CHUNK = 1 << 22
# Per weight dtype: the integer dtype of its bits and its exponent mask.
_EXPONENT_BITS = {
    torch.float64: (torch.int64, 0x7FF0000000000000), torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
}


def _check_weight(path: Path, name: str, tensor: torch.Tensor, what: str) -> None:
    """Raise CheckpointError unless ``tensor`` has a WEIGHT_DTYPES dtype and finite values."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise CheckpointError(
            f"{what}: tensor {name!r} in {str(path)!r} has dtype {_dtype_name(tensor.dtype)}; "
            f"expected a floating-point weight ({', '.join(map(_dtype_name, WEIGHT_DTYPES))})"
        )
    # One pass over the tensor's bits, a chunk at a time: a value is NaN or Inf exactly when
    # its exponent bits are all set, which integer operations test 3x faster than isfinite
    # (which widens bf16 to f32 first: on a whole 420 MB embedding it took 1 GB more). The
    # NaN / Inf counts are computed only for the message.
    bits, exponent = _EXPONENT_BITS[tensor.dtype]
    flat = tensor.reshape(-1).view(bits)
    if any(bool(((flat[i:i + _CHECK_CHUNK] & exponent) == exponent).any())
           for i in range(0, flat.numel(), _CHECK_CHUNK)):
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
        found = " and ".join(
            f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "Inf")) if count
        )
        raise CheckpointError(
            f"{what}: tensor {name!r} in {str(path)!r} holds {found} of {tensor.numel()} "
            "values; expected finite values"
        )


# safetensors dtype codes; every one is read, so a non-float tensor is refused by
# _check_weight with its torch name like any other.
_DTYPE_CODES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: code for code, dtype in _DTYPE_CODES.items()}
_COPY_CHUNK = 1 << 26


def _copy_range(source: int, start: int, target: int, at: int, size: int) -> None:
    """Copy ``size`` bytes of file ``source`` from ``start`` to file ``target`` at ``at``:
    in the kernel where the file systems allow it, else through one 64 MiB buffer."""
    while size:
        try:
            copied = os.copy_file_range(source, target, min(size, _COPY_CHUNK), start, at)
        except OSError:  # e.g. across file systems on older kernels
            copied = os.pwrite(target, os.pread(source, min(size, _COPY_CHUNK), start), at)
        if copied == 0:
            raise CheckpointError(f"cannot copy {size} bytes from offset {start}: the "
                                  "checkpoint file is cut short")
        start, at, size = start + copied, at + copied, size - copied


class _SafetensorsFile:
    """One ``.safetensors`` file: its header, and reads of one tensor or of a row range.

    Reads go through ``readinto`` into tensors that own their memory, not through a memory
    map: a mapped checkpoint puts its pages in the process's resident memory beside the model
    and stays mapped as long as any view of it lives, so an export held both.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        try:
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > path.stat().st_size:
                    raise ValueError(f"header length {length} exceeds the file size")
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"{what}: cannot read safetensors file {str(path)!r} ({exc})"
            ) from exc
        self.data_start = 8 + length
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype = _DTYPE_CODES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, stop = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"{what}: tensor {name!r} in {str(path)!r} has an unreadable header "
                    f"entry {entry!r}"
                ) from exc
            itemsize = torch.empty((), dtype=dtype).element_size()
            if stop - begin != math.prod(shape) * itemsize:
                raise CheckpointError(
                    f"{what}: tensor {name!r} in {str(path)!r} spans {stop - begin} bytes; "
                    f"expected {math.prod(shape) * itemsize} for shape {list(shape)}"
                )
            self.entries[name] = (dtype, shape, begin, stop)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` or its rows ``rows`` (a step-1 slice of dim 0, one contiguous read)."""
        dtype, shape, begin, _ = self.entries[name]
        first, count = 0, shape[0] if shape else 1
        if rows is not None:
            first, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError("only step-1 row slices are read")
            count = max(stop - first, 0)
        out = torch.empty((count, *shape[1:]) if shape else (), dtype=dtype)
        row_bytes = out.element_size() * math.prod(shape[1:])
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else None
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.data_start + begin + first * row_bytes)
                got = handle.readinto(buffer) if buffer is not None else 0
        except OSError as exc:
            raise CheckpointError(
                f"{self.what}: cannot read tensor {name!r} from {str(self.path)!r} ({exc})"
            ) from exc
        if buffer is not None and got != len(buffer):
            raise CheckpointError(
                f"{self.what}: tensor {name!r} in {str(self.path)!r} is cut short ({got} of "
                f"{len(buffer)} bytes); the file is truncated"
            )
        return out


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a single-file or sharded safetensors checkpoint, read on access.

    Opening reads only the headers (names, shapes, dtypes); ``checkpoint[name]`` reads one
    tensor and :meth:`read` its rows only, each checked as it is read (:func:`_check_weight`).
    So a loader that takes each tensor, converts it and lets it go holds the model's weights
    once, never the checkpoint beside them, and a DP rank reads only its own rows.
    """

    def __init__(self, files: Mapping[str, _SafetensorsFile], what: str) -> None:
        self._what = what
        self._files = dict(files)  # tensor name -> the file that holds it

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[name].entries[name][1]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self._files}

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows ``rows`` (dim 0) read from the file."""
        file = self._files[name]
        tensor = file.read(name, rows)
        _check_weight(file.path, name, tensor, self._what)
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __contains__(self, name: object) -> bool:  # from the headers: nothing is read
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def dtype(self, name: str) -> torch.dtype:
        return self._files[name].entries[name][0]

    def copy_to(self, names: Iterable[str], path: Path) -> int:
        """Write tensors ``names`` as stored (dtypes, shapes and bytes: float8 weights and
        their scales alike) into a new safetensors file ``path``; returns its size. The bytes
        go file to file in chunks, never through a tensor, so copying a layer of any size
        costs no memory."""
        names = list(names)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        sources, offset = [], 0
        for name in names:
            file = self._files[name]
            dtype, shape, begin, stop = file.entries[name]
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + stop - begin]}
            sources.append((file, file.data_start + begin, stop - begin))
            offset += stop - begin
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
        with path.open("wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            at = out.tell()
            for file, start, size in sources:
                with file.path.open("rb") as source:
                    _copy_range(source.fileno(), start, out.fileno(), at, size)
                at += size
        return at

    def read_float8(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """A float8 tensor as it is stored (no check, no cast): only for a reader that applies
        its scales (:class:`BlockFp8Checkpoint`)."""
        if self.dtype(name) not in FLOAT8_DTYPES:
            raise CheckpointError(f"{self._what}: tensor {name!r} has dtype "
                                  f"{_dtype_name(self.dtype(name))}; expected a float8 weight")
        return self._files[name].read(name, rows)


#: The float8 dtypes a block-quantized weight may have on disk.
FLOAT8_DTYPES = (torch.float8_e4m3fn,)
#: The name of a quantized weight's inverse scales, beside ``<module>.weight``.
SCALE_SUFFIX = "_scale_inv"


class BlockFp8Checkpoint(Mapping[str, torch.Tensor]):
    """A checkpoint with block-quantized float8 weights seen as plain weights of ``dtype``.

    The layout of DeepSeek's and Qwen's released FP8 checkpoints (``quantization_config``:
    ``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [bn, bk]``): each quantized
    ``<m>.weight [N, K]`` is float8_e4m3fn and has a float32 ``<m>.weight_scale_inv
    [ceil(N/bn), ceil(K/bk)]``, one per block; the weight is ``w.float() * scale_inv`` with
    the scale of its block (the last block of a row or column may be partial and uses its own
    scale), as transformers' ``finegrained_fp8`` dequantizes it. The scales are hidden from
    :meth:`shapes`; a weight is dequantized as it is read, ``bn`` rows at a time straight into
    a ``dtype`` tensor, so no float32 copy of it is ever held. A float8 weight without its
    scale, or a scale without its weight or of the wrong shape, is a CheckpointError.
    """

    def __init__(self, checkpoint: SafetensorsCheckpoint, block: tuple[int, int],
                 dtype: torch.dtype, what: str) -> None:
        self._checkpoint = checkpoint
        self._block = block
        self._dtype = dtype
        self._what = what
        names = set(checkpoint)
        self._quantized: set[str] = set()
        for name in sorted(names):
            if checkpoint.dtype(name) not in FLOAT8_DTYPES:
                continue
            scale = name + SCALE_SUFFIX
            if scale not in names:
                raise CheckpointError(f"{what}: float8 tensor {name!r} has no {scale!r}; "
                                      "expected one float32 scale per weight block")
            rows, cols = checkpoint.shape(name)
            expected = (-(-rows // block[0]), -(-cols // block[1]))
            if tuple(checkpoint.shape(scale)) != expected:
                raise CheckpointError(
                    f"{what}: {scale!r} has shape {list(checkpoint.shape(scale))}; expected "
                    f"{list(expected)} (one per {block[0]}x{block[1]} block of "
                    f"{[rows, cols]})")
            self._quantized.add(name)
        orphans = sorted(n for n in names if n.endswith(SCALE_SUFFIX)
                         and n.removesuffix(SCALE_SUFFIX) not in self._quantized)
        if orphans:
            raise CheckpointError(f"{what}: scales without a float8 weight: "
                                  f"{_format_names(orphans)}")
        self._names = [n for n in checkpoint if not n.endswith(SCALE_SUFFIX)]

    @property
    def quantized(self) -> frozenset[str]:
        """The names of the float8 weights."""
        return frozenset(self._quantized)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._checkpoint.shape(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self._names}

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its rows ``rows``), dequantized to ``dtype`` when float8."""
        if name not in self._quantized:
            return self._checkpoint.read(name, rows)
        total, cols = self.shape(name)
        first, stop, _ = (rows or slice(None)).indices(total)
        stop = max(stop, first)
        scale = self._checkpoint.read(name + SCALE_SUFFIX).float()  # [ceil(N/bn), ceil(K/bk)]
        # per column: the scale of its column block ([ceil(N/bn), K]; small beside the weight)
        scale = scale.repeat_interleave(self._block[1], dim=1)[:, :cols]
        out = torch.empty(stop - first, cols, dtype=self._dtype)
        bn = self._block[0]
        row = first
        while row < stop:  # one block row (or the part of it in rows) at a time
            end = min(stop, (row // bn + 1) * bn)
            part = self._checkpoint.read_float8(name, slice(row, end)).float()
            out[row - first:end - first] = part * scale[row // bn]
            row = end
        _check_weight(self._checkpoint_path(name), name, out, self._what)
        return out

    def _checkpoint_path(self, name: str) -> Path:
        return self._checkpoint._files[name].path

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __contains__(self, name: object) -> bool:  # from the headers: nothing is read
        return name in self._checkpoint and not str(name).endswith(SCALE_SUFFIX)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def open_safetensors_checkpoint(
    directory: str | Path,
    weights_name: str,
    index_name: str,
    what: str = "checkpoint",
) -> SafetensorsCheckpoint:
    """Open a single-file or sharded safetensors checkpoint; its tensors are read on access.

    ``weights_name`` (e.g. ``diffusion_pytorch_model.safetensors``) wins when
    present; otherwise ``index_name`` (e.g.
    ``diffusion_pytorch_model.safetensors.index.json``) must exist and every
    shard it names must hold exactly the tensors the index assigns to it, so a
    partially copied checkpoint fails here rather than as missing weights later.
    """
    path = _require_directory(directory, what)
    single = path / weights_name
    if single.is_file():
        logger.debug("opening %s", single)
        file = _SafetensorsFile(single, what)
        return SafetensorsCheckpoint({name: file for name in file.entries}, what)

    index_path = path / index_name
    if not index_path.is_file():
        present = sorted(p.name for p in path.glob("*.safetensors*"))
        raise CheckpointError(
            f"{what}: neither {weights_name} nor {index_name} found in {str(path)!r}"
            f" (safetensors files present: {', '.join(present) if present else 'none'})"
        )
    index = read_config(path, index_name, what)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{what}: {str(index_path)!r} has no 'weight_map' object mapping tensor names "
            "to shard files"
        )

    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(str(shard), set()).add(name)
    missing_shards = sorted(s for s in by_shard if not (path / s).is_file())
    if missing_shards:
        raise CheckpointError(
            f"{what}: shard files named by {index_name} are missing from {str(path)!r}: "
            f"{_format_names(missing_shards)}"
        )

    files: dict[str, _SafetensorsFile] = {}
    for shard in sorted(by_shard):
        file = _SafetensorsFile(path / shard, what)
        absent = sorted(by_shard[shard] - file.entries.keys())
        if absent:
            raise CheckpointError(
                f"{what}: shard {shard!r} lacks tensors that {index_name} assigns to it: "
                f"{_format_names(absent)}"
            )
        # Tensors a shard holds beyond its index entries are kept: load_into_module then
        # reports them as unexpected, with the model's point of view on what is wrong.
        files.update((name, file) for name in file.entries)
    return SafetensorsCheckpoint(files, what)


def load_safetensors_state_dict(
    directory: str | Path,
    weights_name: str,
    index_name: str,
    what: str = "checkpoint",
) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded checkpoint, read and checked now
    (:func:`open_safetensors_checkpoint` reads them one at a time instead)."""
    return dict(open_safetensors_checkpoint(directory, weights_name, index_name, what).items())


def _format_names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    if len(names) > _MAX_NAMES_SHOWN:
        shown += f", ... ({len(names) - _MAX_NAMES_SHOWN} more)"
    return shown


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def check_state_dict(
    expected: Mapping[str, torch.Size | tuple[int, ...]],
    found: Mapping[str, torch.Size | tuple[int, ...]],
    what: str,
) -> None:
    """Raise one CheckpointError naming every missing, unexpected and mis-shaped tensor
    (``expected`` and ``found`` map tensor names to shapes)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    misshaped = sorted(
        f"{name} (expected {list(expected[name])}, found {list(found[name])})"
        for name in expected.keys() & found.keys()
        if tuple(expected[name]) != tuple(found[name])
    )
    problems = []
    if missing:
        problems.append(f"{_plural(len(missing), 'missing tensor')}: {_format_names(missing)}")
    if unexpected:
        problems.append(
            f"{_plural(len(unexpected), 'unexpected tensor')}: {_format_names(unexpected)}"
        )
    if misshaped:
        problems.append(
            f"{_plural(len(misshaped), 'mis-shaped tensor')}: {_format_names(misshaped)}"
        )
    if problems:
        raise CheckpointError(
            f"{what}: checkpoint does not match the model config; " + "; ".join(problems)
        )


def _log_casts(
    source: Mapping[str, torch.dtype], target: Mapping[str, torch.dtype], what: str
) -> None:
    """Log, once per pair of dtypes, the tensors whose values change dtype on the way in."""
    casts: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name, dtype in source.items():
        if dtype != target[name]:
            casts.setdefault((dtype, target[name]), []).append(name)
    for (source, dest), names in casts.items():
        logger.info(
            "%s: %s cast from %s to %s: %s", what, _plural(len(names), "tensor"),
            _dtype_name(source), _dtype_name(dest), _format_names(sorted(names)),
        )


def read_state_dict(
    checkpoint: SafetensorsCheckpoint,
    dtype_of: Callable[[str], torch.dtype],
    what: str,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint``, read one at a time and cast to ``dtype_of(name)`` as
    it is read (after ``transform(name, tensor)`` when given): the weights are held once, at
    the dtype the model keeps, never the checkpoint's copy beside them. Casts are logged as
    :func:`load_into_module` logs them."""
    _log_casts({name: checkpoint.dtype(name) for name in checkpoint},
               {name: dtype_of(name) for name in checkpoint}, what)
    state = {}
    for name in checkpoint:
        tensor = checkpoint[name]
        if transform is not None:
            tensor = transform(name, tensor)
        state[name] = tensor.to(dtype_of(name))
    return state


def load_into_module(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    what: str,
    assign: bool = False,
    dtype_of: Callable[[str], torch.dtype] | None = None,
) -> None:
    """Load ``state_dict`` into ``module``'s parameters and persistent buffers.

    Every name must match exactly with the same shape (else CheckpointError).
    By default values are copied and cast to the dtype the module already has,
    so a bf16 checkpoint loads into an fp32 model and the other way round.
    ``assign=True`` adopts the tensors themselves: the way to fill a module
    built on the meta device without allocating it twice; each is first cast
    to ``dtype_of(name)`` when given, else keeps its own dtype. Every cast is
    logged with the names of the tensors it applies to.
    """
    current = module.state_dict()
    check_state_dict(
        {name: tensor.shape for name, tensor in current.items()},
        {name: tensor.shape for name, tensor in state_dict.items()},
        what,
    )
    if not assign:
        target = {name: current[name].dtype for name in state_dict}
    else:
        target = {
            name: dtype_of(name) if dtype_of is not None else tensor.dtype
            for name, tensor in state_dict.items()
        }
    _log_casts({name: tensor.dtype for name, tensor in state_dict.items()}, target, what)
    if assign:
        state_dict = {name: tensor.to(target[name]) for name, tensor in state_dict.items()}
    module.load_state_dict(dict(state_dict), strict=True, assign=assign)


class _Widened(nn.Module):
    """A parametrization: the stored weight as f32 wherever it is read."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight.float()


def compute_in_f32(model: nn.Module) -> int:
    """``model`` computing in f32 on the weights it holds (bf16 / f16 as loaded): each weight
    is widened where a module reads it, one module at a time, and let go after. So the model
    holds its weights at the checkpoint's width, computes what the f32 model computes (bf16
    and f16 values are exact in f32), and a traced graph holds them at that width with a Cast
    in front: what the IR stores for a bf16 export, with no f32 copy ever made (weights held
    in f32, as a language model's router or Wan's timestep tables, stay as they are). Returns
    how many weights are widened so. An embedding gathers its rows from the table as held and
    widens them after (``_gather_then_widen``)."""
    widened = 0
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype != torch.float32:
                parametrize.register_parametrization(module, name, _Widened(), unsafe=True)
                widened += 1
        if isinstance(module, nn.Embedding) and parametrize.is_parametrized(module, "weight"):
            module.forward = _gather_then_widen.__get__(module)
    return widened


def _gather_then_widen(self: nn.Embedding, ids: Tensor) -> Tensor:
    """An embedding's rows gathered from its table as held, then widened: the values a gather
    from the widened table gives, without widening the whole table (UMT5-XXL's 256,384 x
    4,096, 2.1 GB in bf16, which ONNX Runtime cast to a 4.2 GB f32 copy at every call of the
    export's parity). A tied head reading ``weight`` still gets it widened."""
    table = self.parametrizations.weight.original
    return nn.functional.embedding(ids, table, self.padding_idx).float()
