// Decode path of the avx512bf16 kernel (included by attn_kernel.h for KVMESH_ISA == 3): work
// items of at most 8 query rows of a bfloat16 q against a bfloat16, int8 or float8 (e4m3)
// cache, D a multiple of 32, blocks of a multiple of 16 tokens. Several items that differ only in their (consecutive) KV
// head run as one pass over the keys, so every 16-token chunk's K and V token rows are read
// whole (all heads of the pass), once; each line of the next chunk is software-prefetched
// into L1, and of the third next into L2, as the same line of the current chunk is loaded.
//
// Per 16 keys and KV head:
// - S = q K^T with vdpbf16ps and no horizontal sums: the 16 key rows, as 32-bit (dimension
//   pair) elements, are transposed in registers (16 x 16 per 32 dimensions) so that lane j
//   holds key j, and each row's q dimension pair is broadcast;
// - online softmax on the 16 scores of a row (one vector), P rounded to bfloat16 (as the flash
//   path, attn_flash.h, does);
// - O += P V with vdpbf16ps on key pairs: V rows j and j+1 interleaved by 16-bit unpacks, each
//   row's (p_j, p_j+1) pair broadcast. The unpacks permute the dimensions within each group
//   of 32 (fixed); O is kept so permuted and put back in order once at the end.
// An int8 / float8 cache: each 32 values of a row widened to bfloat16 in registers (exact:
// int8 and e4m3 values are bfloat16 values), so the same vdpbf16ps code runs on them; a
// 16-key chunk lies in one block, whose per-(block, head) scales go into S (the K scale, with
// the softmax scale) and into P before its rounding (the V scale; the softmax sum takes the
// unscaled P).
// (This replaced the row-dot kernel of Kernel::run for these items: that one reduced every
// key's products horizontally and read each head's third of the token rows in its own pass.)

// software prefetch distances in 16-key chunks, into L1 and into L2 (figures: docs/engine.md, "Kernel constants and the measurements behind them")
constexpr int kDecodePF = 1;
constexpr int kDecodePF2 = 3;

static inline bool decode_item(const AttnArgs& a, const WorkItem& it) {
  return a.q_dtype == BF16 && (a.kv_dtype == BF16 || a.kv_dtype == I8 || a.kv_dtype == FP8) && it.nrows <= 8 && a.D % 32 == 0 && a.D <= 256 &&
         a.BS % 16 == 0;
}

// y runs with x in one pass: same rows and keys, the KV head `off` after x's
static inline bool decode_joins(const WorkItem& x, const WorkItem& y, int off) {
  return y.kind == x.kind && y.unit == x.unit && y.row0 == x.row0 && y.nrows == x.nrows && y.key0 == x.key0 &&
         y.key1 == x.key1 && y.head == x.head + off;
}

