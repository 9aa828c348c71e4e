"""A fast reader of a `.gguf` file's metadata and tensor table (little-endian GGUF v2/v3).

`gguf.GGUFReader` builds a numpy view per part of every metadata field; for a tokenizer's ~100k
strings (SmolLM2's tokens and merges) that took ~3.7 s, once for the checkpoint and once for the
tokenizer, a quarter of a warm engine start. This reader walks the metadata with `struct` over one
bytes buffer (~0.1 s) and memory-maps the tensors exactly as `GGUFReader` does: numpy shape = GGUF
dims reversed (`[out, in]`), quantized tensors as `uint8` `[rows, row_bytes]`.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file (the attributes `read_gguf` reads from `gguf.ReaderTensor`)."""

    name: str
    shape: np.ndarray  # GGUF dims, innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped, numpy shape (dims reversed; quantized: uint8 [rows, row_bytes])
    data_offset: int  # absolute, in the file
    n_bytes: int


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> value (str, int, float, bool, or a list of those)
    tensors: list[GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: GGUF metadata runs past the end of the file (truncated?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise ValueError(f"{self.path}: GGUF metadata runs past the end of the file (truncated?)")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                values = struct.unpack_from("<" + fmt[1] * count, self.buf, self.pos)
                self.pos += size * count
                return list(values)
            return [self.value(item) for _ in range(count)]  # nested arrays
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        return self.take(_SCALARS[kind])


def is_gguf(path: str) -> bool:
    """Whether `path` is meant as a GGUF file: its name ends in `.gguf` or it starts with GGUF's magic
    bytes (a damaged `.gguf` file then fails in `read_gguf_file` with what is wrong with it)."""
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf_file(path: str) -> GGUFFile:
    """The file's metadata fields and memory-mapped tensors (ValueError on a malformed file)."""
    import gguf

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    if len(buf) < 24 or buf[:4] != b"GGUF":
        truncated = buf[:4] == b"GGUF"[:len(buf[:4])]
        raise ValueError(f"{path}: GGUF file is truncated (only {len(buf)} bytes)" if truncated
                         else f"{path}: not a GGUF file")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read (little-endian v2 and v3 are)")
    num_tensors, num_fields = cur.take("<Q"), cur.take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    raw = np.memmap(path, mode="r", dtype=np.uint8)
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        np_dims = tuple(int(d) for d in reversed(dims))
        elements = int(np.prod(np_dims)) if np_dims else 1
        if qtype.name in _PLAIN:
            dtype, shape, n_bytes = _PLAIN[qtype.name], np_dims, elements * np.dtype(_PLAIN[qtype.name]).itemsize
        else:
            dtype, shape = np.uint8, (*np_dims[:-1], np_dims[-1] // block * type_size)
            n_bytes = elements * type_size // block
        begin = start + offset
        if begin + n_bytes > len(raw):
            raise ValueError(f"{path}: GGUF file is truncated (tensor {name!r} extends past end of file)")
        data = raw[begin:begin + n_bytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensorInfo(name, np.asarray(dims, np.uint64), qtype, data, begin, n_bytes))
    return GGUFFile(fields, tensors)
