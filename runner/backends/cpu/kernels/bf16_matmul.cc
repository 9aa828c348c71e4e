// Bfloat16 matmuls on AVX512_BF16 dot products (an XLA FFI custom call; built and loaded by
// runner/backends/cpu/bf16_matmul.py) for CPUs without AMX, such as AMD Zen 4.
//
// VDPBF16PS adds to each of 16 float32 lanes the two exact products of a pair of bfloat16 values, so
// y = x @ w comes out as float32 sums of exact bfloat16 products (a bfloat16 matmul with float32
// accumulation, as AMX's, XLA's and PyTorch's), reading 2 bytes per weight. The weights come packed as
// runner/backends/cpu/amx_matmul.py::pack_kernel packs a bfloat16 kernel: [N/16, K/32, 1, 16, 16, 2], whose
// 16 columns x 2 k values for one k pair are the 64 bytes one instruction takes. x is bfloat16 [M, K]
// (row-major, so x[m, 2i], x[m, 2i + 1] are one 32-bit word to broadcast).
//
// Where VDPBF16PS is slow (this code's Intel Xeon VM ran it at a quarter of its FMA instruction rate, so
// half its float32 multiply-adds per second), the `dot=false` variant widens each weight vector to two
// float32 vectors (a shift and a mask) and multiplies with FMAs: the same exact products, the same 2 bytes
// per weight read. `jax_rollout_bf16_dot_speed` times both instructions so the caller can choose.
//
// A register block is kRows rows x kCols 16-column tiles (24 accumulators). Each work item is a group of
// kCols column tiles over every row: its weights (K/32 KiB per tile) stream from memory once for the
// first rows and from L2 for the next ones. Each output is summed over k in one fixed order whatever M,
// so a row's result does not depend on the other rows of the step.
//
//   Bf16Matmul:        y[M, N] = x[M, K] @ w[K, N]   (x bfloat16, y float32; K % 32 == 0, N % 16 == 0, any M;
//                      attribute dot: VDPBF16PS, else widened weights and FMAs)
//   Bf16MatmulBf16Out: the same, y rounded to bfloat16 as it is stored (a bfloat16 model's layers: no
//                      separate convert pass over y)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16_round.h"
#include "pool_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#define JAX_ROLLOUT_NO_AVX512_BF16 1
#endif

namespace {

constexpr int kRows = 6;         // rows per register block
constexpr int kCols = 4;         // 16-column tiles per register block and per work item
constexpr int kTileElems = 512;  // packed bfloat16 values per (column tile, k block of 32)

#ifndef JAX_ROLLOUT_NO_AVX512_BF16
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

inline void store16(uint16_t* y, __m512 v) { jax_rollout::store_bf16_rounded(y, v); }

// Rows [r0, r0 + R) x column tiles [nb0, nb0 + C) of y, summed over every k block in order.
template <int R, int C, class Out>
void block(const uint32_t* x_pairs, const uint16_t* wp, Out* y, int64_t K, int64_t N, int64_t r0, int64_t nb0) {
  const int64_t kb_count = K / 32, pairs_per_row = K / 2;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* xr = x_pairs + r0 * pairs_per_row;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* wb = wp + (nb0 * kb_count + kb) * kTileElems;
    for (int i = 0; i < 16; ++i) {
      __m512bh w[C];
      for (int c = 0; c < C; ++c)
        w[c] = (__m512bh)_mm512_loadu_si512(wb + c * kb_count * kTileElems + i * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r * pairs_per_row + kb * 16 + i]));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(y + (r0 + r) * N + (nb0 + c) * 16, acc[r][c]);
}

