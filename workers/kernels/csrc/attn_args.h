// Plain-data interface between the torch-facing op (attention.cpp) and the per-ISA kernels
// (attn_scalar.cpp, attn_avx2.cpp, attn_avx512.cpp). Nothing here may include torch headers:
// the ISA translation units are compiled under `#pragma GCC target(...)`, and any inline
// function they share with the rest of the library would break the one-definition rule.
#pragma once
#include <cstdint>

namespace kvmesh {

// element types of q / out / KV cache
enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, FP8 = 4 };

// One unit of work: `nrows` query rows of one KV head against keys [key0, key1) of one key
// sequence (a sequence's own blocks, or a cascade group's shared prefix blocks).
// Rows of a unit are (token, query head of the KV head) pairs, row = token_index * G + g.
struct WorkItem {
  int32_t kind;      // 0: a sequence's own keys, 1: a cascade group's prefix keys
  int32_t unit;      // sequence index (kind 0) or group index (kind 1)
  int32_t head;      // KV head
  int32_t row0;      // first row of the unit handled here
  int32_t nrows;
  int32_t key0;      // key range, key0 a multiple of the block size
  int32_t key1;
  int64_t part;      // >= 0: row offset in the partial buffers; -1: write the result to out
};

struct AttnArgs {
  // queries [T, H, D] (D contiguous)
  const void* q;
  int32_t q_dtype;
  int64_t q_st, q_sh;          // strides (elements) of token and head
  int32_t H, KVH, G, D;
  float scale;
  // cache [2, NB, BS, KVH, D] contiguous; scales [2, NB, KVH] float32 (quantized) or null
  const void* kv;
  int32_t kv_dtype;
  int32_t BS;
  int64_t kv_half;             // NB * BS * KVH * D: offset of V from K
  const float* scales;
  int64_t sc_half;             // NB * KVH
  // per sequence / group metadata
  const int32_t* qsl;          // [S+1]
  const int32_t* seq_lens;     // [S]
  const int32_t* bt;           // [S, bt_st]
  int64_t bt_st;
  const int32_t* pbt;          // [G, pbt_st] or null
  int64_t pbt_st;
  const int32_t* plens;        // [G] or null
  const int32_t* grp_tok;      // tokens (flattened batch index) of each group's members, CSR
  const int32_t* grp_tok_start;// [num_groups + 1]
  // outputs
  void* out;                   // [T, H, D] contiguous in q's dtype
  float* part_o;               // [rows, D]
  float* part_lse;             // [rows]
};

}  // namespace kvmesh
