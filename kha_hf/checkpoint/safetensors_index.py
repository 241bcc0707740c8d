"""Read a safetensors checkpoint's structure from file headers only (never the tensor data).

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON header, then the data buffer. The
header gives every tensor's dtype, shape and byte range, so the whole layout is known without loading anything.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import KHAError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    file: str  # shard file name, relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check one safetensors header completely; a truncated or corrupt file raises KHAError naming it.

    Checked: the header is a JSON object; every tensor has a known dtype, a shape of non-negative integers and
    `data_offsets` [begin, end] whose length is shape x dtype size; the tensors tile the data buffer exactly (no
    overlap, no gap, nothing past the end of the file), as the safetensors format requires.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise KHAError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise KHAError(f"corrupt or truncated safetensors file {path}: header runs past the end of file")
            header = json.loads(f.read(header_len), object_pairs_hook=_refuse_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise KHAError(f"corrupt safetensors file {path}: header is not valid JSON ({err})") from err
    except _DuplicateKey as err:  # JSON keeps the last; safetensors refuses the file: so does kha
        raise KHAError(
            f"corrupt safetensors file {path}: tensor {err.args[0]!r} is listed twice in its header"
        ) from None
    except RecursionError:
        raise KHAError(f"corrupt safetensors file {path}: header nests too deeply") from None
    if not isinstance(header, dict):
        raise KHAError(f"corrupt safetensors file {path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    # safetensors (0.4 to 0.7) refuses any other __metadata__ (a `{"format": {"pt": 1}}` passed here, and the
    # converted checkpoint then loaded nowhere)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise KHAError(f"corrupt safetensors file {path}: __metadata__ must map names to strings")
    spans = []
    for key, info in header.items():
        spans.append((*_check_entry(path, key, info), key))
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position:
            problem = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise KHAError(f"corrupt safetensors file {path}: tensor {key!r} {problem}")
        position = end
    data_len = size - 8 - header_len
    if position != data_len:
        raise KHAError(
            f"truncated or corrupt safetensors file {path}: header describes {position} bytes of data, "
            f"file holds {data_len}"
        )
    return header


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key given twice in one object is an error (json.loads would keep the last)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _check_entry(path: Path, key: str, info) -> tuple[int, int]:
    """(begin, end) of one header entry after checking its dtype, shape and byte length."""
    bad = f"corrupt safetensors file {path}: tensor {key!r}"
    if not isinstance(info, dict):
        raise KHAError(f"{bad} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise KHAError(f"{bad} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise KHAError(f"{bad} has shape {shape!r}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise KHAError(f"{bad} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    numel = 1
    for n in shape:
        numel *= n
    expected = numel * SAFETENSORS_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise KHAError(f"{bad}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} (needs {expected})")
    return offsets[0], offsets[1]


def member_path(folder: Path, name: str, what: str = "file") -> Path:
    """FOLDER/NAME for a file name read from a checkpoint (e.g. a shard in model.safetensors.index.json).

    Only plain names are accepted: no absolute path, no separator, no `..`, so nothing outside FOLDER is read
    from or written to. (The file itself may be a symbolic link, as in the Hugging Face cache.)
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise KHAError(f"refusing {what} name {name!r} in {folder}: it must be a plain file name inside the folder")
    return folder / name


def read_index(folder: Path) -> dict[str, str]:
    """The weight_map of FOLDER/model.safetensors.index.json, checked: tensor name -> plain shard file name."""
    index_path = folder / INDEX_FILE
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise KHAError(f"{index_path} is not valid JSON: {err}") from err
    except RecursionError:
        raise KHAError(f"{index_path} nests too deeply to be a shard index") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise KHAError(f"{index_path} must be a JSON object with a 'weight_map' object")
    weight_map = index["weight_map"]
    for file in weight_map.values():
        member_path(folder, file, "shard")  # refuses absolute paths, separators and ..
    return weight_map


def read_checkpoint_index(folder: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for a single-file or sharded safetensors checkpoint folder."""
    if (folder / INDEX_FILE).is_file():
        weight_map = read_index(folder)
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise no_weights(folder)
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise KHAError(f"shard {missing[0]} is named in {INDEX_FILE} but missing from {folder}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in read_header(folder / name).items():
            if key in tensors:
                raise KHAError(f"tensor {key!r} is stored twice: in {tensors[key].file} and in {name}")
            tensors[key] = TensorInfo(name, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))
    stray = [key for key, file in weight_map.items() if key not in tensors or tensors[key].file != file]
    if stray:
        raise KHAError(f"{INDEX_FILE} lists {stray[0]} in {weight_map[stray[0]]}, but that shard does not hold it")
    return tensors


def shard_files(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted({info.file for info in tensors.values()})


def no_weights(folder: Path) -> KHAError:
    """The refusal of a folder without safetensors weights, for a tool that needs them."""
    return KHAError(f"no safetensors weights in {folder} (expected {SINGLE_FILE} or {INDEX_FILE})")