// The same block from float32 copies of x's rows (`xf`, [M, K]) and weights widened in registers: per k
// pair, acc += x[2i + 1] w[2i + 1] then acc += x[2i] w[2i], each an FMA of an exact product.
template <int R, int C, class Out>
void block_fma(const float* xf, const uint16_t* wp, Out* y, int64_t K, int64_t N, int64_t r0, int64_t nb0) {
  const int64_t kb_count = K / 32;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* xr = xf + r0 * K;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* wb = wp + (nb0 * kb_count + kb) * kTileElems;
    for (int i = 0; i < 16; ++i) {
      __m512 w_even[C], w_odd[C];
      for (int c = 0; c < C; ++c) {
        const __m512i pairs = _mm512_loadu_si512(wb + c * kb_count * kTileElems + i * 32);
        w_even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        w_odd[c] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 a_odd = _mm512_set1_ps(xr[r * K + kb * 32 + 2 * i + 1]);
        const __m512 a_even = _mm512_set1_ps(xr[r * K + kb * 32 + 2 * i]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a_even, w_even[c], _mm512_fmadd_ps(a_odd, w_odd[c], acc[r][c]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(y + (r0 + r) * N + (nb0 + c) * 16, acc[r][c]);
}

// Rows [row_begin, row_end) of y's column tiles [nb0, nb0 + C): register blocks of kRows rows, then the rest.
template <bool Dot, int C, class Out>
void column_group(const void* xs, const uint16_t* wp, Out* y, int64_t row_begin, int64_t row_end, int64_t K,
                  int64_t N, int64_t nb0) {
  auto run = [&](auto rows, int64_t r0) {
    constexpr int R = decltype(rows)::value;
    if constexpr (Dot)
      block<R, C>(static_cast<const uint32_t*>(xs), wp, y, K, N, r0, nb0);
    else
      block_fma<R, C>(static_cast<const float*>(xs), wp, y, K, N, r0, nb0);
  };
  int64_t r0 = row_begin;
  for (; r0 + kRows <= row_end; r0 += kRows) run(std::integral_constant<int, kRows>{}, r0);
  switch (row_end - r0) {
    case 5: run(std::integral_constant<int, 5>{}, r0); break;
    case 4: run(std::integral_constant<int, 4>{}, r0); break;
    case 3: run(std::integral_constant<int, 3>{}, r0); break;
    case 2: run(std::integral_constant<int, 2>{}, r0); break;
    case 1: run(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}

template <bool Dot, class Out>
void column_group_of(int64_t tiles, const void* xs, const uint16_t* wp, Out* y, int64_t row_begin, int64_t row_end,
                     int64_t K, int64_t N, int64_t nb0) {
  switch (tiles) {
    case 4: column_group<Dot, 4>(xs, wp, y, row_begin, row_end, K, N, nb0); break;
    case 3: column_group<Dot, 3>(xs, wp, y, row_begin, row_end, K, N, nb0); break;
    case 2: column_group<Dot, 2>(xs, wp, y, row_begin, row_end, K, N, nb0); break;
    default: column_group<Dot, 1>(xs, wp, y, row_begin, row_end, K, N, nb0); break;
  }
}
#endif  // JAX_ROLLOUT_NO_AVX512_BF16

// y = x @ w with y float32 (Out = float) or rounded to bfloat16 (Out = uint16_t).
template <class Out, class YBuffer>
ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> packed, YBuffer y,
                          bool dot) {
#ifdef JAX_ROLLOUT_NO_AVX512_BF16
  return ffi::Error::Internal("bf16_matmul: built without AVX512_BF16");
#else
  const auto xd = x.dimensions();
  const auto pd = packed.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 6 || yd.size() != 2)
    return ffi::Error::InvalidArgument("bf16_matmul: x must be [M, K], packed [N/16, K/32, 1, 16, 16, 2]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (pd[0] * 16 != N || pd[1] * 32 != K || pd[2] != 1 || pd[3] != 16 || pd[4] != 16 || pd[5] != 2 || yd[0] != M)
    return ffi::Error::InvalidArgument("bf16_matmul: packed weights do not match x [M, K] and y [M, N]");
  if (M == 0) return ffi::Error::Success();
  const auto* xb = reinterpret_cast<const uint16_t*>(x.typed_data());
  // The FMA blocks broadcast x's values as float32 (exact) from a per-thread buffer kept across calls:
  // allocated per call it was an mmap and fresh page faults for every matmul of a step.
  thread_local std::vector<uint32_t> widened;
  if (!dot) {
    widened.resize(std::max<size_t>(widened.size(), static_cast<size_t>(M * K)));
    for (int64_t i = 0; i < M * K; ++i) widened[i] = uint32_t{xb[i]} << 16;
  }
  const void* xs = dot ? static_cast<const void*>(xb) : static_cast<const void*>(widened.data());
  const uint16_t* wp = packed.typed_data();
  Out* yp = reinterpret_cast<Out*>(y->typed_data());
  const int64_t num_tiles = N / 16, num_groups = (num_tiles + kCols - 1) / kCols;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Few column groups (a k/v projection has 3) leave threads idle: split the rows too, in whole register
  // blocks, until there are ~4 items per thread (each row chunk reads the group's weights once more).
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  const int64_t row_chunks = std::clamp<int64_t>((4 * threads + num_groups - 1) / num_groups, 1, row_blocks / 2 + 1);
  const int64_t chunk_rows = (row_blocks + row_chunks - 1) / row_chunks * kRows;
  const int64_t num_chunks = (M + chunk_rows - 1) / chunk_rows;
  jax_rollout::run_items(pool, num_groups * num_chunks, threads, [=](int64_t item) {
    const int64_t g = item / num_chunks, row_begin = item % num_chunks * chunk_rows;
    const int64_t row_end = std::min(M, row_begin + chunk_rows);
    const int64_t nb0 = g * kCols, tiles = std::min<int64_t>(kCols, num_tiles - nb0);
    if (dot)
      column_group_of<true>(tiles, xs, wp, yp, row_begin, row_end, K, N, nb0);
    else
      column_group_of<false>(tiles, xs, wp, yp, row_begin, row_end, K, N, nb0);
  });
  return ffi::Error::Success();
#endif
}

ffi::Error Bf16MatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> packed,
                         ffi::ResultBuffer<ffi::F32> y, bool dot) {
  return Bf16MatmulImpl<float>(pool, x, packed, y, dot);
}

ffi::Error Bf16MatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> packed,
                          ffi::ResultBuffer<ffi::BF16> y, bool dot) {
  return Bf16MatmulImpl<uint16_t>(pool, x, packed, y, dot);
}

}  // namespace

// 0 when the library was compiled with AVX512_BF16 (-march=native on a CPU that has it), -2 otherwise.
extern "C" int jax_rollout_bf16_matmul_built() {
#ifdef JAX_ROLLOUT_NO_AVX512_BF16
  return -2;
#else
  return 0;
#endif
}

// Multiply-adds per second of VDPBF16PS over those of float32 FMAs on this core (24 independent register
// accumulators each, ~2 ms per instruction): above 1 the dot-product variant computes faster.
extern "C" double jax_rollout_bf16_dot_speed() {
#ifdef JAX_ROLLOUT_NO_AVX512_BF16
  return 0.0;
#else
  constexpr int64_t kIters = 20000;
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x24002400);
  __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(1e-9f);
  auto seconds = [](auto t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  double best_dot = 1e9, best_fma = 1e9;
  for (int repeat = 0; repeat < 3; ++repeat) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t n = 0; n < kIters; ++n) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      asm volatile("" : "+v"(a));
    }
    best_dot = std::min(best_dot, seconds(t0));
    t0 = std::chrono::steady_clock::now();
    for (int64_t n = 0; n < kIters; ++n) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(fa, fb, acc[i]);
      asm volatile("" : "+v"(fa));
    }
    best_fma = std::min(best_fma, seconds(t0));
  }
  float sink = 0;
  for (int i = 0; i < 24; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  asm volatile("" : : "x"(sink));
  return (32.0 / best_dot) / (16.0 / best_fma);  // 32 multiply-adds per VDPBF16PS, 16 per FMA
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16Matmul, Bf16MatmulF32,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>().Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("dot"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulBf16Out, Bf16MatmulBf16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>().Ret<ffi::Buffer<ffi::BF16>>().Attr<bool>("dot"));
