// The paged attention kernel, instantiated once per ISA (attn_{scalar,avx2,avx512,avx512bf16,amx}.cpp
// define KVMESH_ISA and KVMESH_ISA_NAME, then include this file under their `#pragma GCC target`):
// each instantiation lives in namespace kvmesh::isa_<name> and exports run_items_<name> (dispatch.h).
//
// One work item = `nrows` query rows (token x query head of one KV head) against the keys
// [key0, key1) of one key sequence, walked in chunks of whole cache blocks (>= 64 keys) (FlashAttention-2's online
// softmax, Dao 2023): per chunk, K is dequantized/converted to float32 once and transposed to
// [D, keys], V to [keys, D]; then for every row tile S = Q K^T (6 rows x 2 vectors of keys per
// register tile), the running max / sum / output are rescaled and O += P V (6 rows x 2 vectors
// of D). All query heads sharing the KV head (GQA) and all members of a cascade group are rows
// of the same item, so each K/V block is read from memory once per item. Results are either
// final (written to `out` in q's dtype) or a partial (normalised output + log-sum-exp, merged
// by the caller as in flash decoding / FlashInfer's cascade attention).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#if KVMESH_ISA > 0
#include <immintrin.h>
#endif
#include "attn_args.h"
#include "bf16.h"
#include "isa_name.h"
#if KVMESH_ISA >= 3
#include "dp_tile.h"
#endif

#define KVMESH_NS KVMESH_ISA_SYM(isa_)

namespace kvmesh {
namespace KVMESH_NS {

#include "isa_traits.h"

// Normalises the M = it.nrows output rows O [M, D] (float32, unnormalised) by their softmax
// sums: final rows go to `out` in q's dtype, partial rows (it.part >= 0) keep their log-sum-exp.
static void finish(const AttnArgs& a, const WorkItem& it, const float* O, const float* mx, const float* sum) {
  using V = Simd::V;
  constexpr int W = Simd::W;
  const int D = a.D, G = a.G;
  for (int r = 0; r < it.nrows; ++r) {
    const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
    const V iv = Simd::set1(inv);
    const float* o = O + r * D;
    if (it.part >= 0) {
      float* po = a.part_o + (it.part + r) * D;
      for (int d = 0; d < D; d += W) Simd::store(po + d, Simd::mul(Simd::load(o + d), iv));
      a.part_lse[it.part + r] = sum[r] > 0.f ? mx[r] + std::log(sum[r]) : -INFINITY;
      continue;
    }
    const int row = it.row0 + r, i = row / G, g = row % G;
    const int64_t t = a.qsl[it.unit] + i;
    const int64_t oo = (t * a.H + it.head * G + g) * D;
    for (int d = 0; d < D; d += W) {
      V x = Simd::mul(Simd::load(o + d), iv);
      if (a.q_dtype == F32) Simd::store((float*)a.out + oo + d, x);
      else if (a.q_dtype == BF16) Simd::store_bf16((uint16_t*)a.out + oo + d, x);
      else Simd::store_f16((uint16_t*)a.out + oo + d, x);
    }
  }
}

constexpr int RT = 6;     // rows per register tile (6 x 2 vectors: 12 accumulators)

template <int KVD>
struct Kernel {
  using V = Simd::V;
  static constexpr int W = Simd::W;

  static inline V cvt(const void* base, int64_t off) {
    if constexpr (KVD == F32) return Simd::cvt_f32((const float*)base + off);
    else if constexpr (KVD == BF16) return Simd::cvt_bf16((const uint16_t*)base + off);
    else if constexpr (KVD == F16) return Simd::cvt_f16((const uint16_t*)base + off);
    else if constexpr (KVD == I8) return Simd::cvt_i8((const int8_t*)base + off);
    else return Simd::cvt_fp8((const uint8_t*)base + off);
  }

  // dst[j * D + d] = base[off + j * st + d] * sc for j < n
  static inline void load_rows(const void* base, int64_t off, int64_t st, int n, int D, float sc, float* dst) {
    const V s = Simd::set1(sc);
    for (int j = 0; j < n; ++j)
#pragma GCC unroll 8
      for (int d = 0; d < D; d += W) {
        if constexpr (KVD == I8 || KVD == FP8) Simd::store(dst + j * D + d, Simd::mul(cvt(base, off + j * st + d), s));
        else Simd::store(dst + j * D + d, cvt(base, off + j * st + d));
      }
  }

