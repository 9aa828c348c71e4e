"""Reading PyTorch `pytorch_model.bin` weight files without PyTorch (many released checkpoints,
among them the authors' EAGLE-3 heads, ship only in this format).

`torch.save` (torch >= 1.6) writes a zip archive: `<name>/data.pkl`, a pickle of the state dict in
which every tensor is a call to `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`
and every storage a persistent id `("storage", <dtype>Storage, key, location, numel)` whose bytes
are the stored (uncompressed) zip member `<name>/data/<key>`, little-endian. Contiguous tensors
come back memory-mapped (nothing is read until sliced, as for safetensors); strided views are copied.

A pickle can name any Python callable, so loading one is running code. The unpickler here resolves
only the handful of globals a state dict needs (the rebuild functions, the storage types,
`OrderedDict`) to local stand-ins and refuses every other name: loading never imports or calls
anything from the file.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import struct
import zipfile
from typing import Any

import numpy as np

# torch storage class -> dtype name (numpy's, and ml_dtypes' bfloat16)
_STORAGE_DTYPES: dict[str, str] = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: str


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str
    numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor as the pickle describes it; materialised once the archive is at hand."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: _Storage, storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                       requires_grad: bool = False, backward_hooks: object = None, metadata: object = None) -> _Tensor:
    return _Tensor(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: _Tensor, requires_grad: bool = False, backward_hooks: object = None) -> _Tensor:
    return data


def _rebuild_parameter_with_state(data: _Tensor, requires_grad: bool, backward_hooks: object, state: object) -> _Tensor:
    return data


_ALLOWED_GLOBALS: dict[str, object] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "collections.OrderedDict": collections.OrderedDict,
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _StateDictUnpickler(pickle.Unpickler):
    """Resolves only the globals of a plain state dict; any other name is an error."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        key = f"{module}.{name}"
        if key in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[key]
        raise ValueError(f"{self.path}: the pickle refers to {key!r}, which a plain state dict of tensors never "
                         "needs; refusing to load it (unpickling can run code). Convert the file to safetensors.")

    def persistent_load(self, pid: object) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise ValueError(f"{self.path}: unsupported persistent id in the pickle: {pid!r}")
        _, storage_type, key, _location, numel = pid
        return _Storage(str(key), storage_type.dtype, int(numel))


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _storage_array(archive: zipfile.ZipFile, member: zipfile.ZipInfo, raw: np.ndarray, path: str,
                   dtype: np.dtype) -> np.ndarray:
    """One storage's elements: a view of the memory-mapped file `raw` when stored uncompressed (as
    `torch.save` writes them), so a sharded load reads each device's slice only; read otherwise."""
    if member.compress_type != zipfile.ZIP_STORED:
        return np.frombuffer(archive.read(member), dtype=dtype)
    header = bytes(raw[member.header_offset:member.header_offset + 30])  # local header: 30 bytes + name + extra
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"{path}: bad zip local header for {member.filename!r}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = member.header_offset + 30 + name_len + extra_len
    return raw[start:start + member.file_size].view(dtype)


def read_torch_state_dict(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (array, dtype name) for every tensor of a `torch.save`d state dict (zip format)."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip archive: the legacy (torch < 1.6) format is not supported; "
                         "re-save it with a current torch or convert it to safetensors")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
            raise ValueError(f"{path}: big-endian tensors are not supported")
        with archive.open(pickles[0]) as f:
            try:
                state = _StateDictUnpickler(f, path).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
                raise ValueError(f"{path}: cannot unpickle data.pkl (corrupt?): {type(e).__name__}: {e}") from None
        if not isinstance(state, dict):
            raise ValueError(f"{path}: the pickle holds a {type(state).__name__}, not a state dict")
        members = {info.filename: info for info in archive.infolist()}
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        buffers: dict[str, np.ndarray] = {}
        out: dict[str, tuple[np.ndarray, str]] = {}
        for name, t in state.items():
            if not isinstance(t, _Tensor):
                raise ValueError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
            dtype = _numpy_dtype(t.storage.dtype)
            if t.storage.key not in buffers:
                member = members.get(f"{prefix}data/{t.storage.key}")
                if member is None:
                    raise ValueError(f"{path}: tensor {name!r} needs storage {prefix}data/{t.storage.key}, "
                                     "missing from the archive")
                if member.file_size != t.storage.numel * dtype.itemsize:
                    raise ValueError(f"{path}: storage {member.filename!r} has {member.file_size} bytes, expected "
                                     f"{t.storage.numel} x {dtype.itemsize}")
                buffers[t.storage.key] = _storage_array(archive, member, raw, path, dtype)
            base = buffers[t.storage.key]
            extent = t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) + 1 if all(t.shape) else t.offset
            if extent > base.size:
                raise ValueError(f"{path}: tensor {name!r} reaches past its storage ({extent} > {base.size} elements)")
            contiguous = tuple(int(np.prod(t.shape[i + 1:])) for i in range(len(t.shape)))
            if all(n == 1 or s == c for n, s, c in zip(t.shape, t.stride, contiguous)):
                arr = base[t.offset:t.offset + int(np.prod(t.shape))].reshape(t.shape)  # memory-mapped, unread
            else:  # a strided view (a saved transpose or slice): copied out
                arr = np.array(np.lib.stride_tricks.as_strided(
                    base[t.offset:], shape=t.shape, strides=tuple(s * dtype.itemsize for s in t.stride)), order="C")
            out[str(name)] = (arr, t.storage.dtype)
    return out
