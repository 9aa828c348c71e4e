// Few-row float32 matmuls for XLA:CPU (an XLA FFI custom call; built and loaded by runner/backends/cpu/row_matmul.py).
//
// XLA:CPU runs a 1-row dot as a single-threaded GEMV and 2..8 rows as a YNNPACK GEMM that reads the
// weights at about half the memory bandwidth, so a B=1 verification step (k + 1 rows) cost ~1.7x a
// decode step. These kernels stream the weights once for all rows on all the pool's threads; past 8
// rows (RowMatmul, up to 64) groups of rows take turns on each copied panel of a block of it.
// Each output is summed in the same order whatever the row count, so row r of an M-row product is
// bitwise the 1-row product of row r (a verification step rounds exactly as plain decoding).
//
//   RowMatmul:   y[M, N] = x[M, K] @ w[K, N]       (Flax kernels, [in, out]; M <= 64)
//   RowMatmulNT: y[M, N] = x[M, K] @ w[N, K]^T     (a tied embedding as the output projection; M <= 8)
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "pool_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 64;        // RowMatmul; RowMatmulNT takes up to 8
constexpr int kGroupRows = 6;       // rows per register block past 8 rows: 6 x 4 accumulators + 4 weights
// Weight rows per panel past 8 rows (nn_columns_panels): a 16 KB panel stays in L1 while the row groups
// take turns on it. At 512 rows per panel (128 KB, L2) the 30 layers' matmuls took 30.8 / 47.4 ms at 32 /
// 64 rows on the Xeon, at 64 22.9 / 44.8, and 9-20 rows read in place (no panel) were 2-27% slower still.
constexpr int64_t kPanelRowBlock = 64;
constexpr int64_t kRowBlock = 8;   // weight rows read together (RowMatmul), the next block prefetched meanwhile
constexpr int kStripVectors = 4;   // 64 output columns held in registers per row (RowMatmul)
constexpr int kNtAlign = 24;       // RowMatmulNT column chunks: a multiple of every block size J
constexpr int64_t kNtAhead = 16;    // RowMatmulNT prefetches the weight row this many rows ahead
// Sized for AVX-512's 32 registers of 16 floats. Built for AVX2 (x86-64-v3) the same code ran
// 2.5-3x slower than XLA's dot, so runner/backends/cpu/row_matmul.py builds it only where AVX-512 is present.
#if !defined(__AVX512F__)
#error "row_matmul.cc is tuned for AVX-512 (see runner/backends/cpu/row_matmul.py)"
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 load_tail(const float* p, int64_t n) {  // n < 16 floats, the rest zero
  v16 v = {}; std::memcpy(&v, p, n * sizeof(float)); return v;
}
inline float hsum(v16 v) {  // a fixed tree: 16 -> 8 -> 4 -> 1
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Weight lines a strip's k loop prefetches (into L2) as it goes: row r of `base` (`ld` floats apart,
// a strip's 64 floats each) on every `every`-th iteration, r = 0 .. rows - 1; no base: none.
struct Prefetch {
  const float* base = nullptr;
  int64_t ld = 0;
  int every = 1;
  int64_t rows = 0;
};

// One strip of 64 columns starting at n, rows [0, M) of y (+)= x[:, k0:k1] @ w[k0:k1]: the strip's
// accumulators live in registers; `first`: y holds nothing yet. Each output sums its terms in k order.
// `ws` points at w[k0, n] and steps `ldw` floats per weight row.
template <int M>
inline void nn_strip(const float* __restrict x, const float* __restrict ws, int64_t ldw, float* __restrict y,
                     int64_t K, int64_t N, int64_t n, int64_t k0, int64_t k1, bool first, Prefetch pf = {}) {
  v16 acc[M][kStripVectors];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kStripVectors; ++u) acc[m][u] = first ? v16{} : load(y + m * N + n + 16 * u);
  int phase = 0;
  int64_t fetched = 0;
  for (int64_t k = k0; k < k1; ++k) {
    v16 wv[kStripVectors];
    const float* wk = ws + (k - k0) * ldw;
    const float* pk = pf.base != nullptr && phase == 0 && fetched < pf.rows ? pf.base + fetched++ * pf.ld : nullptr;
    if (++phase == pf.every) phase = 0;
    for (int u = 0; u < kStripVectors; ++u) {
      if (pk != nullptr) __builtin_prefetch(pk + 16 * u, 0, 2);
      wv[u] = load(wk + 16 * u);
    }
    for (int m = 0; m < M; ++m) {
      const float xs = x[m * K + k];
      for (int u = 0; u < kStripVectors; ++u) acc[m][u] += xs * wv[u];  // one FMA (-ffp-contract=fast)
    }
  }
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kStripVectors; ++u) store(y + m * N + n + 16 * u, acc[m][u]);
}

