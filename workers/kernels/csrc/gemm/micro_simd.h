// Register-blocked micro-kernel body shared by the AVX2 and AVX-512 files (included once by
// each, with KV_TARGET = that file's __attribute__((target(...))), KV_INLINE the same for
// always-inline helpers, and KV_BITS = its vector width: 256 or 512).
//
// The technique is GotoBLAS/BLIS register blocking (Goto & van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", TOMS 2008; Van Zee & van de Geijn, "BLIS", TOMS
// 2015): an MR x (16 NP) block of C lives in vector registers for the whole k loop; each step
// broadcasts one activation per row and multiplies it into the weight vectors of that k. The
// weights are bf16 and are widened in-register (micro.h), so the packed panel streams from
// memory at half the bytes of fp32. When the block has too few accumulators to hide the FMA
// latency (4 cycles, 2 pipes: 8 chains needed) the k-pair's two halves go into separate
// accumulators (KS) that are summed at the end.
//
// Ops, the vector ops the body is written in, for KV_BITS-bit vectors (the intrinsics of that
// width: KV_MM(add_ps) is _mm256_add_ps or _mm512_add_ps): V (float vector of Ops::L lanes),
// VI (its integer type), zero(), bcast(const float*), load(const uint16_t*) (L pairs = 2 L
// uint16), lo(VI) / hi(VI) (the even / odd k of each pair as fp32), fma(a, b, c) = a * b + c,
// add, store(float*, V), prefetch.
#define KV_CAT_(a, b, c, d, e) a##b##c##d##e
#define KV_CAT(a, b, c, d, e) KV_CAT_(a, b, c, d, e)
#define KV_MM(op) KV_CAT(_mm, KV_BITS, _, op, )                       // _mm256_op
#define KV_MM_SI(pre, post) KV_CAT(_mm, KV_BITS, _##pre##si, KV_BITS, post)   // _mm256_<pre>si256<post>

struct Ops {
  using V = KV_CAT(__m, KV_BITS, , , );
  using VI = KV_CAT(__m, KV_BITS, i, , );
  static constexpr int L = KV_BITS / 32;
  KV_INLINE V zero() { return KV_MM(setzero_ps)(); }
  KV_INLINE V bcast(const float* p) { return KV_MM(set1_ps)(*p); }
  KV_INLINE VI load(const uint16_t* p) { return KV_MM_SI(loadu_, )(reinterpret_cast<const VI*>(p)); }
  KV_INLINE V lo(VI r) { return KV_MM_SI(cast, _ps)(KV_MM(slli_epi32)(r, 16)); }
  KV_INLINE V hi(VI r) {
    return KV_MM_SI(cast, _ps)(KV_MM_SI(and_, )(r, KV_MM(set1_epi32)(static_cast<int>(0xffff0000u))));
  }
  KV_INLINE V fma(V a, V b, V c) { return KV_MM(fmadd_ps)(a, b, c); }
  KV_INLINE V add(V a, V b) { return KV_MM(add_ps)(a, b); }
  KV_INLINE void store(float* p, V v) { KV_MM(storeu_ps)(p, v); }
  KV_INLINE void prefetch(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
};

#undef KV_MM_SI
#undef KV_MM
#undef KV_CAT
#undef KV_CAT_

// One half of k-pair t: widens the even (H = 0) or odd (H = 1) k of each pair in the panel
// rows at `row` and FMAs it, times each row's x[2t + H], into the accumulators acc.
template <int MR, int NP, int H>
KV_INLINE void khalf(const float* __restrict x, int64_t ldx, const uint16_t* row, int64_t pstride, int64_t t,
                     typename Ops::V (&acc)[MR][NP * (kPanel / Ops::L)]) {
  constexpr int L = Ops::L;
  constexpr int VPP = kPanel / L;              // vectors per panel row
  constexpr int NV = NP * VPP;                 // vectors per tile row
  using V = typename Ops::V;
  V w[NV];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int v = 0; v < VPP; ++v) {
      const auto r = Ops::load(row + p * pstride + v * 2 * L);
      if constexpr (H == 0) w[p * VPP + v] = Ops::lo(r);
      else w[p * VPP + v] = Ops::hi(r);
    }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const V b = Ops::bcast(x + m * ldx + 2 * t + H);
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[m][j] = Ops::fma(b, w[j], acc[m][j]);
  }
}

template <int MR, int NP>
KV_TARGET void micro(const float* __restrict x, int64_t ldx, const uint16_t* __restrict w,
                     int64_t pstride, int64_t kp, float* __restrict tile) {
  constexpr int L = Ops::L;
  constexpr int VPP = kPanel / L;              // vectors per panel row
  constexpr int NV = NP * VPP;                 // vectors per tile row
  constexpr bool KS = MR * NV < 8;
  constexpr int NA = KS ? 2 : 1;
  using V = typename Ops::V;
  using VI = typename Ops::VI;

  V acc[NA][MR][NV];
#pragma GCC unroll 64
  for (int a = 0; a < NA; ++a)
#pragma GCC unroll 64
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 64
      for (int j = 0; j < NV; ++j) acc[a][m][j] = Ops::zero();

  // 8 lines (512 B) ahead in each panel, on top of the hardware prefetcher
  // (figures: docs/engine.md, "Kernel constants and the measurements behind them").
  constexpr int64_t kPrefetch = 8 * 2 * kPanel;
  for (int64_t t = 0; t < kp; ++t) {
    const uint16_t* row = w + t * 2 * kPanel;
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) Ops::prefetch(row + p * pstride + kPrefetch);
    // k = 2t: widen the even halves, FMA them into every row.
    khalf<MR, NP, 0>(x, ldx, row, pstride, t, acc[0]);
    // Reload (the lines are in L1 by now) rather than keep the raw vectors live across the
    // FMAs above: on AVX2 the accumulators leave too few of the 16 registers for them.
    asm volatile("" ::: "memory");
    khalf<MR, NP, 1>(x, ldx, row, pstride, t, acc[NA - 1]);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      V r = acc[0][m][j];
      if constexpr (KS) r = Ops::add(r, acc[1][m][j]);
      Ops::store(tile + m * NP * kPanel + j * L, r);
    }
  (void)sizeof(VI);
}

// Two panels as two one-panel calls, for row counts whose two-panel block would not fit the
// register file.
template <int MR>
KV_TARGET void micro_split(const float* __restrict x, int64_t ldx, const uint16_t* __restrict w,
                           int64_t pstride, int64_t kp, float* __restrict tile) {
  alignas(64) float t[2][MR * kPanel];
  micro<MR, 1>(x, ldx, w, pstride, kp, t[0]);
  micro<MR, 1>(x, ldx, w + pstride, pstride, kp, t[1]);
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < 2; ++p)
      for (int c = 0; c < kPanel; ++c) tile[m * 2 * kPanel + p * kPanel + c] = t[p][m * kPanel + c];
}
