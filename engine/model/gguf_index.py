"""What a GGUF file holds that serving needs (its architecture, its name, where each tensor lies), read once
and kept beside the converted folder.

gguf's reader parses every metadata field when it opens a file, the vocabulary's tens of thousands of strings
among them: about 3 s on every start for the default model's file, to learn a few hundred tensor offsets. The
index keeps those offsets in a small JSON file, so later starts map the blocks straight from the GGUF.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """A tensor's data as gguf's reader lays it out: `shape` and `dtype` of that array (a quantized tensor's
    rows of block bytes), `offset` its first byte in the file."""

    type: GGMLQuantizationType
    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class GGUFIndex:
    path: Path
    architecture: str | None
    name: str | None
    tensors: dict[str, GGUFTensor]

    def data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's data, mapped read-only from the file."""
        return np.memmap(self.path, dtype=np.dtype(tensor.dtype), mode="r", offset=tensor.offset, shape=tensor.shape)


def gguf_key(path: Path) -> str:
    """Names what was made from this file: another file, or this one rewritten, gets another key."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def gguf_index_file(path: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{path.stem}-{gguf_key(path)}.gguf-index.json"


def read_gguf_index(path: Path, cache_dir: Path) -> GGUFIndex:
    """The file's index, from `cache_dir` where an earlier start wrote it; else read with gguf's reader (which
    raises ValueError or OSError on a file it cannot read) and written there first."""
    cached = gguf_index_file(path, cache_dir)
    if not cached.is_file():
        reader = GGUFReader(path)
        saved = {
            "architecture": _string(reader, "general.architecture"),
            "name": _string(reader, "general.name"),
            "tensors": {
                t.name: [int(t.tensor_type), t.data_offset, list(t.data.shape), t.data.dtype.str]
                for t in reader.tensors
            },
        }
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = cached.with_name(f".{cached.name}.partial-{os.getpid()}")
        staging.write_text(json.dumps(saved))
        staging.rename(cached)
    saved = json.loads(cached.read_text())
    tensors = {
        name: GGUFTensor(GGMLQuantizationType(kind), offset, tuple(shape), dtype)
        for name, (kind, offset, shape, dtype) in saved["tensors"].items()
    }
    return GGUFIndex(path, saved["architecture"], saved["name"], tensors)


def _string(reader: GGUFReader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()
