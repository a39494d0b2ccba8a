// Requantization of one (K or V, block, KV head) slice of an int8 / float8_e4m3fn cache,
// instantiated per ISA (requant_{scalar,avx2}.cpp define KVMESH_ISA and KVMESH_ISA_NAME, as
// attn_kernel.h: namespace kvmesh::rq_<name>, entry point requantize_<name>). Every element goes through the same IEEE float32 operations as
// workers/kv_cache.py:KVCache.write — dequantize q * scale, divide by the new scale, round half
// to even (int8), clamp, convert (e4m3: c10's fp8e4m3fn_from_fp32_value) — so every path
// stores the same bytes.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if KVMESH_ISA > 0
#include <immintrin.h>
#endif
#include "isa_name.h"

#define KVMESH_NS KVMESH_ISA_SYM(rq_)

namespace kvmesh {
namespace KVMESH_NS {

static inline uint32_t fbits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float e4m3_to_f32(uint8_t x) {     // exact (see isa_traits.h)
  return bitsf(fbits(bitsf(uint32_t(x & 0x7f) << 20) * 0x1p120f) | (uint32_t(x & 0x80) << 24));
}
// float32 -> e4m3fn for |f| <= 448, round to nearest even (c10::Float8_e4m3fn's algorithm)
static inline uint8_t f32_to_e4m3(float f) {
  uint32_t u = fbits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t r;
  if (u < (121u << 23)) r = fbits(bitsf(u) + bitsf(141u << 23)) - (141u << 23);
  else r = (u + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
  return uint8_t(r | (sign >> 24));
}

// buf[j * D + d] = src[j * st + d] * scale (Q8: 0 int8, 1 e4m3fn)
template <int Q8>
static void dequantize(const uint8_t* src, int64_t st, int64_t BS, int64_t D, float scale, float* buf) {
  for (int64_t j = 0; j < BS; ++j)
    for (int64_t d = 0; d < D; ++d) {
      const uint8_t b = src[j * st + d];
      buf[j * D + d] = (Q8 == 0 ? float(int8_t(b)) : e4m3_to_f32(b)) * scale;
    }
}

// Quantizes buf [BS, D] into dst (row stride st); returns the new scale
template <int Q8>
static float quantize(const float* buf, int64_t BS, int64_t D, uint8_t* dst, int64_t st) {
  const int64_t n = BS * D;
  float amax = 0.f;
  int64_t e = 0;
#if KVMESH_ISA > 0
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (; e + 8 <= n; e += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(buf + e), absmask));
  alignas(32) float t[8];
  _mm256_store_ps(t, vmax);
  for (int i = 0; i < 8; ++i) amax = t[i] > amax ? t[i] : amax;
#endif
  for (; e < n; ++e) amax = std::fabs(buf[e]) > amax ? std::fabs(buf[e]) : amax;
  const float qmax = Q8 == 0 ? 127.0f : 448.0f;
  float scale = amax / qmax;
  scale = scale > 0x1p-60f ? scale : 0x1p-60f;
  if (Q8 == 1) scale = std::exp2(std::ceil(std::log2(scale)));
  for (int64_t j = 0; j < BS; ++j) {
    const float* x = buf + j * D;
    uint8_t* out = dst + j * st;
    int64_t d = 0;
#if KVMESH_ISA > 0
    const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
    for (; d + 8 <= D; d += 8) {
      __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + d), vs);
      __m256i r;
      if (Q8 == 0) {
        y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, y)));
      } else {
        __m256i u = _mm256_castps_si256(_mm256_min_ps(hi, _mm256_max_ps(lo, y)));
        const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(int(0x80000000u)));
        u = _mm256_xor_si256(u, sign);
        const __m256i dm = _mm256_set1_epi32(141 << 23);
        __m256i sub = _mm256_sub_epi32(
            _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(dm))), dm);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
        __m256i norm = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(int((uint32_t)(7 - 127) << 23) + 0x7ffff)), odd), 20);
        __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), u);
        r = _mm256_or_si256(_mm256_blendv_epi8(norm, sub, small), _mm256_srli_epi32(sign, 24));
      }
      // 8 x int32 in [-127, 127] or [0, 255] -> 8 bytes
      __m128i w = Q8 == 0 ? _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1))
                          : _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      w = Q8 == 0 ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w);
      _mm_storel_epi64((__m128i*)(out + d), w);
    }
#endif
    for (; d < D; ++d) {
      float y = x[d] / scale;
      if (Q8 == 0) {
        y = std::nearbyint(y);
        y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
        out[d] = uint8_t(int8_t(int32_t(y)));
      } else {
        y = y < -448.f ? -448.f : (y > 448.f ? 448.f : y);
        out[d] = f32_to_e4m3(y);
      }
    }
  }
  return scale;
}

}  // namespace KVMESH_NS

// Requantizes one (K or V, block, head) slice in place: dequantize with s_old unless
// `restart` (then zeros), overwrite the rows `offs[i]` with `rows[i]` ([D] float32 each),
// quantize with the new scale (returned). Q8: 0 int8, 1 e4m3fn. Declared in cache_write.cpp.
float KVMESH_ISA_SYM(requantize_)(int q8, uint8_t* blk, int64_t st, int64_t BS, int64_t D, float s_old, bool restart,
                                  const float* const* rows, const int32_t* offs, int64_t n, float* buf) {
  if (restart) std::memset(buf, 0, sizeof(float) * BS * D);
  else if (q8 == 0) KVMESH_NS::dequantize<0>(blk, st, BS, D, s_old, buf);
  else KVMESH_NS::dequantize<1>(blk, st, BS, D, s_old, buf);
  for (int64_t i = 0; i < n; ++i) std::memcpy(buf + offs[i] * D, rows[i], sizeof(float) * D);
  return q8 == 0 ? KVMESH_NS::quantize<0>(buf, BS, D, blk, st) : KVMESH_NS::quantize<1>(buf, BS, D, blk, st);
}

}  // namespace kvmesh