// 32 values of a cache row from p as 32 bfloat16 (dimension pairs as 32-bit elements)
template <int KVD>
static inline __attribute__((always_inline)) __m512i load32(const void* p) {
  if constexpr (KVD == BF16) return _mm512_loadu_si512(p);
  else {
    const int8_t* b = (const int8_t*)p;
    const __m512 lo = KVD == I8 ? Simd::cvt_i8(b) : Simd::cvt_fp8((const uint8_t*)b);
    const __m512 hi = KVD == I8 ? Simd::cvt_i8(b + 16) : Simd::cvt_fp8((const uint8_t*)b + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

template <int KVD, int MR>
static void decode_pass(const AttnArgs& a, const WorkItem* its, int nh) {
  using T = std::conditional_t<KVD == BF16, uint16_t, uint8_t>;     // one cache element
  const WorkItem& it = its[0];
  const int D = a.D, G = a.G, BS = a.BS, ND = D / 32, DP = D / 2, NX = nh * MR;
  const bool own = it.kind == 0;
  const int32_t* table = own ? a.bt + it.unit * a.bt_st : a.pbt + it.unit * a.pbt_st;
  // scratch (64-byte aligned), x = head * MR + row: O [x, D], S [x, 16]; mx, sum, the rescale
  // exponent / factor, sum of P [x padded to 16]; P [x, 8] (bfloat16 pairs); q pairs [x, D/2]
  const int NXp = (NX + 15) / 16 * 16;
  const size_t nf = size_t(NX) * (DP + D + 16 + 8) + 4 * size_t(NXp);
  float* buf = (float*)std::aligned_alloc(64, (nf * sizeof(float) + 63) / 64 * 64);
  if (buf == nullptr) throw std::bad_alloc();
  float* O = buf;
  float* S = O + size_t(NX) * D;
  float* mx = S + NX * 16;
  float* sum = mx + NXp;
  float* dm = sum + NXp;
  float* ps = dm + NXp;
  uint32_t* PP = (uint32_t*)(ps + NXp);
  uint32_t* QP = PP + NX * 8;
  int32_t lim[MR];
  int32_t max_lim = -1;
  for (int r = 0; r < MR; ++r) {
    const int row = it.row0 + r, i = row / G, g = row % G;
    const int64_t t = own ? a.qsl[it.unit] + i : a.grp_tok[a.grp_tok_start[it.unit] + i];
    for (int h = 0; h < nh; ++h) {
      const int64_t qo = t * a.q_st + int64_t(its[h].head * G + g) * a.q_sh;
      std::memcpy(QP + size_t(h * MR + r) * DP, (const uint16_t*)a.q + qo, sizeof(uint16_t) * D);
    }
    lim[r] = own ? a.seq_lens[it.unit] - (a.qsl[it.unit + 1] - a.qsl[it.unit]) + i : it.key1 - 1;
    if (lim[r] > max_lim) max_lim = lim[r];
  }
  for (int x = 0; x < NXp; ++x) {
    mx[x] = -INFINITY;
    sum[x] = 0.f;
    dm[x] = 0.f;
  }
  std::memset(O, 0, sizeof(float) * size_t(NX) * D);
  const int key_end = max_lim + 1 < it.key1 ? max_lim + 1 : it.key1;
  const int64_t tok_st = int64_t(a.KVH) * D;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const T* kv = (const T*)a.kv;
  constexpr bool quant = KVD != BF16;
  constexpr int NQ = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;     // accumulators per row (q K^T)
  for (int b0 = it.key0; b0 < key_end; b0 += 16) {
    const int n = key_end - b0 < 16 ? key_end - b0 : 16;
    const int64_t pb = table[b0 / BS];
    const T* kb = kv + (pb * BS + b0 % BS) * tok_st;
    // offsets (elements) from this chunk's lines to the same lines of the chunks prefetched
    // while it is used (0, a prefetch of the line just read, past the item's last chunk)
    const int bp = b0 + 16 * kDecodePF, bp2 = b0 + 16 * kDecodePF2;
    const int64_t pf = bp < key_end ? (int64_t(table[bp / BS]) * BS + bp % BS) * tok_st - (kb - kv) : 0;
    const int64_t pf2 = bp2 < key_end ? (int64_t(table[bp2 / BS]) * BS + bp2 % BS) * tok_st - (kb - kv) : 0;
    __mmask16 vis[MR];
    for (int r = 0; r < MR; ++r) {
      const int nv = lim[r] - b0 + 1 < n ? lim[r] - b0 + 1 : n;
      vis[r] = nv <= 0 ? 0 : __mmask16((1u << nv) - 1);
    }
    // S = q K^T, every head
    for (int h = 0; h < nh; ++h) {
      const T* kh = kb + int64_t(its[h].head) * D;
      const __m512 sc = quant ? _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[pb * a.KVH + its[h].head])) : scale;
      const uint32_t* qp = QP + size_t(h) * MR * DP;
      __m512 acc[MR][NQ];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NQ; ++u) acc[r][u] = _mm512_setzero_ps();
      for (int c = 0; c < ND; ++c) {
        __m512i k[16];
        const T* rp = kh + c * 32;
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          k[j] = load32<KVD>(rp);
          __builtin_prefetch(rp + pf, 0, 3);
          __builtin_prefetch(rp + pf2, 0, 2);
          rp += tok_st;
          asm("" : "+r"(rp));     // one running pointer (else 16 hoisted row offsets spill)
        }
        transpose16(k);
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p)
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r)
            acc[r][p % NQ] = _mm512_dpbf16_ps(acc[r][p % NQ], (__m512bh)_mm512_set1_epi32((int)qp[r * DP + c * 16 + p]),
                                              (__m512bh)k[p]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m512 t = acc[r][0];
#pragma GCC unroll 4
        for (int u = 1; u < NQ; ++u) t = _mm512_add_ps(t, acc[r][u]);
        _mm512_store_ps(S + (h * MR + r) * 16, _mm512_mul_ps(t, sc));
      }
    }
    // online softmax of every head's rows: P (bfloat16 pairs), sums, the rescale exponents
    for (int x = 0; x < NX; ++x) {
      const __mmask16 vm = vis[x % MR];
      if (vm == 0) {                // nothing visible in this chunk
        _mm256_store_si256((__m256i*)(PP + x * 8), _mm256_setzero_si256());
        dm[x] = 0.f;
        ps[x] = 0.f;
        continue;
      }
      const __m512 s = _mm512_load_ps(S + x * 16);
      const float bm = _mm512_mask_reduce_max_ps(vm, s);
      const float mnew = bm > mx[x] ? bm : mx[x];
      dm[x] = mx[x] - mnew;
      mx[x] = mnew;
      const __m512 p = _mm512_maskz_mov_ps(vm, Simd::exp(_mm512_sub_ps(s, _mm512_set1_ps(mnew))));
      ps[x] = _mm512_reduce_add_ps(p);
      const __m512 pv = quant ? _mm512_mul_ps(p, _mm512_set1_ps(a.scales[a.sc_half + pb * a.KVH + its[x / MR].head])) : p;
      _mm256_store_si256((__m256i*)(PP + x * 8), (__m256i)_mm512_cvtneps_pbh(pv));
    }
    for (int x = 0; x < NX; x += 16) {
      const __m512 al = Simd::exp(_mm512_load_ps(dm + x));
      _mm512_store_ps(dm + x, al);
      _mm512_store_ps(sum + x, _mm512_fmadd_ps(_mm512_load_ps(sum + x), al, _mm512_load_ps(ps + x)));
    }
    // O = O * alpha + P V, key pairs (2i, 2i + 1); a missing key 2i + 1 (n odd) reads zeros
    const int np = (n + 1) / 2;
    for (int h = 0; h < nh; ++h) {
      const T* vh = kb + a.kv_half + int64_t(its[h].head) * D;
      const uint32_t* pp = PP + h * MR * 8;
      float* o = O + size_t(h) * MR * D;
      for (int c = 0; c < ND; ++c) {
        __m512 o0[MR][2], o1[MR][2];      // even / odd pairs (o1 unused for MR > 4)
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512 al = _mm512_set1_ps(dm[h * MR + r]);
          o0[r][0] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 32), al);
          o0[r][1] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 32 + 16), al);
          o1[r][0] = o1[r][1] = _mm512_setzero_ps();
        }
        const T* vc = vh + c * 32;
        auto step = [&](int i, __m512 (&acc)[MR][2]) __attribute__((always_inline)) {
          const T* p0 = vc;
          vc += 2 * tok_st;
          asm("" : "+r"(vc));
          const __m512i v0 = load32<KVD>(p0);
          const __m512i v1 = 2 * i + 1 < n ? load32<KVD>(p0 + tok_st) : _mm512_setzero_si512();
          __builtin_prefetch(p0 + pf, 0, 3);
          __builtin_prefetch(p0 + tok_st + pf, 0, 3);
          __builtin_prefetch(p0 + pf2, 0, 2);
          __builtin_prefetch(p0 + tok_st + pf2, 0, 2);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1), hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pp[r * 8 + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pr, lo);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pr, hi);
          }
        };
        int i = 0;
        if (MR <= 4)
          for (; i + 2 <= np; i += 2) {
            step(i, o0);
            step(i + 1, o1);
          }
        for (; i < np; ++i) step(i, o0);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          _mm512_storeu_ps(o + r * D + c * 32, MR <= 4 ? _mm512_add_ps(o0[r][0], o1[r][0]) : o0[r][0]);
          _mm512_storeu_ps(o + r * D + c * 32 + 16, MR <= 4 ? _mm512_add_ps(o0[r][1], o1[r][1]) : o0[r][1]);
        }
      }
    }
  }
  // O back in dimension order: within each 128-bit lane L of a 32-dimension group, the low
  // unpack held dimensions 8L..8L+3, the high one 8L+4..8L+7
  const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i ib = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t x = 0; x < int64_t(NX) * D; x += 32) {
    const __m512 lo = _mm512_loadu_ps(O + x), hi = _mm512_loadu_ps(O + x + 16);
    _mm512_storeu_ps(O + x, _mm512_permutex2var_ps(lo, ia, hi));
    _mm512_storeu_ps(O + x + 16, _mm512_permutex2var_ps(lo, ib, hi));
  }
  for (int h = 0; h < nh; ++h) finish(a, its[h], O + size_t(h) * MR * D, mx + h * MR, sum + h * MR);
  std::free(buf);
}

template <int KVD>
static void run_decode_rows(const AttnArgs& a, const WorkItem* items, int nh) {
  switch (items[0].nrows) {
    case 1: decode_pass<KVD, 1>(a, items, nh); break;
    case 2: decode_pass<KVD, 2>(a, items, nh); break;
    case 3: decode_pass<KVD, 3>(a, items, nh); break;
    case 4: decode_pass<KVD, 4>(a, items, nh); break;
    case 5: decode_pass<KVD, 5>(a, items, nh); break;
    case 6: decode_pass<KVD, 6>(a, items, nh); break;
    case 7: decode_pass<KVD, 7>(a, items, nh); break;
    default: decode_pass<KVD, 8>(a, items, nh);
  }
}

// items[0, nh): decode_item and each joining the first (decode_joins)
static void run_decode(const AttnArgs& a, const WorkItem* items, int nh) {
  switch (a.kv_dtype) {
    case BF16: run_decode_rows<BF16>(a, items, nh); break;
    case I8: run_decode_rows<I8>(a, items, nh); break;
    default: run_decode_rows<FP8>(a, items, nh);
  }
}
