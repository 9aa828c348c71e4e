"""`GGUFTensor`: a 2-D GGUF weight that de-quantizes only the rows a reader slices.

GGUF quantization blocks run along a row (the `in` axis of a PyTorch `[out, in]` weight), and
`GGUFReader` exposes a quantized tensor as a memory-mapped `[out, row_bytes]` uint8 array, so any set
of rows de-quantizes on its own. A sharded load (`jax.make_array_from_callback`) asks each device's
slice: only those rows are read and converted, a chunk of rows at a time, and no float32 copy of
the whole tensor ever exists on the host. `np.asarray(t)` de-quantizes all of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_CHUNK = 1024  # rows de-quantized at once when a slice keeps only some columns

Index = int | slice | np.ndarray


class GGUFTensor:
    """A lazily de-quantized `[out, in]` float32 weight (or its transpose, `.T`).

    data: the reader's memory-mapped `[out, row_bytes]` (quantized) or `[out, in]` (F32/F16) array.
    row_order: stored row of each output row (llama.cpp's Q/K permutation undone), or None.
    """

    def __init__(self, data: np.ndarray, qtype: Any, shape: tuple[int, int], row_order: np.ndarray | None = None,
                 transposed: bool = False) -> None:
        self.data, self.qtype, self.row_order, self.transposed = data, qtype, row_order, transposed
        self._shape = shape  # untransposed [out, in]

    @property
    def shape(self) -> tuple[int, int]:
        return (self._shape[1], self._shape[0]) if self.transposed else self._shape

    dtype = np.dtype(np.float32)
    ndim = 2

    @property
    def size(self) -> int:
        return self._shape[0] * self._shape[1]

    @property
    def T(self) -> GGUFTensor:  # noqa: N802 (numpy's name)
        return GGUFTensor(self.data, self.qtype, self._shape, self.row_order, not self.transposed)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a GGUFTensor is de-quantized on access: it cannot be viewed without a copy")
        full = self._rows(np.arange(self._shape[0]), slice(None))
        full = full.T if self.transposed else full
        return full if dtype is None else full.astype(dtype, copy=False)

    def __getitem__(self, index: Index | tuple[Index, ...]) -> np.ndarray:
        parts = index if isinstance(index, tuple) else (index,)
        simple = (len(parts) <= 2 and sum(isinstance(p, np.ndarray) for p in parts) <= 1
                  and all((isinstance(p, (int, np.integer, slice)) and not isinstance(p, bool))
                          or (isinstance(p, np.ndarray) and p.ndim == 1 and p.dtype.kind in "iub") for p in parts))
        if not simple:  # anything else (Ellipsis, None, paired or 2-D index arrays): the plain way
            return np.asarray(self)[index]
        parts = parts + (slice(None),) * (2 - len(parts))
        row_sel, col_sel = (parts[1], parts[0]) if self.transposed else parts
        rows = np.arange(self._shape[0])[row_sel]
        out = self._rows(np.atleast_1d(rows), col_sel)
        if np.ndim(rows) == 0:
            out = out[0]
        return out.T if self.transposed and out.ndim == 2 else out

    def _rows(self, rows: np.ndarray, col_sel: Index) -> np.ndarray:
        """Output rows `rows` (then columns `col_sel`), de-quantized `ROW_CHUNK` rows at a time."""
        from gguf.quants import dequantize

        stored = rows if self.row_order is None else self.row_order[rows]
        pieces = [np.zeros((0, self._shape[1]), np.float32)[:, col_sel]]
        for start in range(0, len(stored), ROW_CHUNK):
            chunk = stored[start:start + ROW_CHUNK]
            contiguous = bool(np.all(np.diff(chunk) == 1))
            raw = self.data[chunk[0]:chunk[-1] + 1] if contiguous else self.data[chunk]  # a slice stays a memmap view
            values = np.asarray(dequantize(raw, self.qtype), dtype=np.float32).reshape(len(chunk), self._shape[1])
            pieces.append(values[:, col_sel])
        return np.concatenate(pieces, axis=0)
