"""Hugging Face checkpoint folders: one or many *.safetensors (with model.safetensors.index.json when sharded),
read without torch. Binding checks every weight the graph reads against the files before anything is loaded."""

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from pegainfer.errors import CheckpointError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.frontends.shards import check_divides, read_shard, take_shard
from pegainfer.ir.graph import Derivation, Shard
from pegainfer.ir.ops.quantize import dequantize
from pegainfer.ir.types import TensorType

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPES = ("F8_E4M3",)  # read as stored: safetensors' numpy reader has no float8 type, so from the file's bytes


@dataclass(frozen=True)
class FileSpan:
    """A tensor's bytes in a file, stored exactly as the graph wants them (no cast)."""
    file: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: BF16, F32, ...
    offset: int = -1  # where its bytes start in the file (-1: unknown)
    nbytes: int = 0
    stored_name: str = ""  # its name in the file, when the graph knows it by another (frontends/text_stack.py)
    rows: tuple[int, int, int] | None = None  # a view of a stored [n, rows, cols] tensor: (index, first row, stop)


def scan_checkpoint(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint with its file, shape and dtype, read from the headers alone."""
    files = _shard_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as handle:
                spans = _data_spans(file)
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    tensors[name] = TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype(), *spans[name])
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None
    return tensors


def _data_spans(file: Path) -> dict[str, tuple[int, int]]:
    """name -> (offset in the file, byte count), from the header: an 8-byte length, then JSON with each tensor's
    data_offsets relative to the end of the header (safe_open has already validated it)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    return {name: (8 + length + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"}


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' ({error})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard {missing[0]} which is not in {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (expected model.safetensors or shards with "
                              f"{INDEX_FILE})")
    return files


def check_weights(expected: dict[str, TensorType], tensors: dict[str, TensorInfo], folder: Path,
                  shards: Mapping[str, Shard] | None = None) -> None:
    """Every weight the graph reads exists with the right shape (a sharded one: the shape its slice is cut from)
    and a float dtype."""
    shards = shards or {}
    for name, type_ in expected.items():
        info = tensors.get(name)
        if info is None:
            where = INDEX_FILE if (folder / INDEX_FILE).is_file() else ", ".join(sorted({t.file.name for t in
                                                                                          tensors.values()}))
            raise CheckpointError(f"{folder}: tensor {name!r} ({type_}) is missing from {where}")
        if name in shards:
            check_divides(name, info.shape, shards[name])
            type_ = shards[name].full
        if info.shape != type_.shape and not (prod(info.shape) == prod(type_.shape) == 1):  # a scalar as [1]
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, "
                                  f"expected {list(type_.shape)}")
        if type_.dtype.name.startswith("f8"):
            if info.dtype not in FP8_DTYPES or dtype_from_name(info.dtype) != type_.dtype:
                raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected {type_.dtype} "
                                      f"(config.json's quantization_config stores the projections in FP8)")
        elif info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected a float type")


def derive_weights(derivations: dict[str, Derivation], weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights a lowered graph reads: `weights` plus each derived param (a concatenation of checkpoint tensors,
    or of row ranges of them)."""
    return {**weights, **{name: derive(d, weights) for name, d in derivations.items()}}


def derive(d: Derivation, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """One derived param from its sources in `weights`."""
    if d.dequantize is not None:
        rows, cols, dtype = d.dequantize
        values = dequantize(weights[d.sources[0]], weights[d.sources[1]], block=(rows, cols), dtype=dtype)
        return np.concatenate([values[start:stop] for _, start, stop in d.rows])
    if d.rows:
        return np.concatenate([weights[source][start:stop] for source, start, stop in d.pieces()])
    return np.concatenate([weights[s] for s in d.sources], axis=d.axis)


class LazyWeights(Mapping[str, np.ndarray]):
    """The expected weights, each read from its file when asked for (cast to the graph's storage dtype), so that
    an uploader holds one tensor at a time in host memory, not the whole checkpoint."""

    def __init__(self, expected: dict[str, TensorType], tensors: dict[str, TensorInfo],
                 filled: Mapping[str, np.ndarray] | None = None, shards: Mapping[str, Shard] | None = None) -> None:
        """`filled`: expected params the checkpoint lacks, with their values (load.py's defaults); `shards`: this
        rank's slices of sharded tensors (frontends/shards.py)."""
        self.expected, self.tensors, self.filled = expected, tensors, dict(filled or {})
        self.shards = dict(shards or {})

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.expected:
            raise KeyError(name)
        if name in self.filled:
            return self.filled[name]
        with safe_open(self.tensors[name].file, framework="numpy") as handle:
            return _read(handle, name, self.tensors[name], self.expected[name], self.shards.get(name))

    def span(self, name: str) -> FileSpan | None:
        """Where the tensor's bytes lie in its file, when they are stored as the graph wants them (an uploader
        then reads them straight into pinned memory); None when they need a cast or are not in the files (a
        default filled in: an FP8 cache's scales)."""
        if name in self.filled:
            return None
        info = self.tensors[name]
        if name in self.shards or info.offset < 0 or info.dtype not in (*FLOAT_DTYPES, *FP8_DTYPES) or \
                dtype_from_name(info.dtype) != self.expected[name].dtype:
            return None
        return FileSpan(info.file, info.offset, info.nbytes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.expected)

    def __len__(self) -> int:
        return len(self.expected)


def load_weights(expected: dict[str, TensorType], tensors: dict[str, TensorInfo],
                 shards: Mapping[str, Shard] | None = None) -> dict[str, np.ndarray]:
    """Loads the expected weights, cast to the graph's storage dtype, sharded ones as this rank's slices. Call
    check_weights first."""
    shards = shards or {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(tensors[name].file, []).append(name)
    weights: dict[str, np.ndarray] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="numpy") as handle:
            for name in names:
                weights[name] = _read(handle, name, tensors[name], expected[name], shards.get(name))
    return weights


def _read(handle, name: str, info: TensorInfo, type_: TensorType, shard: Shard | None = None) -> np.ndarray:
    """A tensor cast to the graph's storage dtype; an FP8 one from its bytes in the file, as stored; a sharded one
    as this rank's slice, reading only its bytes where the file holds the tensor as it is."""
    if shard is not None:
        return _read_shard(handle, name, info, type_, shard)
    if info.dtype in FP8_DTYPES:
        data = np.fromfile(info.file, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.view(type_.dtype.np_dtype).reshape(info.shape)
    stored = info.stored_name or name
    if info.rows is not None:  # frontends/fused_experts.py
        index, first, stop = info.rows
        data = handle.get_slice(stored)[index, first:stop]
    else:
        data = handle.get_tensor(stored)
    return data.astype(type_.dtype.np_dtype, copy=False).reshape(type_.shape)


def _read_shard(handle, name: str, info: TensorInfo, type_: TensorType, shard: Shard) -> np.ndarray:
    if info.dtype in FP8_DTYPES:
        raise CheckpointError(f"{info.file}: tensor {name!r}: sharding FP8 tensors is not implemented")
    if info.offset >= 0 and info.rows is None and not info.stored_name:
        stored = np.dtype(dtype_from_name(info.dtype).np_dtype)
        data = read_shard(info.file, info.offset, info.shape, stored, shard, name)
    else:  # a view of another tensor (fused experts, a text stack's prefix): sliced after it is read
        data = take_shard(_read(handle, name, info, shard.full), shard)
    return data.astype(type_.dtype.np_dtype, copy=False)
