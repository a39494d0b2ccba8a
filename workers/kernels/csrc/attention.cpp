// kvmesh::paged_attention: validation, work planning (sequence/group x KV head x row chunk x
// KV split), the per-ISA kernel call under at::parallel_for, and the log-sum-exp merge of
// partial results (flash decoding's split-KV merge; FlashInfer's cascade merge of a shared
// prefix's partial with each member's own partial).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <vector>

#include "attn_args.h"
#include "dispatch.h"

namespace kvmesh {

namespace {

constexpr int kOwnRowsPerItem = 64;    // own-part rows per work item (long prefill chunks)
constexpr int kFlashRowsPerItem = 256; // the same on the flash paths (K/V packed once per item)
constexpr int kMinSplitKeys = 128;     // a KV split holds at least this many keys

DType dtype_code(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    case at::kChar: return I8;
    case at::kFloat8_e4m3fn: return FP8;
    default: TORCH_CHECK(false, "kvmesh::paged_attention: unsupported ", what, " dtype ", t);
  }
}

void check_i32(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "kvmesh::paged_attention: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && t.device().is_cpu(),
              "kvmesh::paged_attention: ", name, " must be a contiguous CPU tensor with ", dim, " dims");
}

struct Plan {
  std::vector<WorkItem> items;
  int64_t part_rows = 0;
  // merge tasks: (seq, head, row0, nrows) + CSR of partial sources: (part row offset of row0)
  struct Merge { int32_t seq, head, row0, nrows, src0, src1; };
  std::vector<Merge> merges;
  std::vector<int64_t> srcs;
};

