// The bfloat16 flash-attention path of the attention kernel for work items with many query
// rows (prefill chunks, verify chunks, cascade groups) of a bfloat16 q over a bfloat16 cache, or
// an int8 / float8 one (each chunk's K and V rows dequantized to bfloat16 first, then packed
// alike). Included by attn_kernel.h inside the ISA namespace when KVMESH_ISA >= 3; the matrix
// products go through a `Mul` policy: `DpMul` below (AVX512-BF16's VDPBF16PS on registers) or
// `AmxMul` (attn_amx.h, AMX-BF16 tiles).
//
// FlashAttention-2's loop (Dao 2023) on 16 x 64 tiles: rows in tiles of 16, keys in chunks of 64
// (kChunk). Per chunk, K is packed once into the TDPBF16PS B layout (B[p][2j + e] =
// K[j][32 ds + 2p + e]: a 16 x 16 transpose of 32-bit pairs per 16 keys and 32 dims) and V
// into B tiles of key pairs (B[p][2c + e] = V[32 ks + 2p + e][16 ct + c]); then for every row
// tile: S = Q K^T (A = 16 q rows x 32 dims, as stored; 4 C tiles of 16 keys), the scale, the
// causal limit of each row, the online softmax in float32 on AVX-512, P rounded to bfloat16
// (as oneDNN's and ATen's bf16 flash attention do), and P V into C tiles of 16 dims, added to
// the float32 output after the rescale by exp(m_old - m_new). One packed layout serves both
// policies: a B tile's row p (32 bfloat16, 16 column pairs) is one VDPBF16PS operand, and the
// 32-bit pair p of an A tile's row, broadcast, is the other.
//
// Reference: Intel 64 and IA-32 Architectures Software Developer's Manual vol. 2 (VDPBF16PS,
// TDPBF16PS).

constexpr int kChunk = 64;       // keys per chunk (4 C tiles of S)
constexpr int kFlashMinRows = 9; // fewer rows: the vdpbf16ps row-dot path (decode)
constexpr int kFlashMaxD = 256;

static inline bool flash_item(const AttnArgs& a, const WorkItem& it) {
  return a.q_dtype == BF16 && (a.kv_dtype == BF16 || a.kv_dtype == I8 || a.kv_dtype == FP8) &&
         it.nrows >= kFlashMinRows && a.D % 32 == 0 && a.D <= kFlashMaxD;
}

// dst[0, D) = bfloat16(src[0, D) * sc) for an int8 / float8 cache row (the dequantization of
// KVCache.read, in float32, then rounded to nearest even)
template <int KVD>
static inline void dequant_row(const uint8_t* src, float sc, int D, uint16_t* dst) {
  const __m512 s = _mm512_set1_ps(sc);
  for (int d = 0; d < D; d += 16) {
    const __m512 x = KVD == I8 ? Simd::cvt_i8((const int8_t*)src + d) : Simd::cvt_fp8(src + d);
    _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x, s)));
  }
}

// exp(x) for x <= 0 (x = -inf gives 0): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2 and 2^f
// by its Taylor polynomial of degree 5 (relative error < 2.5e-6, far below the bfloat16
// rounding of P that follows), scaled by VSCALEFPS: about half the instructions of Simd::exp.
static inline __m512 exp_nonpos(__m512 x) {
  const __mmask16 fin = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(fin, p, n);
}

// 16 x 16 transpose of 32-bit elements: r[p] lane j <- r[j] lane p
static inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {       // rows 4g..4g+3: u[4g + i] lane L = column 4L + i
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88), w = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88), y = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xdd);
    r[i] = _mm512_shuffle_i32x4(v, x, 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(v, x, 0xdd);
    r[4 + i] = _mm512_shuffle_i32x4(w, y, 0x88);
    r[12 + i] = _mm512_shuffle_i32x4(w, y, 0xdd);
  }
}

// dst[p * 16 + j] = src[j][p] for a 16 x 16 matrix of 32-bit words; src row j at rows[j].
static inline void transpose16_u32(const uint32_t* const* rows, uint32_t* dst) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j]);
  transpose16(r);
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + p * 16, r[p]);
}

