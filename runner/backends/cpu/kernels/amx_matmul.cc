// Float32 matmuls on Intel AMX tiles (an XLA FFI custom call; built and loaded by runner/backends/cpu/amx_matmul.py).
//
// Each float32 value is split exactly into three bfloat16 parts by truncation (hi = top 8 mantissa bits,
// mid = the next 8 of the remainder, lo = the rest, which fits), so x = xh + xm + xl and w = wh + wm + wl
// with no rounding. y = x @ w is then the six products xh*wh + xh*wm + xm*wh + xh*wl + xl*wh + xm*wm,
// each a TDPBF16PS (exact bf16 products, float32 accumulation); the dropped terms are below 2^-24 of the
// result, so the error is that of a float32 GEMM (checked against float64 in tests/test_amx_matmul.py).
// The weights come pre-split and packed in AMX's pair layout by runner/backends/cpu/amx_matmul.py::pack_kernel, once per
// weight update: [N/16, K/32, 3 parts, 16 pair-rows, 16 columns, 2].
//
// One output tile (16 rows x 16 columns) is always summed over k in the same order, whatever the row
// count or thread count, so a row's result does not depend on the other rows of the step.
//
// Packed with one part (bfloat16 weights of a bfloat16 model, whose activations are bfloat16 values too),
// y is the single product xh*wh: exact bfloat16 products summed in float32, a third of the weight bytes.
// AmxMatmulBf16 takes such a model's bfloat16 x as it is and stores y rounded to bfloat16 (as XLA's
// convert rounds), so no convert passes run around the call.
//
//   AmxMatmul:     y[M, N] = x[M, K] @ w[K, N]   (w given packed with 3 or 1 parts; K % 32 == 0, N % 16 == 0, any M)
//   AmxMatmulBf16: the same with x and y bfloat16 and w packed with 1 part
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include "bf16_round.h"
#include "pool_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BW__)
#define JAX_ROLLOUT_NO_AMX 1
#endif

namespace {

constexpr int kGroupTiles = 4;          // row tiles per pass (C tiles 0..3; A in 4; B parts in 5, 6, 7)
constexpr int kGroupRows = 16 * kGroupTiles;
constexpr int kTileElems = 512;         // bf16 values per 16 x 64-byte tile
constexpr int kPrefetchBlocks = 4;      // k-blocks of packed weights prefetched ahead (into L2)

#ifndef JAX_ROLLOUT_NO_AMX
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  alignas(64) TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// x rows [r0, r0 + 64) split into `parts` parts (3, or 1: the top bfloat16 bits only), tile-contiguous:
// [part][row tile][k block][16 rows][32 k]. Rows past M are zero.
void split_rows(const float* x, int64_t M, int64_t K, int64_t r0, uint16_t* out, int parts) {
  const int64_t kb_count = K / 32, part_stride = int64_t{kGroupTiles} * kb_count * kTileElems;
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < kGroupRows; ++r) {
    for (int64_t k = 0; k < K; k += 16) {
      const int64_t off = ((r / 16) * kb_count + k / 32) * kTileElems + (r % 16) * 32 + k % 32;
      if (r0 + r >= M) {
        for (int p = 0; p < parts; ++p) std::memset(out + p * part_stride + off, 0, 32);
        continue;
      }
      const __m512 v = _mm512_loadu_ps(x + (r0 + r) * K + k);
      const __m512i h = _mm512_and_si512(_mm512_castps_si512(v), mask);
      if (parts == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + off), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
        continue;
      }
      const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(h));
      const __m512i m = _mm512_and_si512(_mm512_castps_si512(rest), mask);
      const __m512i l = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(m)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + off), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + part_stride + off),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(m, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * part_stride + off),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16)));
    }
  }
}

// bfloat16 x rows [r0, r0 + 64) in the same tile-contiguous layout (one part); rows past M are zero.
void copy_rows(const uint16_t* x, int64_t M, int64_t K, int64_t r0, uint16_t* out) {
  const int64_t kb_count = K / 32;
  for (int64_t r = 0; r < kGroupRows; ++r) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      uint16_t* dst = out + ((r / 16) * kb_count + kb) * kTileElems + (r % 16) * 32;
      if (r0 + r >= M)
        std::memset(dst, 0, 64);
      else
        std::memcpy(dst, x + (r0 + r) * K + kb * 32, 64);
    }
  }
}

