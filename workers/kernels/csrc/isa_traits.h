// SIMD traits for the attention kernel, one set per ISA, selected by KVMESH_ISA before inclusion
// (0 = scalar, 1 = AVX2+FMA+F16C, 2 = AVX-512F, 3 = AVX-512F with AVX512-BF16: the AVX-512
// traits plus dots_bf16). Every function is static inline inside the
// ISA's own namespace (see attn_kernel.h), so the per-ISA translation units share no symbols.
// The members the AVX2 and AVX-512 traits share are written once, in isa_x86_ops.h.
//
// Element conversions (to float32, exact): bfloat16 = upper half of a float32 (shift left 16;
// bf16.h, which the includer includes first: bf16_f32, f32_bf16, bf16x8_f32, bf16x16_f32);
// float16 via F16C (scalar: bit manipulation); int8 via sign extension; float8 e4m3fn:
// bits (x & 0x7f) << 20 placed as a float32 and multiplied by 2^120 (= 2^(127-7)) map normals
// and subnormals exactly; the sign is OR-ed back in. NaN encodings (0x7f/0xff) are not decoded
// (the cache never stores them: writes clamp to +-448).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if KVMESH_ISA > 0
#include <immintrin.h>
#endif

static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float f16_f32(uint16_t h) {
  uint32_t s = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v;
  if (e == 0) v = std::ldexp(float(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = bits_f32(((e + 112) << 23) | (m << 13));
  return bits_f32(f32_bits(v) | s);
}
static inline uint16_t f32_f16(float f) {          // round to nearest even (via _Float16)
  _Float16 h = (_Float16)f;
  uint16_t u; std::memcpy(&u, &h, 2); return u;
}
static inline float fp8_f32(uint8_t x) {
  return bits_f32(f32_bits(bits_f32(uint32_t(x & 0x7f) << 20) * 0x1p120f) | (uint32_t(x & 0x80) << 24));
}

#if KVMESH_ISA == 0
struct Simd {
  using V = float;
  static constexpr int W = 1;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V exp(V x) { return std::exp(x); }
  static float hsum(V v) { return v; }
  static float hmax(V v) { return v; }
  static V cvt_f32(const float* p) { return *p; }
  static V cvt_bf16(const uint16_t* p) { return bf16_f32(*p); }
  static V cvt_f16(const uint16_t* p) { return f16_f32(*p); }
  static V cvt_i8(const int8_t* p) { return float(*p); }
  static V cvt_fp8(const uint8_t* p) { return fp8_f32(*p); }
  static void store_bf16(uint16_t* p, V v) { *p = f32_bf16(v); }
  static void store_f16(uint16_t* p, V v) { *p = f32_f16(v); }
  static constexpr bool kRowDot = true;
  // s[j] = dot(q, k + j * D) for j < nk (nk a multiple of 8)
  static void dots(const float* q, const float* k, int D, int nk, float* s) {
    for (int j = 0; j < nk; ++j) {
      float acc = 0.f;
      for (int d = 0; d < D; ++d) acc += q[d] * k[j * D + d];
      s[j] = acc;
    }
  }
  // dst[d * ld + j] = src[j * D + d] for j < R, d < D
  static void transpose(const float* src, int R, int D, float* dst, int ld) {
    for (int j = 0; j < R; ++j)
      for (int d = 0; d < D; ++d) dst[d * ld + j] = src[j * D + d];
  }
};
#else

// The polynomial of the AVX2 and AVX-512 traits' expf (isa_x86_ops.h; S: that ISA's Simd), for
// x already clamped to [-87.3, 88.3] and n = round(x log2 e): r = x - n ln 2 (ln 2 in two
// parts), returns p(r) ~ e^r; exp scales it by 2^n (|rel err| ~ 2 ulp).
template <class S>
static inline typename S::V exp_poly(typename S::V x, typename S::V n) {
  using V = typename S::V;
  V r = S::fma(n, S::set1(-0.693359375f), x);
  r = S::fma(n, S::set1(2.12194440e-4f), r);
  V p = S::set1(1.9875691500E-4f);
  p = S::fma(p, r, S::set1(1.3981999507E-3f));
  p = S::fma(p, r, S::set1(8.3334519073E-3f));
  p = S::fma(p, r, S::set1(4.1665795894E-2f));
  p = S::fma(p, r, S::set1(1.6666665459E-1f));
  p = S::fma(p, r, S::set1(5.0000001201E-1f));
  return S::fma(p, S::mul(r, r), S::add(r, S::set1(1.f)));
}

// The lane sums of b[0..7] (8 floats each) as one vector, by a horizontal-add tree: the
// reduction of dots / dots_bf16 (both ISA paths).
static inline __m256 hsum8x8(const __m256* b) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(b[4], b[5]), _mm256_hadd_ps(b[6], b[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8x8 float transpose of rows src[0..7] (stride ss) into dst (stride ds); AVX (both ISA paths).
static inline void transpose8x8(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ss), r2 = _mm256_loadu_ps(src + 2 * ss),
         r3 = _mm256_loadu_ps(src + 3 * ss), r4 = _mm256_loadu_ps(src + 4 * ss), r5 = _mm256_loadu_ps(src + 5 * ss),
         r6 = _mm256_loadu_ps(src + 6 * ss), r7 = _mm256_loadu_ps(src + 7 * ss);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
         t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}
// R and D multiples of 8
static inline void transpose_avx(const float* src, int R, int D, float* dst, int ld) {
  for (int j = 0; j < R; j += 8)
    for (int d = 0; d < D; d += 8) transpose8x8(src + j * D + d, D, dst + d * ld + j, ld);
}

#if KVMESH_ISA == 1
struct Simd {
#define KVMESH_BITS 256
#include "isa_x86_ops.h"
#undef KVMESH_BITS
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void store_bf16(uint16_t* p, V v) {
    alignas(32) float t[8]; _mm256_store_ps(t, v);
    for (int i = 0; i < 8; ++i) p[i] = f32_bf16(t[i]);
  }
  static void store_f16(uint16_t* p, V v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static constexpr bool kRowDot = true;
  // s[j] = dot(q, k + j * D) for j < nk (nk a multiple of 8): 8 keys at a time, the eight
  // accumulators reduced to one vector of sums by a horizontal-add tree
  static void dots(const float* q, const float* k, int D, int nk, float* s) {
    for (int j = 0; j < nk; j += 8) {
      const float* kj = k + j * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + D + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + 7 * D + d), a7);
      }
      const __m256 b[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
      _mm256_storeu_ps(s + j, hsum8x8(b));
    }
  }
  static void transpose(const float* src, int R, int D, float* dst, int ld) { transpose_avx(src, R, D, dst, ld); }
};
#elif KVMESH_ISA >= 2
struct Simd {
#define KVMESH_BITS 512
#include "isa_x86_ops.h"
#undef KVMESH_BITS
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static void store_bf16(uint16_t* p, V v) {
#if KVMESH_ISA >= 3
    // VCVTNEPS2BF16: round to nearest even as f32_bf16 (denormal inputs flushed to zero)
    _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float t[16]; _mm512_store_ps(t, v);
    for (int i = 0; i < 16; ++i) p[i] = f32_bf16(t[i]);
#endif
  }
  static void store_f16(uint16_t* p, V v) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static constexpr bool kRowDot = true;
  // s[j] = dot(q, k + j * D) for j < nk (nk a multiple of 8; D a multiple of 8): 8 keys at a
  // time in 16-lane accumulators, each folded to 8 lanes, then the AVX2 path's horizontal-add
  // tree, instead of transposing K for every chunk (figures: docs/engine.md, "Kernel constants and the measurements behind them").
  static __m256 fold(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static void dots(const float* q, const float* k, int D, int nk, float* s) {
    for (int j = 0; j < nk; j += 8) {
      const float* kj = k + j * D;
      __m512 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      int d = 0;
      for (; d + 16 <= D; d += 16) {
        const __m512 x = _mm512_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(x, _mm512_loadu_ps(kj + i * D + d), a[i]);
      }
      __m256 b[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) b[i] = fold(a[i]);
      if (d < D) {              // D = 16 n + 8
        const __m256 x = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) b[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + i * D + d), b[i]);
      }
      _mm256_storeu_ps(s + j, hsum8x8(b));
    }
  }
#if KVMESH_ISA >= 3
  // s[j] = scale * dot(q, k[j]) for j < nk (nk a multiple of 8, D a multiple of 32): q and
  // the key rows are bfloat16 (k[j] points at D elements), multiplied in pairs by vdpbf16ps
  // (products exact in float32, float32 accumulation), 8 keys at a time, reduced as in dots.
  static void dots_bf16(const uint16_t* q, const uint16_t* const* k, int D, int nk, float scale, float* s) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int j = 0; j < nk; j += 8) {
      __m512 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, (__m512bh)_mm512_loadu_si512(k[j + i] + d));
      }
      __m256 b[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) b[i] = fold(a[i]);
      _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8x8(b), sc));
    }
  }
#endif
  static void transpose(const float* src, int R, int D, float* dst, int ld) { transpose_avx(src, R, D, dst, ld); }
};
#endif
#endif
