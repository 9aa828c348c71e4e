// Paged attention of a few query rows per sequence (decode and verification steps) for XLA:CPU
// (an XLA FFI custom call; built and loaded by runner/backends/cpu/attention.py).
//
// The pure-JAX reference (runner/attention.py) walks each sequence's pages in a `lax.while_loop`
// whose iterations cost more in thunk dispatch than in arithmetic at these sizes, on one thread.
// Here every (sequence, KV head) pair is one work item on XLA's intra-op pool; a pair walks its
// pages 16 keys at a time with an online softmax, all its query rows sharing each tile of K and V
// while it is in L1. A query row's result depends only on its own position and context, never on
// which other rows share the step (a verification row is bitwise the decode row at that position).
//
//   out[t, h * G + g, :] = softmax_k(scale * q[t, h * G + g, :] . K[h, key, :]) @ V[h, key, :]
//   over the keys of t's sequence at positions <= t's position (kv_len - q_len + index in sequence).
//
// Two cache types: float32 (`PagedAttention`) and bfloat16 stored as its uint16 bits (`PagedAttentionBf16`,
// the CPU backend's bfloat16 cache): each K/V element widens exactly to float32 (its bits shifted up 16),
// once per tile into a buffer that all of an item's query rows read, so a bfloat16 cache costs half the
// memory traffic and the same float32 arithmetic.
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "pool_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if !defined(__AVX512F__)
#error "paged_attention.cc is tuned for AVX-512 (see runner/backends/cpu/attention.py)"
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int kTile = 16;                     // keys per tile: one vector of scores
constexpr float kMask = -0.7f * FLT_MAX;      // as runner.attention.MASK_VALUE
constexpr int64_t kSerialRowKeys = 1 << 12;  // below this many (query row x key) pairs, one thread

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }
inline v16 load_tail(const float* p, int64_t n) {  // n < 16 floats, the rest zero (a masked load, no memcpy call)
  return reinterpret_cast<v16>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
}

typedef uint16_t h16 __attribute__((vector_size(32)));
inline v16 widen(h16 h) {  // bfloat16 bits -> float32, exactly
  const i16 bits = __builtin_convertvector(h, i16) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof v); return v;
}
inline v16 load(const uint16_t* p) { h16 h; std::memcpy(&h, p, sizeof h); return widen(h); }
inline v16 load_tail(const uint16_t* p, int64_t n) {
  return widen(reinterpret_cast<h16>(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p)));
}

inline float hsum(v16 v) {  // a fixed tree: 16 -> 8 -> 4 -> 1
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(v16 v) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v)); }  // a shuffle tree

// Lane t of the result = the sum of the lanes of p[t] (16 horizontal sums at once, a fixed tree).
inline v16 reduce16(const v16* p) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i] = [p[2i] folded to 8 lanes, p[2i+1] folded to 8 lanes]
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes per input row: [r0, r2, r1, r3] of this quad
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes per input row
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  v16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
          __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // d's lanes hold rows 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15 (bit-reversed order)
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// exp(x) with Cephes' single-precision polynomial (~1 ulp); x below -87.3 gives 0.
inline v16 vexp(v16 x) {
  const v16 lo = splat(-87.33654f), hi = splat(88.37626f);
  const i16 underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  i16 n = __builtin_convertvector(fx, i16);
  v16 nf = __builtin_convertvector(n, v16);
  n = nf > fx ? n - 1 : n;  // floor
  nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  v16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const i16 bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  return underflow ? splat(0.0f) : y;
}

template <typename KV>  // the cache's element: float, or uint16_t holding bfloat16 bits
struct Problem {
  const float* q;       // [T, Hq, D]
  const KV* kv;         // [2, Hkv, P, page, D]
  const int32_t* kv_lens;
  const int32_t* pages;  // [S, W]
  const int32_t* cu_q_lens;
  float* out;           // [T, Hq, D]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, total_pages, page_size, table_width;
  float scale;
};