// C[16, 64] (row stride 64 floats) = A x B with VDPBF16PS on registers: the product of AMX's
// tiles_mul (attn_amx.h) on the same operands (A rows lda bytes apart, step k at A + 32 k; the
// N packed B tiles of step k at B + k * bk + 512 n), as R x N register tiles of 16 lanes: per
// dim pair p, N B rows are loaded and each A row's 32-bit pair p is broadcast (R = 6, N = 4:
// 24 accumulators). Only the row groups holding the first `nr` rows are computed (a cascade
// group of 8 decode rows x 3 query heads fills 1.5 tiles): the rows after them are left as they
// were, and the caller masks them.
struct DpMul {
  static inline void begin() {}
  template <int R, int N>
  static inline void rows(const char* A, int lda, int nk, const uint16_t* B, int64_t bk, float* out) {
    __m512 acc[R][N];
    kvmesh_dp::zero(acc);
    for (int k = 0; k < nk; ++k) {
      const char* a = A + k * 64;
      const uint16_t* b = B + k * bk;
#pragma GCC unroll 2
      for (int p = 0; p < 16; ++p) {
        __m512bh bv[N];
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) bv[n] = (__m512bh)_mm512_load_si512(b + 512 * n + 32 * p);
        kvmesh_dp::step(acc, a + 4 * p, lda, bv);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) _mm512_store_ps(out + r * 64 + 16 * n, acc[r][n]);
  }
  template <int N>
  static inline void mul(const uint16_t* A, int lda, int nk, const uint16_t* B, int64_t bk, float* out, int nr) {
    const char* a = (const char*)A;
    rows<6, N>(a, lda, nk, B, bk, out);
    if (nr > 6) rows<6, N>(a + 6 * lda, lda, nk, B, bk, out + 6 * 64);
    if (nr > 12) rows<4, N>(a + 12 * lda, lda, nk, B, bk, out + 12 * 64);
  }
};

template <class Mul>
static inline void mul_n(int n, const uint16_t* A, int lda, int nk, const uint16_t* B, int64_t bk, float* out,
                         int nr) {
  switch (n) {
    case 1: Mul::template mul<1>(A, lda, nk, B, bk, out, nr); break;
    case 2: Mul::template mul<2>(A, lda, nk, B, bk, out, nr); break;
    case 3: Mul::template mul<3>(A, lda, nk, B, bk, out, nr); break;
    default: Mul::template mul<4>(A, lda, nk, B, bk, out, nr);
  }
}