// Output columns [16 nb, 16 nb + 16) of the row group whose split x is `xs`: C tiles 0..3 accumulate the
// six products over every k block in order, then go to y (rows past M through a scratch tile).
template <int Parts, class Out>
void column_block(const uint16_t* xs, const uint16_t* wp, Out* y, int64_t M, int64_t K, int64_t N,
                  int64_t r0, int64_t nb) {
  const int64_t kb_count = K / 32, part_stride = int64_t{kGroupTiles} * kb_count * kTileElems;
  const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, (M - r0 + 15) / 16));
  const uint16_t* wb = wp + nb * kb_count * Parts * kTileElems;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int kLines = Parts * kTileElems * 2 / 64;  // cache lines of one k block's packed weights
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* b = wb + kb * Parts * kTileElems;
    // The next blocks' weights go to L2 a few lines at a time between the tile products: issued in
    // one burst they measured ~12% slower (docs/engineering-notes.md).
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchBlocks * Parts * kTileElems);
    int line = 0;
    auto prefetch = [&](int n) {
      for (int i = 0; i < n && line < kLines; ++i, ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    };
#define JR_A(part, tile) (xs + (part) * part_stride + ((tile) * kb_count + kb) * kTileElems)
    if constexpr (Parts == 1) {  // bfloat16 weights and activations: the one exact product
      _tile_loadd(5, b, 64);
#define JR_1(T) if (tiles > T) { prefetch(2); _tile_loadd(4, JR_A(0, T), 64); _tile_dpbf16ps(T, 4, 5); }
      JR_1(0) JR_1(1) JR_1(2) JR_1(3)
#undef JR_1
      prefetch(kLines);
      continue;
    }
    _tile_loadd(5, b, 64);                   // wh
    _tile_loadd(6, b + kTileElems, 64);      // wm
    _tile_loadd(7, b + 2 * kTileElems, 64);  // wl
#define JR_H(T) if (tiles > T) { prefetch(4); _tile_loadd(4, JR_A(0, T), 64); \
      _tile_dpbf16ps(T, 4, 5); _tile_dpbf16ps(T, 4, 6); _tile_dpbf16ps(T, 4, 7); }
    JR_H(0) JR_H(1) JR_H(2) JR_H(3)  // xh*wh, xh*wm, xh*wl
#define JR_M(T) if (tiles > T) { prefetch(4); _tile_loadd(4, JR_A(1, T), 64); _tile_dpbf16ps(T, 4, 5); _tile_dpbf16ps(T, 4, 6); }
    JR_M(0) JR_M(1) JR_M(2) JR_M(3)  // xm*wh, xm*wm
#define JR_L(T) if (tiles > T) { prefetch(4); _tile_loadd(4, JR_A(2, T), 64); _tile_dpbf16ps(T, 4, 5); }
    JR_L(0) JR_L(1) JR_L(2) JR_L(3)  // xl*wh
    prefetch(kLines);
#undef JR_A
#undef JR_H
#undef JR_M
#undef JR_L
  }
  alignas(64) float scratch[16 * 16];
#define JR_STORE(T)                                                                              \
  if (tiles > T) {                                                                               \
    const int64_t row = r0 + 16 * T, valid = std::min<int64_t>(16, M - row);                     \
    if constexpr (std::is_same_v<Out, uint16_t>) {                                               \
      _tile_stored(T, scratch, 64);                                                              \
      for (int64_t i = 0; i < valid; ++i) jax_rollout::store_bf16_rounded(y + (row + i) * N + nb * 16, _mm512_loadu_ps(scratch + i * 16)); \
    } else if (valid == 16) {                                                                    \
      _tile_stored(T, y + row * N + nb * 16, N * 4);                                             \
    } else {                                                                                     \
      _tile_stored(T, scratch, 64);                                                              \
      for (int64_t i = 0; i < valid; ++i) std::memcpy(y + (row + i) * N + nb * 16, scratch + i * 16, 64); \
    }                                                                                            \
  }
  JR_STORE(0) JR_STORE(1) JR_STORE(2) JR_STORE(3)
#undef JR_STORE
}