// keys [0, n) cut into `splits` block-aligned ranges
std::vector<int32_t> cut(int32_t n, int splits, int BS) {
  int32_t nb = (n + BS - 1) / BS;
  splits = std::max(1, std::min<int>(splits, nb));
  std::vector<int32_t> b{0};
  for (int i = 1; i < splits; ++i) b.push_back(int32_t(int64_t(nb) * i / splits) * BS);
  b.push_back(n);
  return b;
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& kv_data, const std::optional<at::Tensor>& scales,
                               const at::Tensor& qsl, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                               double scale, const std::optional<at::Tensor>& prefix_group,
                               const std::optional<at::Tensor>& prefix_block_tables,
                               const std::optional<at::Tensor>& prefix_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "kvmesh::paged_attention: q must be [T, H, D] with contiguous D");
  TORCH_CHECK(kv_data.dim() == 5 && kv_data.size(0) == 2 && kv_data.is_contiguous(),
              "kvmesh::paged_attention: kv_data must be a contiguous [2, NB, BS, KVH, D] tensor");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_data.size(1), BS = kv_data.size(2), KVH = kv_data.size(3);
  TORCH_CHECK(kv_data.size(4) == D, "kvmesh::paged_attention: head_dim of q (", D, ") and kv_data (", kv_data.size(4), ") differ");
  TORCH_CHECK(D % 8 == 0, "kvmesh::paged_attention: head_dim must be a multiple of 8, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "kvmesh::paged_attention: ", H, " query heads are not a multiple of ", KVH, " KV heads");
  const DType qd = dtype_code(q.scalar_type(), "q"), kd = dtype_code(kv_data.scalar_type(), "kv_data");
  TORCH_CHECK(qd <= F16, "kvmesh::paged_attention: q must be float32, bfloat16 or float16");
  const bool quant = kd == I8 || kd == FP8;
  TORCH_CHECK(quant == (scales.has_value() && scales->defined()),
              "kvmesh::paged_attention: scales are required for (and only for) an int8/float8 cache");
  if (quant)
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 3 &&
                    scales->size(0) == 2 && scales->size(1) == NB && scales->size(2) == KVH,
                "kvmesh::paged_attention: scales must be contiguous float32 [2, NB, KVH]");
  check_i32(qsl, 1, "query_start_loc");
  check_i32(seq_lens, 1, "seq_lens");
  check_i32(block_tables, 2, "block_tables");
  const int64_t S = seq_lens.size(0), Wd = block_tables.size(1);
  TORCH_CHECK(qsl.size(0) == S + 1 && block_tables.size(0) == S, "kvmesh::paged_attention: query_start_loc must be [S+1] and block_tables [S, W] for S = ", S);
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const bool cascade = prefix_group.has_value() && prefix_group->defined();
  int64_t NG = 0, PW = 0;
  const int32_t *pg = nullptr, *pbt = nullptr, *pl = nullptr;
  if (cascade) {
    TORCH_CHECK(prefix_block_tables.has_value() && prefix_lens.has_value(), "kvmesh::paged_attention: prefix_group needs prefix_block_tables and prefix_lens");
    check_i32(*prefix_group, 1, "prefix_group");
    check_i32(*prefix_block_tables, 2, "prefix_block_tables");
    check_i32(*prefix_lens, 1, "prefix_lens");
    NG = prefix_lens->size(0);
    PW = prefix_block_tables->size(1);
    TORCH_CHECK(prefix_group->size(0) == S && prefix_block_tables->size(0) == NG, "kvmesh::paged_attention: prefix_group must be [S], prefix_block_tables [G, P]");
    pg = prefix_group->data_ptr<int32_t>();
    pbt = prefix_block_tables->data_ptr<int32_t>();
    pl = prefix_lens->data_ptr<int32_t>();
  }
  TORCH_CHECK(qs[0] >= 0 && qs[S] <= T, "kvmesh::paged_attention: query_start_loc out of range [0, ", T, "]");
  auto check_table = [&](const int32_t* row, int64_t len, int64_t width, const char* what, int64_t idx) {
    const int64_t nb = (len + BS - 1) / BS;
    TORCH_CHECK(nb <= width, "kvmesh::paged_attention: ", what, " ", idx, " needs ", nb, " blocks, table width is ", width);
    for (int64_t b = 0; b < nb; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < NB, "kvmesh::paged_attention: ", what, " ", idx, " lists block ", row[b], " (cache has ", NB, ")");
  };
  for (int64_t s = 0; s < S; ++s) {
    const int32_t n = qs[s + 1] - qs[s];
    TORCH_CHECK(n >= 0 && (n == 0 || sl[s] >= n), "kvmesh::paged_attention: sequence ", s, " has ", n, " queries but seq_len ", sl[s]);
    check_table(bt + s * Wd, sl[s], Wd, "sequence", s);
    if (cascade) TORCH_CHECK(pg[s] < NG, "kvmesh::paged_attention: prefix_group[", s, "] = ", pg[s], " >= ", NG, " groups");
  }
  for (int64_t g = 0; g < NG; ++g) {
    TORCH_CHECK(pl[g] >= 0, "kvmesh::paged_attention: negative prefix_lens[", g, "]");
    check_table(pbt + g * PW, pl[g], PW, "prefix group", g);
  }

  const int G = int(H / KVH);
  const int nthreads = at::get_num_threads();
  const RunFn run = select_kernel(active_isa(), int(D));
  const bool flash = (run == run_items_amx || run == run_items_avx512bf16) && qd == BF16 &&
                     (kd == BF16 || kd == I8 || kd == FP8);
  const int rows_per_item = flash ? kFlashRowsPerItem : kOwnRowsPerItem;
  // group members' tokens (CSR) and each member's first row within its group
  std::vector<int32_t> gtok, gstart(NG + 1, 0), member_row0(S, 0);
  if (cascade) {
    std::vector<std::vector<int32_t>> members(NG);
    for (int64_t s = 0; s < S; ++s)
      if (pg[s] >= 0 && pl[pg[s]] > 0 && qs[s + 1] > qs[s]) members[pg[s]].push_back(int32_t(s));
    for (int64_t g = 0; g < NG; ++g) {
      gstart[g] = int32_t(gtok.size());
      for (int32_t s : members[g]) {
        member_row0[s] = int32_t(gtok.size() - gstart[g]) * G;
        for (int32_t t = qs[s]; t < qs[s + 1]; ++t) gtok.push_back(t);
      }
    }
    gstart[NG] = int32_t(gtok.size());
  }
  auto has_prefix = [&](int64_t s) { return cascade && pg[s] >= 0 && pl[pg[s]] > 0; };

  // cost model: keys x (1 + rows / 8); splits so that there are ~8 items per thread
  double total = 0;
  for (int64_t s = 0; s < S; ++s) total += double(sl[s]) * (1 + (qs[s + 1] - qs[s]) * G / 8.0) * KVH;
  for (int64_t g = 0; g < NG; ++g) total += double(pl[g]) * (1 + (gstart[g + 1] - gstart[g]) * G / 8.0) * KVH;
  const double target = std::max(1.0, total / (8.0 * nthreads));
  auto nsplit = [&](int32_t keys, int rows) {
    double c = double(keys) * (1 + rows / 8.0);
    int by_cost = int(std::ceil(c / target));
    int by_len = std::max(1, keys / kMinSplitKeys);
    return std::max(1, std::min(by_cost, by_len));
  };

  Plan plan;
  // prefix items first (their partials are needed by every member's merge)
  std::vector<std::vector<int64_t>> prefix_srcs(NG * KVH);
  for (int64_t g = 0; g < NG; ++g) {
    const int rows = (gstart[g + 1] - gstart[g]) * G;
    if (rows == 0 || pl[g] == 0) continue;
    auto b = cut(pl[g], nsplit(pl[g], rows), int(BS));
    const size_t ns = b.size() - 1;
    for (int64_t h = 0; h < KVH; ++h) prefix_srcs[g * KVH + h].resize(ns);
    for (size_t i = 0; i < ns; ++i)            // heads of one key range adjacent: they share cache lines
      for (int64_t h = 0; h < KVH; ++h) {
        prefix_srcs[g * KVH + h][i] = plan.part_rows;
        plan.items.push_back({1, int32_t(g), int32_t(h), 0, rows, b[i], b[i + 1], plan.part_rows});
        plan.part_rows += rows;
      }
  }
  for (int64_t s = 0; s < S; ++s) {
    const int32_t n = qs[s + 1] - qs[s];
    if (n == 0) continue;
    const int rows = n * G;
    for (int r0 = 0; r0 < rows; r0 += rows_per_item) {
      const int nr = std::min(rows_per_item, rows - r0);
      const int32_t keys = sl[s] - n + (r0 + nr - 1) / G + 1;     // keys the chunk's last row sees
      auto b = cut(keys, nsplit(keys, nr), int(BS));
      const bool direct = b.size() == 2 && !has_prefix(s);
      const size_t ns = b.size() - 1;
      std::vector<int64_t> parts(KVH * ns);
      for (size_t i = 0; i < ns; ++i)          // heads of one key range adjacent: they share cache lines
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t part = direct ? -1 : plan.part_rows;
          parts[h * ns + i] = part;
          plan.items.push_back({0, int32_t(s), int32_t(h), r0, nr, b[i], b[i + 1], part});
          if (!direct) plan.part_rows += nr;
        }
      if (direct) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        Plan::Merge m{int32_t(s), int32_t(h), r0, nr, int32_t(plan.srcs.size()), 0};
        for (size_t i = 0; i < ns; ++i) plan.srcs.push_back(parts[h * ns + i]);
        if (has_prefix(s))
          for (int64_t p : prefix_srcs[pg[s] * KVH + h]) plan.srcs.push_back(p + member_row0[s] + r0);
        m.src1 = int32_t(plan.srcs.size());
        plan.merges.push_back(m);
      }
    }
  }

  at::Tensor out = qs[S] == T && qs[0] == 0 ? at::empty({T, H, D}, q.options()) : at::zeros({T, H, D}, q.options());
  at::Tensor part_o = at::empty({plan.part_rows, D}, q.options().dtype(at::kFloat));
  at::Tensor part_lse = at::empty({plan.part_rows}, q.options().dtype(at::kFloat));
  AttnArgs a{};
  a.q = q.data_ptr();
  a.q_dtype = qd;
  a.q_st = q.stride(0);
  a.q_sh = q.stride(1);
  a.H = int32_t(H); a.KVH = int32_t(KVH); a.G = G; a.D = int32_t(D);
  a.scale = float(scale);
  a.kv = kv_data.data_ptr();
  a.kv_dtype = kd;
  a.BS = int32_t(BS);
  a.kv_half = NB * BS * KVH * D;
  a.scales = quant ? scales->data_ptr<float>() : nullptr;
  a.sc_half = NB * KVH;
  a.qsl = qs; a.seq_lens = sl; a.bt = bt; a.bt_st = Wd;
  a.pbt = pbt; a.pbt_st = PW; a.plens = pl;
  a.grp_tok = gtok.data(); a.grp_tok_start = gstart.data();
  a.out = out.data_ptr();
  a.part_o = part_o.data_ptr<float>();
  a.part_lse = part_lse.data_ptr<float>();

  const WorkItem* items = plan.items.data();
  const bool tiles = run == run_items_amx;
  // Items differ in cost by orders of magnitude (a causal prefill's last rows see all keys,
  // its first rows a few): the threads take the next item from a shared counter, largest first.
  const int64_t n_items = int64_t(plan.items.size());
  std::vector<int32_t> order(n_items);
  for (int64_t i = 0; i < n_items; ++i) order[i] = int32_t(i);
  auto cost = [&](const WorkItem& w) { return int64_t(w.key1 - w.key0) * (8 + w.nrows); };
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return cost(items[x]) > cost(items[y]); });
  std::atomic<int64_t> next{0};
  // decode-only batches: one thread takes the KVH items of a key range (each cost class holds
  // whole head triples in plan order, so they stay adjacent after the stable sort): one core
  // reads the range's whole token rows, not a third of each (figures: docs/engine.md, "Kernel constants and the measurements behind them"); the
  // group goes to the kernel as one range, which the avx512bf16 decode pass runs as one pass
  // over the keys for all its heads (attn_decode.h), the other paths item by item
  bool few_rows = true;
  for (const WorkItem& w : plan.items) few_rows = few_rows && w.nrows <= 8;
  const int64_t grp = few_rows && n_items % KVH == 0 ? KVH : 1;
  at::parallel_for(0, std::min<int64_t>(nthreads, n_items), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) * grp < n_items;) {
      const int64_t k0 = i * grp, k1 = std::min(n_items, (i + 1) * grp);
      bool adjacent = true;       // the group's items consecutive in the plan: one call for all
      for (int64_t k = k0 + 1; k < k1; ++k) adjacent = adjacent && order[k] == order[k0] + (k - k0);
      if (adjacent) run(a, items + order[k0], 0, k1 - k0);
      else
        for (int64_t k = k0; k < k1; ++k) run(a, items + order[k], 0, 1);
    }
    // ATen's AMX GEMMs (cpublas::brgemm) cache "my tile configuration is loaded" per thread;
    // the kernel loaded its own, so make their next call configure again
    if (tiles) at::native::cpublas::brgemm_release();
  });

  // merge partials: out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)
  const float* po = a.part_o;
  const float* pls = a.part_lse;
  at::parallel_for(0, int64_t(plan.merges.size()), 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc(D), w;
    for (int64_t mi = b; mi < e; ++mi) {
      const auto& m = plan.merges[mi];
      const int nsrc = m.src1 - m.src0;
      w.resize(nsrc);
      for (int r = 0; r < m.nrows; ++r) {
        float mx = -INFINITY;
        for (int i = 0; i < nsrc; ++i) mx = std::max(mx, pls[plan.srcs[m.src0 + i] + r]);
        float den = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int i = 0; i < nsrc; ++i) {
          const float l = pls[plan.srcs[m.src0 + i] + r];
          w[i] = l == -INFINITY ? 0.f : std::exp(l - mx);
          den += w[i];
          const float* o = po + (plan.srcs[m.src0 + i] + r) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w[i] * o[d];
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        const int row = m.row0 + r;
        const int64_t t = qs[m.seq] + row / G;
        const int64_t oo = (t * H + m.head * G + row % G) * D;
        if (qd == F32) {
          float* dst = out.data_ptr<float>() + oo;
          for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv;
        } else if (qd == BF16) {
          c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + oo;
          for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(acc[d] * inv);
        } else {
          c10::Half* dst = out.data_ptr<c10::Half>() + oo;
          for (int64_t d = 0; d < D; ++d) dst[d] = c10::Half(acc[d] * inv);
        }
      }
    }
  });
  return out;
}

}  // namespace kvmesh
