"""Safetensors files through the `safetensors` library (lazy per-tensor reads, bf16 via ml_dtypes,
no torch), with our checks: unreadable headers, unsupported dtypes, a tensor in two shards.

Sharded checkpoints are read through `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file as _save_numpy

# safetensors' numpy backend writes F8_E4M3 from ml_dtypes arrays but reads it back as
# `numpy.float8_e4m3fn`, which numpy lacks: name ml_dtypes' type there (ModelOpt FP8 / NVFP4
# scales), only if nobody has.
if not hasattr(np, "float8_e4m3fn"):
  np.float8_e4m3fn = ml_dtypes.float8_e4m3fn

# What numpy can hold (with ml_dtypes: bf16, and e4m3 for quantized checkpoints).
SUPPORTED = ("F64", "F32", "F16", "BF16", "F8_E4M3", "I64", "I32", "I16", "I8", "U8", "BOOL")


class SafetensorsError(ValueError):
  pass


def _open(path: str):
  try:
    return safe_open(path, framework="np")
  except (SafetensorError, OSError) as e:
    raise SafetensorsError(f"{path}: unreadable safetensors file, truncated or corrupt header "
                           f"({e})") from None


def tensor_names(path: str) -> list[str]:
  """Names of the tensors in one file (header only); checks every dtype is supported."""
  with _open(path) as f:
    names = list(f.keys())
    for name in names:
      dtype = f.get_slice(name).get_dtype()
      if dtype not in SUPPORTED:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype}; "
                               f"supported: {list(SUPPORTED)}")
  return names


class TensorFiles(Mapping):
  """Lazy name -> numpy array over one or more safetensors files: a tensor is read when it is
  accessed, so converting a large checkpoint never holds all of it twice."""

  def __init__(self, paths):
    self._where = {}
    for path in paths:
      for name in tensor_names(path):
        if name in self._where:
          raise SafetensorsError(f"tensor {name!r} is in both {self._where[name]} and {path}")
        self._where[name] = path

  def __getitem__(self, name: str) -> np.ndarray:
    path = self._where[name]
    with _open(path) as f:
      try:
        return f.get_tensor(name)
      except SafetensorError as e:
        raise SafetensorsError(f"{path}: tensor {name!r}: {e}") from None

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


def load_file(path: str) -> TensorFiles:
  """The tensors of one file (lazy, see `TensorFiles`)."""
  return TensorFiles([path])


def load_folder(folder: str) -> TensorFiles:
  """Tensors of a HF folder: one `model.safetensors`, or shards listed in the index."""
  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
  if not files:
    raise SafetensorsError(f"no .safetensors files in {folder}")
  return TensorFiles([os.path.join(folder, name) for name in files])


def save_file(tensors: Mapping[str, np.ndarray], path: str,
              metadata: Mapping[str, str] | None = None) -> None:
  """Writes tensors atomically (temp file + rename)."""
  # (np.asarray, not ascontiguousarray: a scalar stays 0-d, as ModelOpt's scales are.)
  arrays = {name: np.asarray(a, order="C") for name, a in tensors.items()}
  tmp = path + ".tmp"
  try:
    _save_numpy(arrays, tmp, metadata=dict(metadata) if metadata else None)
  except (SafetensorError, ValueError, TypeError) as e:
    raise SafetensorsError(f"{path}: cannot write safetensors ({e})") from None
  os.replace(tmp, path)