// Columns past the last whole strip, one at a time.
inline void nn_tail(int rows, const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n,
                    int64_t n1, int64_t k0, int64_t k1, bool first) {
  for (; n < n1; ++n)
    for (int m = 0; m < rows; ++m) {
      float acc = first ? 0.f : y[m * N + n];
      for (int64_t k = k0; k < k1; ++k) acc = __builtin_fmaf(x[m * K + k], w[k * N + n], acc);
      y[m * N + n] = acc;
    }
}

// Columns [n0, n1) of y = x[:, kb:ke] @ w[kb:ke], w [K, N], for M <= 8 rows (bandwidth-bound): all rows
// share each pass over a block of weight rows; y holds the partial sums between blocks. The software
// prefetch of the next block is what keeps 4-8 rows at the memory bandwidth of one: without it the
// model's matmuls took 1.4x / 1.8x longer at 4 / 8 rows than at 1 (docs/engineering-notes.md).
template <int M>
void nn_columns(const float* __restrict x, const float* __restrict w, float* __restrict y,
                int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t kb, int64_t ke) {
  constexpr int64_t strip = 16 * kStripVectors;
  for (int64_t k0 = kb; k0 < ke; k0 += kRowBlock) {
    const int64_t k1 = std::min(ke, k0 + kRowBlock);
    const bool more = k1 + kRowBlock <= K;  // prefetch the same strip of the next block of rows
    int64_t n = n0;
    for (; n + strip <= n1; n += strip) {
      const float* ws = w + k0 * N + n;
      nn_strip<M>(x, ws, N, y, K, N, n, k0, k1, k0 == kb, {more ? ws + kRowBlock * N : nullptr, N, 1, k1 - k0});
    }
    nn_tail(M, x, w, y, K, N, n, n1, k0, k1, k0 == kb);
  }
}

// nn_strip for a group of 1..kGroupRows rows.
inline void nn_strip_group(int m, const float* x, const float* ws, int64_t ldw, float* y, int64_t K, int64_t N,
                           int64_t n, int64_t k0, int64_t k1, bool first, Prefetch pf) {
  switch (m) {
    case 1: return nn_strip<1>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
    case 2: return nn_strip<2>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
    case 3: return nn_strip<3>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
    case 4: return nn_strip<4>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
    case 5: return nn_strip<5>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
    default: return nn_strip<kGroupRows>(x, ws, ldw, y, K, N, n, k0, k1, first, pf);
  }
}

