// The members of the AVX2 and AVX-512 Simd traits (isa_traits.h) that are the same at both widths,
// written once for KVMESH_BITS-bit vectors: included inside each struct Simd, which defines
// KVMESH_BITS (256 or 512) first. The few steps whose intrinsics differ by more than the width
// come first, by width: load_u16(p) (W uint16 in an integer vector of half the width),
// load_u8(p) (W bytes in an __m128i), cvt_bf16(p) (bf16.h's conversion of W bfloat16), and
// exp's round_nearest and zero_below. No include guard: one copy per struct.
#define KVMESH_PASTE5_(a, b, c, d, e) a##b##c##d##e
#define KVMESH_PASTE5(a, b, c, d, e) KVMESH_PASTE5_(a, b, c, d, e)
#define KVMESH_MM(op) KVMESH_PASTE5(_mm, KVMESH_BITS, _, op, )                        // _mm256_op
#define KVMESH_MM_SI(pre, post) KVMESH_PASTE5(_mm, KVMESH_BITS, _##pre##si, KVMESH_BITS, post)  // _mm256_<pre>si256<post>
  using V = KVMESH_PASTE5(__m, KVMESH_BITS, , , );
  using VI = KVMESH_PASTE5(__m, KVMESH_BITS, i, , );
  static constexpr int W = KVMESH_BITS / 32;
#if KVMESH_BITS == 256
  static __m128i load_u16(const void* p) { return _mm_loadu_si128((const __m128i*)p); }
  static __m128i load_u8(const void* p) { return _mm_loadl_epi64((const __m128i*)p); }
  static V cvt_bf16(const uint16_t* p) { return bf16x8_f32(p); }
  static V round_nearest(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // r where x >= lo, else 0 (NaN x: r)
  static V zero_below(V x, V lo, V r) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), r); }
#else
  static __m256i load_u16(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static __m128i load_u8(const void* p) { return _mm_loadu_si128((const __m128i*)p); }
  static V cvt_bf16(const uint16_t* p) { return bf16x16_f32(p); }
  static V round_nearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // r where x >= lo, else 0 (NaN x: 0)
  static V zero_below(V x, V lo, V r) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), r); }
#endif
  static V zero() { return KVMESH_MM(setzero_ps)(); }
  static V set1(float x) { return KVMESH_MM(set1_ps)(x); }
  static V load(const float* p) { return KVMESH_MM(loadu_ps)(p); }
  static void store(float* p, V v) { KVMESH_MM(storeu_ps)(p, v); }
  static V add(V a, V b) { return KVMESH_MM(add_ps)(a, b); }
  static V mul(V a, V b) { return KVMESH_MM(mul_ps)(a, b); }
  static V fma(V a, V b, V c) { return KVMESH_MM(fmadd_ps)(a, b, c); }
  static V max(V a, V b) { return KVMESH_MM(max_ps)(a, b); }
  static V cvt_f32(const float* p) { return KVMESH_MM(loadu_ps)(p); }
  static V cvt_f16(const uint16_t* p) { return KVMESH_MM(cvtph_ps)(load_u16(p)); }
  static V cvt_i8(const int8_t* p) { return KVMESH_MM(cvtepi32_ps)(KVMESH_MM(cvtepi8_epi32)(load_u8(p))); }
  static V cvt_fp8(const uint8_t* p) {
    const VI x = KVMESH_MM(cvtepu8_epi32)(load_u8(p));
    const VI mag = KVMESH_MM(slli_epi32)(KVMESH_MM_SI(and_, )(x, KVMESH_MM(set1_epi32)(0x7f)), 20);
    const VI sgn = KVMESH_MM(slli_epi32)(KVMESH_MM_SI(and_, )(x, KVMESH_MM(set1_epi32)(0x80)), 24);
    const V f = KVMESH_MM(mul_ps)(KVMESH_MM_SI(cast, _ps)(mag), KVMESH_MM(set1_ps)(0x1p120f));
    return KVMESH_MM_SI(cast, _ps)(KVMESH_MM_SI(or_, )(KVMESH_MM_SI(castps_, )(f), sgn));
  }
  // Cephes-style expf: 2^n * p(r) (exp_poly, isa_traits.h), |rel err| ~ 2 ulp; x < -87.3
  // (incl. -inf) gives 0.
  static V exp(V x) {
    const V lo = set1(-87.3f);
    const V c = KVMESH_MM(min_ps)(KVMESH_MM(max_ps)(x, lo), set1(88.3f));
    const V n = round_nearest(mul(c, set1(1.44269504088896341f)));
    const VI e = KVMESH_MM(slli_epi32)(KVMESH_MM(add_epi32)(KVMESH_MM(cvtps_epi32)(n), KVMESH_MM(set1_epi32)(127)), 23);
    return zero_below(x, lo, mul(exp_poly<Simd>(c, n), KVMESH_MM_SI(cast, _ps)(e)));
  }
#undef KVMESH_MM_SI
#undef KVMESH_MM
#undef KVMESH_PASTE5
#undef KVMESH_PASTE5_