// Lane r of the result: op over the 16 lanes of v[r] (a transpose-and-reduce tree).
template <bool MAX>
static inline __m512 reduce16(__m512* v) {
  auto op = [](__m512 x, __m512 y) { return MAX ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y); };
  __m512 t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)   // 128-bit lane L of t[i]: rows 2i, 2i+1 reduced over pairs of lane L
    t[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // lane L of u[i]: rows 4i .. 4i+3, each reduced over lane L
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = op(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 w1 = op(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return op(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

// One row tile's scores and online softmax for a chunk: S = Q K^T (tq 16-key tiles), scaled
// and masked (row r sees chunk keys < min(lim[r] - b0 + 1, vis)); the running max mx and sum
// of the 16 rows updated; alpha = exp(m_old - m_new) (1 for a row that sees nothing); P the
// bfloat16 probabilities [16, 64] (0 where masked). Rows from nr on are padding (lim -1).
template <class Mul>
static inline void softmax_tile(const uint16_t* Qt, int D, const uint16_t* Kp, float* S, int tq, const int32_t* lim,
                                int b0, int vis, __m512 vscale, float* mx, float* sum, float* alpha, uint16_t* P,
                                int nr) {
  mul_n<Mul>(tq, Qt, D * 2, D / 32, Kp, 4 * 512, S, nr);      // S = Q K^T, tq tiles of 16 keys
  __m512 red[16];
  for (int r = 0; r < 16; ++r) {
    int ve = lim[r] - b0 + 1;
    if (ve > vis) ve = vis;
    float* sr = S + r * 64;
    __m512 vm = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const int left = ve - 16 * c;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), m, _mm512_load_ps(sr + 16 * c), vscale);
      _mm512_store_ps(sr + 16 * c, x);
      vm = _mm512_max_ps(vm, x);
    }
    red[r] = vm;
  }
  const __m512 b = reduce16<true>(red);          // -inf: nothing visible to the row in this chunk
  const __m512 mold = _mm512_loadu_ps(mx);
  const __mmask16 seen = _mm512_cmp_ps_mask(b, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  const __m512 mnew = _mm512_mask_max_ps(mold, seen, mold, b);
  const __m512 al = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), exp_nonpos(_mm512_sub_ps(mold, mnew)));
  _mm512_store_ps(alpha, al);
  _mm512_storeu_ps(mx, mnew);
  // masked scores are -inf: minus 0 (not minus an infinite running max) they give P = 0
  const __m512 mneg = _mm512_maskz_sub_ps(seen | _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                          _mm512_setzero_ps(), mnew);
  for (int r = 0; r < 16; ++r) {
    const float* sr = S + r * 64;
    const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(r), mneg);
    __m512 x[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) x[c] = exp_nonpos(_mm512_add_ps(_mm512_load_ps(sr + 16 * c), m));
    red[r] = _mm512_add_ps(_mm512_add_ps(x[0], x[1]), _mm512_add_ps(x[2], x[3]));
    _mm512_store_si512(P + r * 64, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
    _mm512_store_si512(P + r * 64 + 32, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
  }
  _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), al, reduce16<false>(red)));
}

// O [nr, D] (row stride D) = O * alpha + P V for the first nr rows of a row tile (nks 32-key
// steps of P).
template <class Mul>
static inline void pv_tile(const uint16_t* P, int nks, const uint16_t* Vp, int NCOL, float* T, const float* alpha,
                           float* O, int D, int nr) {
  for (int c0 = 0; c0 < NCOL; c0 += 4) {
    const int nc = NCOL - c0 < 4 ? NCOL - c0 : 4;
    mul_n<Mul>(nc, P, 128, nks, Vp + c0 * 512, int64_t(NCOL) * 512, T, nr);   // P V, nc tiles of 16 dims
    for (int r = 0; r < nr; ++r) {
      float* o = O + r * D + c0 * 16;
      const __m512 al = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < nc; ++c)
        _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * c), al, _mm512_load_ps(T + r * 64 + 16 * c)));
    }
  }
}