// The same for 9..64 rows: each strip of a block of kPanelRowBlock weight rows is copied into a
// contiguous panel (on the stack; reading the strip in place, N floats per row apart, measured ~1.2x
// slower at 64 rows), then groups of kGroupRows rows take turns on it, each
// prefetching its share of the next panel's strip between its own loads (without: 1.38 / 1.15 / 1.07x
// the time at 24 / 32 / 64 rows).
void nn_columns_panels(int rows, const float* __restrict x, const float* __restrict w, float* __restrict y,
                       int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t kb, int64_t ke) {
  constexpr int64_t strip = 16 * kStripVectors;
  alignas(64) float panel[kPanelRowBlock * strip];
  const int groups = (rows + kGroupRows - 1) / kGroupRows;
  for (int64_t k0 = kb; k0 < ke; k0 += kPanelRowBlock) {
    const int64_t k1 = std::min(ke, k0 + kPanelRowBlock);
    const bool first = k0 == kb;
    int64_t n = n0;
    for (; n + strip <= n1; n += strip) {
      for (int64_t k = k0; k < k1; ++k) std::memcpy(panel + (k - k0) * strip, w + k * N + n, strip * sizeof(float));
      // the next panel: the next strip of these weight rows, after the last one the next block's first
      const bool last = n + 2 * strip > n1;
      const int64_t next_k0 = last ? k1 : k0, next_k1 = last ? std::min(ke, k1 + kPanelRowBlock) : k1;
      const float* next = w + next_k0 * N + (last ? n0 : n + strip);
      const int64_t share = (next_k1 - next_k0 + groups - 1) / groups;  // its weight rows per group
      for (int m0 = 0, g = 0; m0 < rows; m0 += kGroupRows, ++g) {
        const int64_t own = std::clamp<int64_t>(next_k1 - next_k0 - g * share, 0, share);
        const Prefetch pf{next + g * share * N, N, static_cast<int>(std::max<int64_t>(1, (k1 - k0) / std::max<int64_t>(1, own))), own};
        nn_strip_group(std::min(kGroupRows, rows - m0), x + m0 * K, panel, strip, y + m0 * N, K, N, n, k0, k1, first, pf);
      }
    }
    nn_tail(rows, x, w, y, K, N, n, n1, k0, k1, first);
  }
}