  // The register tiles of qk and pv: acc[r][c] += a[r * lda] * v[c] (one rank-1 update), and
  // the tile stored at o[r * ld + c * W].
  template <int RR, int NC>
  static inline __attribute__((always_inline)) void rank1(V (&acc)[RR][NC], const float* a, int lda, const V (&v)[NC]) {
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      V b = Simd::set1(a[r * lda]);
      for (int c = 0; c < NC; ++c) acc[r][c] = Simd::fma(b, v[c], acc[r][c]);
    }
  }
  template <int RR, int NC>
  static inline __attribute__((always_inline)) void store_tile(const V (&acc)[RR][NC], float* o, int ld) {
    for (int r = 0; r < RR; ++r)
      for (int c = 0; c < NC; ++c) Simd::store(o + r * ld + c * W, acc[r][c]);
  }

  template <int RR, int NJ>
  static inline void qk(const float* q, int D, const float* kt, int ld, float* s, int lds) {
    V acc[RR][NJ];
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r)
      for (int j = 0; j < NJ; ++j) acc[r][j] = Simd::zero();
    for (int d = 0; d < D; ++d) {
      V k[NJ];
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) k[j] = Simd::load(kt + d * ld + j * W);
      rank1(acc, q + d, D, k);
    }
    store_tile(acc, s, lds);
  }

  template <int RR>
  static inline void qk_rows(const float* q, int D, const float* kt, int ld, float* s, int lds) {
    int j = 0;
    for (; j + 2 * W <= ld; j += 2 * W) qk<RR, 2>(q, D, kt + j, ld, s + j, lds);
    if (j < ld) qk<RR, 1>(q, D, kt + j, ld, s + j, lds);
  }

  // o[r] = o[r] * alpha[r] + sum_j p[r][j] * V[j]; V[j] is vf + j * D (float32 scratch) or,
  // DIRECT, the cache row at element offset voff[j] (converted here; scale folded into p)
  template <int RR, int ND, bool DIRECT>
  static inline void pv(const float* p, int ldp, int nj, const float* vf, const void* kv, const int64_t* voff,
                        int col, int D, float* o, const float* alpha, const char* const* pf = nullptr, int npf = 0) {
    V acc[RR][ND];
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      V a = Simd::set1(alpha[r]);
      for (int c = 0; c < ND; ++c) acc[r][c] = Simd::mul(Simd::load(o + r * D + c * W), a);
    }
    for (int j = 0; j < nj; ++j) {
      if (pf != nullptr)      // a share of the next chunk's lines per key (see run)
        for (int i = j * npf / nj, e = (j + 1) * npf / nj; i < e; ++i) __builtin_prefetch(pf[i], 0, 2);
      V v[ND];
#pragma GCC unroll 4
      for (int c = 0; c < ND; ++c) v[c] = DIRECT ? cvt(kv, voff[j] + col + c * W) : Simd::load(vf + j * D + c * W);
      rank1(acc, p + j, ldp, v);
    }
    store_tile(acc, o, D);
  }

  // the first column pass issues the prefetches pf[0, npf) spread over the keys
  template <int RR, bool DIRECT>
  static inline void pv_rows(const float* p, int ldp, int nj, const float* vf, const void* kv, const int64_t* voff,
                             int D, float* o, const float* alpha, const char* const* pf, int npf) {
    int c = 0;
    if (DIRECT)             // V read from the cache: one pass over the keys per 4 vectors of D
      for (; c + 4 * W <= D; c += 4 * W, pf = nullptr)
        pv<RR, 4, DIRECT>(p, ldp, nj, vf + c, kv, voff, c, D, o + c, alpha, pf, npf);
    for (; c + 2 * W <= D; c += 2 * W, pf = nullptr)
      pv<RR, 2, DIRECT>(p, ldp, nj, vf + c, kv, voff, c, D, o + c, alpha, pf, npf);
    if (c < D) pv<RR, 1, DIRECT>(p, ldp, nj, vf + c, kv, voff, c, D, o + c, alpha, pf, npf);
  }

  template <int RR>
  static inline void pv_any(bool direct, const float* p, int ldp, int nj, const float* vf, const void* kv,
                            const int64_t* voff, int D, float* o, const float* alpha, const char* const* pf, int npf) {
    if (direct) pv_rows<RR, true>(p, ldp, nj, vf, kv, voff, D, o, alpha, pf, npf);
    else pv_rows<RR, false>(p, ldp, nj, vf, kv, voff, D, o, alpha, pf, npf);
  }

  static void run(const AttnArgs& a, const WorkItem& it) {
    const int D = a.D, G = a.G, BS = a.BS, M = it.nrows;
    // keys are processed in chunks of whole blocks, >= 64 keys (fewer softmax rescales)
    const int CK = BS >= 64 ? BS : (64 / BS) * BS + (64 % BS ? BS : 0);
    const int BSp = (CK + 15) / 16 * 16;
    const bool own = it.kind == 0;
    const int32_t* table = own ? a.bt + it.unit * a.bt_st : a.pbt + it.unit * a.pbt_st;
    int n_tok = 0, kv_shift = 0;   // own rows: token i sees own keys < seq_len - n + i + 1
    if (own) {
      n_tok = a.qsl[it.unit + 1] - a.qsl[it.unit];
      kv_shift = a.seq_lens[it.unit] - n_tok;
    }
    // scratch: Q, O [M, D]; S [M, BSp]; m, l, lim [M]; KT [D, BSp]; tmp, Vf [BSp, D]; vsc, voff,
    // kptr [BSp]; Qb [M, D] bf16; a zero key row [D] bf16
    constexpr int64_t esz = KVD == F32 ? 4 : (KVD == BF16 || KVD == F16) ? 2 : 1;
    const int lines = int((int64_t(D) * esz + 63) / 64);      // cache lines of one key's (or value's) head row
    size_t nf = size_t(M) * (2 * D + BSp + 3) + size_t(BSp) * (D * 3 + 6) + size_t(M + 1) * D / 2 + 96 +
                size_t(BSp) * lines * 4 + 16;
    float* buf = (float*)std::aligned_alloc(64, (nf * sizeof(float) + 63) / 64 * 64);
    if (buf == nullptr) throw std::bad_alloc();    // at::parallel_for rethrows it to the caller
    float *Q = buf, *O = Q + M * D, *S = O + M * D, *mx = S + M * BSp, *sum = mx + M;
    int32_t* lim = (int32_t*)(sum + M);
    float *KT = (float*)(lim + M), *tmp = KT + BSp * D, *Vf = tmp + BSp * D, *vsc = Vf + BSp * D;
    int64_t* voff = (int64_t*)(((uintptr_t)(vsc + BSp) + 7) & ~uintptr_t(7));
    const uint16_t** kptr = (const uint16_t**)(voff + BSp);
    uint16_t* Qb = (uint16_t*)(((uintptr_t)(kptr + BSp) + 63) & ~uintptr_t(63));
    uint16_t* zrow = Qb + M * D;
    const char** pfl = (const char**)(((uintptr_t)(zrow + D) + 7) & ~uintptr_t(7));   // next chunk's lines
    // bfloat16 q and cache on AVX512-BF16: q K^T by vdpbf16ps on the cache rows as stored
    // (q kept unscaled in Qb, the scale applied to the scores); P V as on AVX-512 (float32 P).
    // Used by the amx path and, on the avx512bf16 path, only where the decode pass of
    // attn_decode.h does not apply (D not a multiple of 32, blocks not of a multiple of 16)
#if KVMESH_ISA >= 3
    const bool kbf16 = KVD == BF16 && a.q_dtype == BF16 && M <= 8;
#else
    const bool kbf16 = false;
#endif
    if (kbf16) std::memset(zrow, 0, sizeof(uint16_t) * D);
    int32_t max_lim = -1;
    for (int r = 0; r < M; ++r) {
      const int row = it.row0 + r, i = row / G, g = row % G;
      const int64_t t = own ? a.qsl[it.unit] + i : a.grp_tok[a.grp_tok_start[it.unit] + i];
      const int64_t qo = t * a.q_st + int64_t(it.head * G + g) * a.q_sh;
      const V sc = Simd::set1(a.scale);
      for (int d = 0; d < D; d += W) {
        V x = a.q_dtype == F32 ? Simd::cvt_f32((const float*)a.q + qo + d)
              : a.q_dtype == BF16 ? Simd::cvt_bf16((const uint16_t*)a.q + qo + d)
                                  : Simd::cvt_f16((const uint16_t*)a.q + qo + d);
        Simd::store(Q + r * D + d, Simd::mul(x, sc));
        Simd::store(O + r * D + d, Simd::zero());
      }
      if (kbf16) std::memcpy(Qb + r * D, (const uint16_t*)a.q + qo, sizeof(uint16_t) * D);
      mx[r] = -INFINITY;
      sum[r] = 0.f;
      lim[r] = own ? kv_shift + i : it.key1 - 1;
      if (lim[r] > max_lim) max_lim = lim[r];
    }
    const int key_end = max_lim + 1 < it.key1 ? max_lim + 1 : it.key1;
    const int64_t tok_st = int64_t(a.KVH) * D;
    constexpr int64_t esize = KVD == F32 ? 4 : (KVD == BF16 || KVD == F16) ? 2 : 1;
    float alpha[RT];
    // few rows (decode): dot products on row-major K and V read from the cache inside P V;
    // else K transposed for the 4 x 2W register tiles and V converted once per chunk
    const bool rowdot = Simd::kRowDot && M <= 8;
    for (int b0 = it.key0; b0 < key_end; b0 += CK) {
      const int nj = key_end - b0 < CK ? key_end - b0 : CK;
      int npf = 0;
      for (int j0 = 0; j0 < nj; j0 += BS) {
        const int64_t pb = table[(b0 + j0) / BS];
        const int n = nj - j0 < BS ? nj - j0 : BS;
        const int64_t off = pb * BS * tok_st + int64_t(it.head) * D;
        float ks = 1.f, vs = 1.f;
        if (a.scales) {
          ks = a.scales[pb * a.KVH + it.head];
          vs = a.scales[a.sc_half + pb * a.KVH + it.head];
        }
        // prefetch the matching block of the next chunk while this one is converted and used
        if (b0 + CK + j0 < key_end) {
          const int pn = key_end - (b0 + CK + j0) < BS ? key_end - (b0 + CK + j0) : BS;
          const char* kp = (const char*)a.kv + (int64_t(table[(b0 + CK + j0) / BS]) * BS * tok_st + int64_t(it.head) * D) * esize;
          const char* vp = kp + a.kv_half * esize;
          for (int j = 0; j < pn; ++j)
            for (int64_t c = 0; c < int64_t(D) * esize; c += 64) {
              if (rowdot) {        // decode: issued a few per key inside P V (a burst of
                pfl[npf++] = kp + j * tok_st * esize + c;    // hundreds stalled on the miss
                pfl[npf++] = vp + j * tok_st * esize + c;    // buffers, memory latency unhidden)
              } else {
                __builtin_prefetch(kp + j * tok_st * esize + c);
                __builtin_prefetch(vp + j * tok_st * esize + c);
              }
            }
        }
        if (kbf16) {
          for (int j = 0; j < n; ++j) kptr[j0 + j] = (const uint16_t*)a.kv + off + j * tok_st;
        } else {
          load_rows(a.kv, off, tok_st, n, D, ks, tmp + j0 * D);
        }
        if (rowdot) {
          for (int j = 0; j < n; ++j) {
            voff[j0 + j] = a.kv_half + off + j * tok_st;
            vsc[j0 + j] = vs;
          }
        } else {
          load_rows(a.kv, a.kv_half + off, tok_st, n, D, vs, Vf + j0 * D);
        }
      }
      if (kbf16) {
        for (int j = nj; j < (nj + 7) / 8 * 8; ++j) kptr[j] = zrow;
      } else {
        std::memset(tmp + nj * D, 0, sizeof(float) * (BSp - nj) * D);
      }
      if (!rowdot) {
        std::memset(Vf + nj * D, 0, sizeof(float) * (BSp - nj) * D);
        Simd::transpose(tmp, BSp, D, KT, BSp);
      }
      for (int r0 = 0; r0 < M; r0 += RT) {
        const int rr = M - r0 < RT ? M - r0 : RT;
        const char* const* pfr = r0 == 0 && npf > 0 ? pfl : nullptr;
        const int npfr = r0 == 0 ? npf : 0;
        float* s = S + r0 * BSp;
        if (rowdot) {
#if KVMESH_ISA >= 3
          if (kbf16)
            for (int r = 0; r < rr; ++r) Simd::dots_bf16(Qb + (r0 + r) * D, kptr, D, (nj + 7) / 8 * 8, a.scale, s + r * BSp);
          else
#endif
            for (int r = 0; r < rr; ++r) Simd::dots(Q + (r0 + r) * D, tmp, D, (nj + 7) / 8 * 8, s + r * BSp);
        } else switch (rr) {
          case 6: qk_rows<6>(Q + r0 * D, D, KT, BSp, s, BSp); break;
          case 5: qk_rows<5>(Q + r0 * D, D, KT, BSp, s, BSp); break;
          case 4: qk_rows<4>(Q + r0 * D, D, KT, BSp, s, BSp); break;
          case 3: qk_rows<3>(Q + r0 * D, D, KT, BSp, s, BSp); break;
          case 2: qk_rows<2>(Q + r0 * D, D, KT, BSp, s, BSp); break;
          default: qk_rows<1>(Q + r0 * D, D, KT, BSp, s, BSp);
        }
        for (int r = 0; r < rr; ++r) {
          float* sr = s + r * BSp;
          int ve = lim[r0 + r] - b0 + 1;
          if (ve > nj) ve = nj;
          if (ve <= 0) {                 // nothing visible in this chunk
            std::memset(sr, 0, sizeof(float) * BSp);
            alpha[r] = 1.f;
            continue;
          }
          for (int j = ve; j < BSp; ++j) sr[j] = -INFINITY;
          V vm = Simd::load(sr);
          for (int j = W; j < BSp; j += W) vm = Simd::max(vm, Simd::load(sr + j));
          const float bm = Simd::hmax(vm);
          const float mnew = bm > mx[r0 + r] ? bm : mx[r0 + r];
          alpha[r] = std::exp(mx[r0 + r] - mnew);
          const V mneg = Simd::set1(-mnew);
          V acc = Simd::zero();
          for (int j = 0; j < BSp; j += W) {
            V p = Simd::exp(Simd::add(Simd::load(sr + j), mneg));
            Simd::store(sr + j, p);
            acc = Simd::add(acc, p);
          }
          sum[r0 + r] = sum[r0 + r] * alpha[r] + Simd::hsum(acc);
          if constexpr (KVD == I8 || KVD == FP8)
            if (rowdot)
              for (int j = 0; j < nj; ++j) sr[j] *= vsc[j];
          mx[r0 + r] = mnew;
        }
        switch (rr) {
          case 6: pv_any<6>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr); break;
          case 5: pv_any<5>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr); break;
          case 4: pv_any<4>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr); break;
          case 3: pv_any<3>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr); break;
          case 2: pv_any<2>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr); break;
          default: pv_any<1>(rowdot, s, BSp, nj, Vf, a.kv, voff, D, O + r0 * D, alpha, pfr, npfr);
        }
      }
    }
    finish(a, it, O, mx, sum);
    std::free(buf);
  }
};

