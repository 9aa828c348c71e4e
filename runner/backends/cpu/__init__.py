"""The CPU backend (`backend.py`) and its C++ XLA FFI kernels (`kernels/`, built on first use by
`kernel_build.py`): few-row matmuls, AMX matmuls, paged attention. Imported only when an engine
chooses the CPU backend."""