// All query rows of sequence s for KV head h. DV = ceil(head_dim / 16); kFull: head_dim % 16 == 0;
// kPaged: page_size % 16 == 0, so a tile is 16 consecutive slots of one page (its base, no per-key lookup).
template <int DV, bool kFull, bool kPaged, typename KV>
void attend(const Problem<KV>& pb, int64_t s, int64_t h) {
  const int64_t D = pb.head_dim, tail = D - 16 * (DV - 1);
  auto ld = [tail](const auto* p, int u) { return kFull || u < DV - 1 ? load(p + 16 * u) : load_tail(p + 16 * u, tail); };
  const int64_t q_start = pb.cu_q_lens[s], q_len = pb.cu_q_lens[s + 1] - q_start;
  const int64_t kv_len = pb.kv_lens[s];
  if (q_len <= 0 || kv_len <= 0 || q_start < 0 || q_start + q_len > pb.num_tokens) return;
  const int64_t group = pb.num_q_heads / pb.num_kv_heads, rows = q_len * group;
  // Per-row state in buffers each thread keeps across calls (no allocation per item on the hot path).
  thread_local std::vector<v16> vectors;
  thread_local std::vector<float> scalars;
  thread_local std::vector<int64_t> positions;
  vectors.resize(std::max<size_t>(vectors.size(), 2 * rows * DV));
  scalars.resize(std::max<size_t>(scalars.size(), 2 * rows));
  positions.resize(std::max<size_t>(positions.size(), rows));
  v16* qv = vectors.data();
  v16* acc = qv + rows * DV;
  float* m = scalars.data();
  float* l = m + rows;
  int64_t* pos = positions.data();
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float* src = pb.q + ((q_start + i) * pb.num_q_heads + h * group + g) * D;
      for (int u = 0; u < DV; ++u) { qv[r * DV + u] = ld(src, u) * pb.scale; acc[r * DV + u] = v16{}; }
      m[r] = kMask;
      l[r] = 0.0f;
      pos[r] = kv_len - q_len + i;
    }
  const int64_t page_floats = pb.page_size * D;
  const KV* k_head = pb.kv + h * pb.total_pages * page_floats;
  const KV* v_head = pb.kv + (pb.num_kv_heads + h) * pb.total_pages * page_floats;
  const int32_t* table = pb.pages + s * pb.table_width;
  // The keys of the tile at t0 (those past the context read the last key's slot and are masked): one
  // division per tile, then the slot steps along (divisions per key cost more than a small head's math).
  auto locate = [&](int64_t t0, const KV** keys, const KV** values) {
    if constexpr (kPaged) {  // slots past the context lie in the same (allocated) page and are masked
      const int64_t page = std::clamp<int64_t>(table[std::min(t0 / pb.page_size, pb.table_width - 1)], 0, pb.total_pages - 1);
      const int64_t offset = page * page_floats + (t0 % pb.page_size) * D;
      for (int t = 0; t < kTile; ++t) keys[t] = k_head + offset + t * D, values[t] = v_head + offset + t * D;
      return;
    }
    int64_t key = std::min(t0, kv_len - 1), col = key / pb.page_size, slot = key % pb.page_size;
    for (int t = 0; t < kTile; ++t) {
      const int64_t page = std::clamp<int64_t>(table[std::min(col, pb.table_width - 1)], 0, pb.total_pages - 1);
      const int64_t offset = page * page_floats + slot * D;
      keys[t] = k_head + offset;
      values[t] = v_head + offset;
      if (key + 1 < kv_len) {
        ++key;
        if (++slot == pb.page_size) slot = 0, ++col;
      }
    }
  };
  const KV* keys[2][kTile];  // this tile's and the next one's, alternating
  const KV* values[2][kTile];
  alignas(64) float kbuf[kTile * DV * 16], vbuf[kTile * DV * 16];  // a bfloat16 tile widened to float32
  const float* kwide[kTile];
  const float* vwide[kTile];
  for (int t = 0; t < kTile; ++t) kwide[t] = kbuf + t * DV * 16, vwide[t] = vbuf + t * DV * 16;
  v16 dots[kTile];
  alignas(64) float p[kTile];
  // One tile's keys for every query row; `key_at` / `value_at` point into the cache or its widened copy.
  auto attend_rows = [&](int64_t t0, const auto* const* key_at, const auto* const* value_at) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t valid = std::min<int64_t>(kTile, std::min(pos[r] + 1, kv_len) - t0);
      if (valid <= 0) continue;
      const v16* qr = &qv[r * DV];
      for (int t = 0; t < kTile; ++t) {
        v16 d = qr[0] * ld(key_at[t], 0);
        for (int u = 1; u < DV; ++u) d += qr[u] * ld(key_at[t], u);
        dots[t] = d;
      }
      v16 scores = reduce16(dots);
      const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const i16 live = lane < static_cast<int32_t>(valid);
      scores = live ? scores : splat(kMask);
      const float m_new = std::max(m[r], hmax(scores));
      // exp(0) is exactly 1 here, so a tile that leaves the maximum alone skips the rescale (same bits)
      const bool rescale = m_new != m[r];
      const float alpha = rescale ? vexp(splat(m[r] - m_new))[0] : 1.0f;
      const v16 pv = vexp(scores - m_new);
      store(p, live ? pv : splat(0.0f));
      const float tile_sum = hsum(load(p));
      l[r] = rescale ? l[r] * alpha + tile_sum : l[r] + tile_sum;
      m[r] = m_new;
      v16* ar = &acc[r * DV];
      // p . V in two interleaved partial sums (two dependency chains), then into the rescaled accumulator
      v16 even[DV], odd[DV];
      for (int u = 0; u < DV; ++u) even[u] = odd[u] = v16{};
      int t = 0;
      for (; t + 1 < valid; t += 2)
        for (int u = 0; u < DV; ++u) {
          even[u] += p[t] * ld(value_at[t], u);
          odd[u] += p[t + 1] * ld(value_at[t + 1], u);
        }
      if (t < valid)
        for (int u = 0; u < DV; ++u) even[u] += p[t] * ld(value_at[t], u);
      if (rescale)
        for (int u = 0; u < DV; ++u) ar[u] = ar[u] * alpha + (even[u] + odd[u]);
      else
        for (int u = 0; u < DV; ++u) ar[u] += even[u] + odd[u];
    }
  };
  locate(0, keys[0], values[0]);
  for (int64_t t0 = 0, cur = 0; t0 < kv_len; t0 += kTile, cur ^= 1) {
    const KV* const* key_at = keys[cur];
    const KV* const* value_at = values[cur];
    if (t0 + kTile < kv_len) {  // the next tile's K and V lines on their way from memory while this one computes
      locate(t0 + kTile, keys[cur ^ 1], values[cur ^ 1]);
      for (int t = 0; t < kTile; ++t)
        for (int64_t f = 0; f < D; f += 64 / sizeof(KV)) {  // one prefetch per cache line
          __builtin_prefetch(keys[cur ^ 1][t] + f);
          __builtin_prefetch(values[cur ^ 1][t] + f);
        }
    }
    if constexpr (sizeof(KV) == 2) {
      if (rows > 1) {  // bfloat16 K and V widened once per tile, not once per query row that reads them
        for (int t = 0; t < kTile; ++t)
          for (int u = 0; u < DV; ++u) {
            store(kbuf + (t * DV + u) * 16, ld(key_at[t], u));
            store(vbuf + (t * DV + u) * 16, ld(value_at[t], u));
          }
        attend_rows(t0, kwide, vwide);
        continue;
      }
    }
    attend_rows(t0, key_at, value_at);
  }
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      float* dst = pb.out + ((q_start + i) * pb.num_q_heads + h * group + g) * D;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int u = 0; u < DV; ++u) {
        const v16 o = l[r] > 0.0f ? acc[r * DV + u] * inv : v16{};
        if (kFull || u < DV - 1) store(dst + 16 * u, o); else std::memcpy(dst + 16 * u, &o, tail * sizeof(float));
      }
    }
}