#if KVMESH_ISA >= 3
#include "attn_flash.h"
#endif
#if KVMESH_ISA == 3
#include "attn_decode.h"
#endif
#if KVMESH_ISA >= 4
#include "attn_amx.h"
#endif

// Runs items [begin, end) of `items`.
static void run_items(const AttnArgs& a, const WorkItem* items, int64_t begin, int64_t end) {
#if KVMESH_ISA >= 4
  bool tiles = false;
#endif
  for (int64_t i = begin; i < end; ++i) {
#if KVMESH_ISA >= 4
    if (flash_item(a, items[i])) {
      run_flash<AmxMul>(a, items[i]);
      tiles = true;
      continue;
    }
#elif KVMESH_ISA == 3
    if (flash_item(a, items[i])) {
      run_flash<DpMul>(a, items[i]);
      continue;
    }
    if (decode_item(a, items[i])) {
      int64_t e = i + 1;
      while (e < end && decode_joins(items[i], items[e], int(e - i))) ++e;
      run_decode(a, items + i, int(e - i));
      i = e - 1;
      continue;
    }
#endif
    switch (a.kv_dtype) {
      case F32: Kernel<F32>::run(a, items[i]); break;
      case BF16: Kernel<BF16>::run(a, items[i]); break;
      case F16: Kernel<F16>::run(a, items[i]); break;
      case I8: Kernel<I8>::run(a, items[i]); break;
      default: Kernel<FP8>::run(a, items[i]);
    }
  }
#if KVMESH_ISA >= 4
  if (tiles) amx_release_tiles();
#endif
}

}  // namespace KVMESH_NS

// The instantiation's entry point, declared in dispatch.h.
void KVMESH_ISA_SYM(run_items_)(const AttnArgs& a, const WorkItem* items, int64_t begin, int64_t end) {
  KVMESH_NS::run_items(a, items, begin, end);
}

}  // namespace kvmesh
