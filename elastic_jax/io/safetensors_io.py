"""Minimal safetensors reader/writer over numpy memmaps (bf16 via ml_dtypes, no torch).

Format: u64 little-endian header size, JSON header {name: {dtype, shape, data_offsets}}, bytes.
Sharded checkpoints are read through `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
  pass


def read_header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise SafetensorsError(f"{path}: truncated safetensors file (no header)")
    n = struct.unpack("<Q", raw)[0]
    size = os.path.getsize(path)
    if n > size - 8:
      raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
    try:
      header = json.loads(f.read(n))
    except json.JSONDecodeError as e:
      raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
  header.pop("__metadata__", None)
  return header, 8 + n


def load_file(path: str) -> dict[str, np.ndarray]:
  """All tensors of one file as read-only memmapped numpy arrays."""
  header, base = read_header(path)
  size = os.path.getsize(path)
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    if info["dtype"] not in _DTYPES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    dtype = np.dtype(_DTYPES[info["dtype"]])
    start, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if base + end > size or end - start != int(np.prod(shape)) * dtype.itemsize:
      raise SafetensorsError(f"{path}: tensor {name!r} data is out of bounds or mis-sized")
    out[name] = mm[base + start: base + end].view(dtype).reshape(shape)
  return out


def load_folder(folder: str) -> dict[str, np.ndarray]:
  """Tensors of a HF folder: one `model.safetensors`, or shards listed in the index."""
  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
  if not files:
    raise SafetensorsError(f"no .safetensors files in {folder}")
  out = {}
  for name in files:
    out.update(load_file(os.path.join(folder, name)))
  return out


def save_file(tensors: Mapping[str, np.ndarray], path: str, metadata: Mapping[str, str] | None = None):
  """Writes tensors atomically (temp file + rename)."""
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise SafetensorsError(f"tensor {name!r}: unsupported dtype {a.dtype}")
    nbytes = a.nbytes
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + nbytes]}
    blobs.append(a)
    offset += nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * ((-len(raw)) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in blobs:
      f.write(a.tobytes())
  os.replace(tmp, path)


