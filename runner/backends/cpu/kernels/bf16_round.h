// Float32 -> bfloat16 rounding as XLA's convert does it (included by the bfloat16 matmul kernels).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jax_rollout {

// Stores 16 float32 values as bfloat16 bits: to nearest, ties to even; a NaN stays a (quiet) NaN.
inline void store_bf16_rounded(uint16_t* y, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}

}  // namespace jax_rollout