// Rows [n, n + J) of w dotted with the M rows of x: y[m, n + j] for a block of J contiguous weight rows.
// Each output sums its 16-float chunks in k order, then a fixed hsum: the same for every M and J.
template <int M, int J>
inline void nt_block(const float* __restrict x, const float* __restrict w, float* __restrict y,
                     int64_t K, int64_t N, int64_t n) {
  v16 acc[M][J] = {};
  const int64_t full = K / 16 * 16;
  const int64_t ahead = n + J + kNtAhead <= N ? kNtAhead * K : 0;
  for (int64_t k = 0; k < full; k += 16) {
    v16 wv[J];
    for (int j = 0; j < J; ++j) {
      if (ahead > 0) __builtin_prefetch(w + (n + j) * K + k + ahead, 0, 2);  // into L2
      wv[j] = load(w + (n + j) * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const v16 xv = load(x + m * K + k);
      for (int j = 0; j < J; ++j) acc[m][j] += xv * wv[j];
    }
  }
  if (full < K) {
    v16 wv[J];
    for (int j = 0; j < J; ++j) wv[j] = load_tail(w + (n + j) * K + full, K - full);
    for (int m = 0; m < M; ++m) {
      const v16 xv = load_tail(x + m * K + full, K - full);
      for (int j = 0; j < J; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) y[m * N + n + j] = hsum(acc[m][j]);
}

// Columns [n0, n1) of y = x @ w^T, w [N, K]: dot products over contiguous weight rows, as many weight
// rows per block as AVX-512's 32 registers hold accumulators for (M * J + J + 1 <= 32). Prefetching the
// rows kNtAhead further on took the tied LM head of SmolLM2 from 4.3 / 6.5 / 8.1 ms to 3.9 / 4.5 / 5.1 ms
// at 1 / 4 / 8 rows (the memory bandwidth at every row count; docs/engineering-notes.md).
template <int M>
void nt_columns(const float* __restrict x, const float* __restrict w, float* __restrict y,
                int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int J = M <= 2 ? 8 : M <= 6 ? 4 : 3;
  int64_t n = n0;
  for (; n + J <= n1; n += J) nt_block<M, J>(x, w, y, K, N, n);
  for (; n < n1; ++n) nt_block<M, 1>(x, w, y, K, N, n);
}

template <bool NT, int M>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1,
           int64_t kb, int64_t ke) {
  if constexpr (NT) nt_columns<M>(x, w, y, K, N, n0, n1); else nn_columns<M>(x, w, y, K, N, n0, n1, kb, ke);
}

template <bool NT>
void run_block(int rows, const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1,
               int64_t kb, int64_t ke) {
  if constexpr (!NT)
    if (rows > 8) return nn_columns_panels(rows, x, w, y, K, N, n0, n1, kb, ke);
  switch (rows) {
    case 1: return block<NT, 1>(x, w, y, K, N, n0, n1, kb, ke);
    case 2: return block<NT, 2>(x, w, y, K, N, n0, n1, kb, ke);
    case 3: return block<NT, 3>(x, w, y, K, N, n0, n1, kb, ke);
    case 4: return block<NT, 4>(x, w, y, K, N, n0, n1, kb, ke);
    case 5: return block<NT, 5>(x, w, y, K, N, n0, n1, kb, ke);
    case 6: return block<NT, 6>(x, w, y, K, N, n0, n1, kb, ke);
    case 7: return block<NT, 7>(x, w, y, K, N, n0, n1, kb, ke);
    default: return block<NT, 8>(x, w, y, K, N, n0, n1, kb, ke);
  }
}

// Chunks go out over the pool (pool_items.h). RowMatmul splits the weight rows (K): each chunk streams
// one contiguous part of w into its own partial sums (chunk 0 into y), added in chunk order afterwards;
// at 4 and 8 rows this ran the model's matmuls in 24 / 31-34 ms where column chunks took 32 / 43
// (docs/engineering-notes.md). RowMatmulNT splits the output columns (w's rows).
ffi::Error run(bool nt, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
               ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("row_matmul: x and w must be 2-D");
  const int64_t rows = xd[0], K = xd[1], N = nt ? wd[0] : wd[1];
  if (rows < 1 || rows > (nt ? 8 : kMaxRows) || (nt ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("row_matmul: x must be [1..64, K] and w [K, N] (NT: [1..8, K] and [N, K])");
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* out = y->typed_data();
  const int r = static_cast<int>(rows);
  if (nt) {  // ~4 column chunks per thread
    const int64_t per_chunk = (N + 4 * threads - 1) / (4 * threads);
    const int64_t chunk = std::max<int64_t>(256, (per_chunk + kNtAlign - 1) / kNtAlign * kNtAlign);
    jax_rollout::run_items(pool, (N + chunk - 1) / chunk, threads, [=](int64_t c) {
      run_block<true>(r, xp, wp, out, K, N, c * chunk, std::min(N, (c + 1) * chunk), 0, K);
    });
    return ffi::Error::Success();
  }
  // one contiguous part of the weight rows per thread
  const int64_t per_chunk = (K + threads - 1) / threads;
  const int64_t chunk = (per_chunk + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t num_chunks = (K + chunk - 1) / chunk;
  std::unique_ptr<float[]> partial(new float[(num_chunks - 1) * rows * N]);  // [num_chunks - 1, rows, N]
  float* part = partial.get();
  jax_rollout::run_items(pool, num_chunks, threads, [=](int64_t c) {
    run_block<false>(r, xp, wp, c == 0 ? out : part + (c - 1) * rows * N, K, N, 0, N, c * chunk,
                     std::min(K, (c + 1) * chunk));
  });
  for (int64_t c = 1; c < num_chunks; ++c) {  // the partial sums, in chunk order
    const float* pc = part + (c - 1) * rows * N;
    for (int64_t i = 0; i < rows * N; ++i) out[i] += pc[i];
  }
  return ffi::Error::Success();
}

ffi::Error RowMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  return run(false, pool, x, w, y);
}

ffi::Error RowMatmulNTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  return run(true, pool, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowMatmul, RowMatmulImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RowMatmulNT, RowMatmulNTImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
