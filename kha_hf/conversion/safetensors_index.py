"""Read a safetensors checkpoint's structure from file headers only (never the tensor data).

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON header, then the data buffer. The
header gives every tensor's dtype, shape and byte range, so the whole layout is known without loading anything.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KHAError

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
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    file: str  # shard file name, relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check one safetensors header; a truncated or corrupt file raises KHAError naming it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise KHAError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise KHAError(f"corrupt or truncated safetensors file {path}: header runs past the end of file")
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise KHAError(f"corrupt safetensors file {path}: header is not valid JSON ({err})") from err
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if end != data_len:
        raise KHAError(
            f"truncated or corrupt safetensors file {path}: header describes {end} bytes of data, file holds {data_len}"
        )
    return header


def read_checkpoint_index(folder: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for a single-file or sharded safetensors checkpoint folder."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise KHAError(f"no safetensors weights in {folder} (expected {SINGLE_FILE} or {INDEX_FILE})")
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise KHAError(f"shard {missing[0]} is named in {INDEX_FILE} but missing from {folder}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in read_header(folder / name).items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise KHAError(f"unsupported tensor dtype {info['dtype']} for {key} in {name}")
            tensors[key] = TensorInfo(name, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))
    stray = [key for key, file in weight_map.items() if key not in tensors]
    if stray:
        raise KHAError(f"{INDEX_FILE} lists {stray[0]} in {weight_map[stray[0]]}, but that shard does not hold it")
    return tensors


def shard_files(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted({info.file for info in tensors.values()})