template <int DV, typename KV>
void attend_dv(const Problem<KV>& pb, int64_t s, int64_t h) {
  const bool paged = pb.page_size % kTile == 0;
  if (pb.head_dim == 16 * DV) {
    if (paged) attend<DV, true, true>(pb, s, h); else attend<DV, true, false>(pb, s, h);
  } else {
    if (paged) attend<DV, false, true>(pb, s, h); else attend<DV, false, false>(pb, s, h);
  }
}

template <typename KV>
void attend_item(const Problem<KV>& pb, int64_t item) {
  const int64_t s = item / pb.num_kv_heads, h = item % pb.num_kv_heads;
  switch ((pb.head_dim + 15) / 16) {
    case 1: return attend_dv<1>(pb, s, h);
    case 2: return attend_dv<2>(pb, s, h);
    case 3: return attend_dv<3>(pb, s, h);
    case 4: return attend_dv<4>(pb, s, h);
    case 5: return attend_dv<5>(pb, s, h);
    case 6: return attend_dv<6>(pb, s, h);
    case 7: return attend_dv<7>(pb, s, h);
    case 8: return attend_dv<8>(pb, s, h);
    case 9: return attend_dv<9>(pb, s, h);
    case 10: return attend_dv<10>(pb, s, h);
    case 11: return attend_dv<11>(pb, s, h);
    case 12: return attend_dv<12>(pb, s, h);
    case 13: return attend_dv<13>(pb, s, h);
    case 14: return attend_dv<14>(pb, s, h);
    case 15: return attend_dv<15>(pb, s, h);
    default: return attend_dv<16>(pb, s, h);
  }
}