// AMX tile state on a thread for as long as it works on items (pool_items.h's per-thread scope).
struct AmxTiles {
  AmxTiles() { configure_tiles(); }
  ~AmxTiles() { _tile_release(); }
};
#endif  // JAX_ROLLOUT_NO_AMX

// In = float (AmxMatmul: split into parts here) or uint16_t (AmxMatmulBf16: bfloat16 bits, one part);
// Out the same way.
template <class In, class Out, class XBuffer, class YBuffer>
ffi::Error AmxMatmulImpl(ffi::ThreadPool pool, XBuffer x, ffi::Buffer<ffi::U16> packed, YBuffer y) {
#ifdef JAX_ROLLOUT_NO_AMX
  return ffi::Error::Internal("amx_matmul: built without AMX");
#else
  const auto xd = x.dimensions();
  const auto pd = packed.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 6 || yd.size() != 2)
    return ffi::Error::InvalidArgument("amx_matmul: x must be [M, K], packed [N/16, K/32, 3, 16, 16, 2]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int parts = static_cast<int>(pd[2]);
  if (pd[0] * 16 != N || pd[1] * 32 != K || (parts != 3 && parts != 1) || pd[3] != 16 || pd[4] != 16 || pd[5] != 2 ||
      yd[0] != M || (std::is_same_v<In, uint16_t> && parts != 1))
    return ffi::Error::InvalidArgument("amx_matmul: packed weights do not match x [M, K] and y [M, N]");
  if (M == 0) return ffi::Error::Success();
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
  const int64_t group_elems = parts * int64_t{kGroupTiles} * (K / 32) * kTileElems;
  const size_t bytes = (groups * group_elems * sizeof(uint16_t) + 63) / 64 * 64;
  std::unique_ptr<uint16_t, decltype(&std::free)> xs(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)), &std::free);
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (std::is_same_v<In, uint16_t>)
      copy_rows(reinterpret_cast<const uint16_t*>(x.typed_data()), M, K, g * kGroupRows, xs.get() + g * group_elems);
    else
      split_rows(x.typed_data(), M, K, g * kGroupRows, xs.get() + g * group_elems, parts);
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t num_blocks = N / 16;
  const int64_t per_group = std::max<int64_t>(1, 2 * threads / groups);  // ~2 items per thread in all
  const int64_t chunk = std::max<int64_t>(1, (num_blocks + per_group - 1) / per_group);
  const int64_t chunks_per_group = (num_blocks + chunk - 1) / chunk;
  const uint16_t* xsp = xs.get();
  const uint16_t* wp = packed.typed_data();
  Out* yp = reinterpret_cast<Out*>(y->typed_data());
  // items (row group, chunk of column blocks) over the pool (pool_items.h)
  jax_rollout::run_items<AmxTiles>(pool, groups * chunks_per_group, threads, [=](int64_t i) {
    const int64_t g = i / chunks_per_group, c = i % chunks_per_group;
    for (int64_t nb = c * chunk; nb < std::min(num_blocks, (c + 1) * chunk); ++nb) {
      if (parts == 1)
        column_block<1, Out>(xsp + g * group_elems, wp, yp, M, K, N, g * kGroupRows, nb);
      else
        column_block<3, Out>(xsp + g * group_elems, wp, yp, M, K, N, g * kGroupRows, nb);
    }
  });
  return ffi::Error::Success();
#endif
}

ffi::Error AmxMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> packed,
                        ffi::ResultBuffer<ffi::F32> y) {
  return AmxMatmulImpl<float, float>(pool, x, packed, y);
}

ffi::Error AmxMatmulBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> packed,
                             ffi::ResultBuffer<ffi::BF16> y) {
  return AmxMatmulImpl<uint16_t, uint16_t>(pool, x, packed, y);
}

}  // namespace

// Asks Linux for permission to use AMX tile data in this process (all threads); 0 on success, -2 when
// the compiler did not target AMX (the handler would fail every call).
extern "C" int jax_rollout_amx_enable() {
#ifdef JAX_ROLLOUT_NO_AMX
  return -2;
#else
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return static_cast<int>(syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata));
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxMatmul, AmxMatmulF32,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxMatmulBf16, AmxMatmulBf16Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>().Ret<ffi::Buffer<ffi::BF16>>());