template <class Mul>
static void run_flash(const AttnArgs& a, const WorkItem& it) {
  const int D = a.D, G = a.G, BS = a.BS, M = it.nrows, Mp = (M + 15) / 16 * 16;
  const int ND = D / 32, NCOL = D / 16;
  const bool own = it.kind == 0;
  const int32_t* table = own ? a.bt + it.unit * a.bt_st : a.pbt + it.unit * a.pbt_st;
  int kv_shift = 0;   // own rows: token i sees own keys < seq_len - n + i + 1
  if (own) kv_shift = a.seq_lens[it.unit] - (a.qsl[it.unit + 1] - a.qsl[it.unit]);
  // scratch (64-byte aligned pieces): O [Mp, D], mx, sum [Mp], lim [Mp], S, T [16, 64] float32;
  // Qb [Mp, D], Kp [ND * 4 * 512], Vp [2 * NCOL * 512], P [2][16, 64], zero row [D] bfloat16;
  // K and V row pointers [kChunk] each; a quantized cache: its chunk's K and V rows dequantized
  // to bfloat16 [kChunk, D] each
  const bool quant = a.kv_dtype != BF16;
  auto up = [](size_t n) { return (n + 15) / 16 * 16; };   // in 4-byte units, 64-byte multiples
  const size_t n4 = up(size_t(Mp) * D) + 3 * up(Mp) + 2 * 1024 + up(size_t(Mp) * D / 2) + up(size_t(ND) * 1024) +
                    up(size_t(NCOL) * 512) + 1024 + up(D / 2 + 1) + kChunk * 4 + (quant ? size_t(kChunk) * D : 0);
  // per-thread scratch kept across items: a fresh allocation of this size is an mmap, whose
  // munmap stalls the other thread (TLB shootdown) (figures: docs/engine.md, "Kernel constants and the measurements behind them")
  struct Scratch {
    float* p = nullptr;
    size_t n = 0;
    ~Scratch() { std::free(p); }
  };
  static thread_local Scratch scratch;
  if (scratch.n < n4) {
    std::free(scratch.p);
    scratch.p = (float*)std::aligned_alloc(64, n4 * 4);
    scratch.n = scratch.p ? n4 : 0;
    if (scratch.p == nullptr) throw std::bad_alloc();
  }
  float* buf = scratch.p;
  float* O = buf;
  float* mx = O + up(size_t(Mp) * D);
  float* sum = mx + up(Mp);
  int32_t* lim = (int32_t*)(sum + up(Mp));
  float* S = (float*)(lim + up(Mp));
  float* T = S + 1024;
  uint16_t* Qb = (uint16_t*)(T + 1024);
  uint16_t* Kp = Qb + 2 * up(size_t(Mp) * D / 2);
  uint16_t* Vp = Kp + 2 * up(size_t(ND) * 1024);
  uint16_t* P = Vp + 2 * up(size_t(NCOL) * 512);
  uint16_t* zrow = P + 2048;
  const uint16_t** kptr = (const uint16_t**)(zrow + 2 * up(D / 2 + 1));
  const uint16_t** vptr = kptr + kChunk;
  uint16_t* Kst = (uint16_t*)(vptr + kChunk);     // a quantized chunk's rows in bfloat16
  uint16_t* Vst = Kst + size_t(kChunk) * D;
  std::memset(zrow, 0, sizeof(uint16_t) * D);

  int32_t max_lim = -1;
  for (int r = 0; r < Mp; ++r) {
    std::memset(O + r * D, 0, sizeof(float) * D);
    mx[r] = -INFINITY;
    sum[r] = 0.f;
    if (r >= M) {
      std::memset(Qb + r * D, 0, sizeof(uint16_t) * D);
      lim[r] = -1;
      continue;
    }
    const int row = it.row0 + r, i = row / G, g = row % G;
    const int64_t t = own ? a.qsl[it.unit] + i : a.grp_tok[a.grp_tok_start[it.unit] + i];
    std::memcpy(Qb + r * D, (const uint16_t*)a.q + t * a.q_st + int64_t(it.head * G + g) * a.q_sh, sizeof(uint16_t) * D);
    lim[r] = own ? kv_shift + i : it.key1 - 1;
    if (lim[r] > max_lim) max_lim = lim[r];
  }
  const int key_end = max_lim + 1 < it.key1 ? max_lim + 1 : it.key1;
  const int64_t tok_st = int64_t(a.KVH) * D;
  const uint16_t* kv = (const uint16_t*)a.kv;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(kLo), ihi = _mm512_load_si512(kHi);
  alignas(64) float alpha[32];
  Mul::begin();

  for (int b0 = it.key0; b0 < key_end; b0 += kChunk) {
    const int nj = key_end - b0 < kChunk ? key_end - b0 : kChunk;
    const int nq = (nj + 15) / 16, nks = (nj + 31) / 32;
    for (int j = 0; j < nq * 16; ++j) {
      if (j >= nj) {
        kptr[j] = vptr[j] = zrow;
        continue;
      }
      const int key = b0 + j;
      const int64_t pb = table[key / BS], off = (pb * BS + key % BS) * tok_st + int64_t(it.head) * D;
      if (!quant) {
        kptr[j] = kv + off;
        vptr[j] = kv + a.kv_half + off;
        continue;
      }
      const uint8_t* kq = (const uint8_t*)a.kv + off;
      const float ks = a.scales[pb * a.KVH + it.head], vs = a.scales[a.sc_half + pb * a.KVH + it.head];
      if (a.kv_dtype == I8) {
        dequant_row<I8>(kq, ks, D, Kst + j * D);
        dequant_row<I8>(kq + a.kv_half, vs, D, Vst + j * D);
      } else {
        dequant_row<FP8>(kq, ks, D, Kst + j * D);
        dequant_row<FP8>(kq + a.kv_half, vs, D, Vst + j * D);
      }
      kptr[j] = Kst + j * D;
      vptr[j] = Vst + j * D;
    }
    // prefetch the next chunk's K and V rows while this one is packed and used (decode-time
    // cascade groups are bound by reading K/V: without it the rows arrive one miss at a time)
    const int esize = quant ? 1 : 2;
    for (int key = b0 + kChunk, ke = std::min(key_end, b0 + 2 * kChunk); key < ke; ++key) {
      const char* kr = (const char*)a.kv + ((int64_t(table[key / BS]) * BS + key % BS) * tok_st + int64_t(it.head) * D) * esize;
      for (int c = 0; c < D * esize; c += 64) {
        __builtin_prefetch(kr + c);
        __builtin_prefetch(kr + a.kv_half * esize + c);
      }
    }
    // K: B tiles [ds][q] of 16 dim pairs x 16 keys
    for (int q = 0; q < nq; ++q)
      for (int ds = 0; ds < ND; ++ds) {
        const uint32_t* rows[16];
        for (int j = 0; j < 16; ++j) rows[j] = (const uint32_t*)(kptr[q * 16 + j]) + ds * 16;
        transpose16_u32(rows, (uint32_t*)(Kp + (ds * 4 + q) * 512));
      }
    // V: B tiles [ks][c] of 16 key pairs x 16 dims (padding keys read the zero row)
    for (int p = 0; p < nks * 16; ++p) {
      const int j0 = 2 * p, ks = p / 16, pr = p % 16;
      const uint16_t* va = j0 < nj ? vptr[j0] : zrow;
      const uint16_t* vb = j0 + 1 < nj ? vptr[j0 + 1] : zrow;
      for (int c2 = 0; c2 < ND; ++c2) {
        const __m512i x = _mm512_loadu_si512(va + c2 * 32), y = _mm512_loadu_si512(vb + c2 * 32);
        uint16_t* dst = Vp + (ks * NCOL + 2 * c2) * 512 + pr * 32;
        _mm512_store_si512(dst, _mm512_permutex2var_epi16(x, ilo, y));
        _mm512_store_si512(dst + 512, _mm512_permutex2var_epi16(x, ihi, y));
      }
    }
    // Software-pipelined over the row tiles: QK and the softmax of tile t, then P V of the
    // previous tile, whose P (stored by AVX-512) a tile load can read without waiting for
    // the stores just made.
    int pend = -1, pend_ks = 0;              // previous tile's first row and its key steps
    for (int r0 = 0; r0 <= Mp; r0 += 16) {
      int cur_ks = 0;
      if (r0 < Mp) {
        int32_t tl = -1;
        for (int r = 0; r < 16; ++r) tl = lim[r0 + r] > tl ? lim[r0 + r] : tl;
        if (tl >= b0) {                      // some key of this chunk is visible to the tile
          const int vis = tl - b0 + 1 < nj ? tl - b0 + 1 : nj;
          cur_ks = (vis + 31) / 32;
          const int buf_i = (r0 / 16) & 1;
          softmax_tile<Mul>(Qb + r0 * D, D, Kp, S, (vis + 15) / 16, lim + r0, b0, vis, vscale, mx + r0, sum + r0,
                            alpha + 16 * buf_i, P + 1024 * buf_i, M - r0 < 16 ? M - r0 : 16);
        }
      }
      if (pend >= 0)
        pv_tile<Mul>(P + 1024 * ((pend / 16) & 1), pend_ks, Vp, NCOL, T, alpha + 16 * ((pend / 16) & 1), O + pend * D, D,
                     M - pend < 16 ? M - pend : 16);
      pend = cur_ks ? r0 : -1;
      pend_ks = cur_ks;
    }
  }
  finish(a, it, O, mx, sum);
}