template <typename KV, ffi::DataType kKV>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kKV> kv,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                              ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2 || kd[0] != 2 || qd[2] != kd[4] ||
      qd[1] % kd[1] != 0 || kv_lens.element_count() != pd[0] || cu_q_lens.element_count() != pd[0] + 1)
    return ffi::Error::InvalidArgument("paged_attention: q [T, Hq, D], kv [2, Hkv, P, page, D], kv_lens [S], "
                                       "page_indices [S, W], cu_q_lens [S + 1]");
  if (qd[2] < 1 || qd[2] > 256) return ffi::Error::InvalidArgument("paged_attention: head_dim must be 1..256");
  const Problem<KV> pb{q.typed_data(), reinterpret_cast<const KV*>(kv.untyped_data()), kv_lens.typed_data(),
                       page_indices.typed_data(), cu_q_lens.typed_data(), out->typed_data(), qd[0], qd[1], kd[1],
                       qd[2], kd[2], kd[3], pd[1], sm_scale};
  std::memset(pb.out, 0, sizeof(float) * qd[0] * qd[1] * qd[2]);
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, pd[0]);
  const int64_t num_items = seqs * pb.num_kv_heads;
  int64_t row_keys = 0;
  for (int64_t s = 0; s < seqs; ++s)
    row_keys += std::max(0, pb.cu_q_lens[s + 1] - pb.cu_q_lens[s]) * int64_t{std::max(0, pb.kv_lens[s])};
  row_keys *= pb.num_q_heads;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // (sequence, KV head) items over the pool (pool_items.h); small problems stay on the calling thread
  jax_rollout::run_items(pool, num_items, row_keys >= kSerialRowKeys ? threads : 1,
                         [pb](int64_t i) { attend_item(pb, i); });
  return ffi::Error::Success();
}

}  // namespace

#define JAX_ROLLOUT_PAGED_ATTENTION(NAME, KV, KV_TYPE)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (PagedAttentionImpl<KV, KV_TYPE>),                                   \
                                ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()                                    \
                                    .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<KV_TYPE>>()              \
                                    .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Attr<float>("sm_scale").Ret<ffi::Buffer<ffi::F32>>());

JAX_ROLLOUT_PAGED_ATTENTION(PagedAttention, float, ffi::F32)
JAX_ROLLOUT_PAGED_ATTENTION(PagedAttentionBf16, uint16_t, ffi::U16)
