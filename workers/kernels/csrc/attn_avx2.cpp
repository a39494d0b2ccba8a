#pragma GCC target("avx2,fma,f16c")
// The avx2 instantiation of the attention kernel (see attn_kernel.h). Compiled for baseline
// x86-64 plus the target above; only called after a run-time CPU feature check.
#define KVMESH_ISA 1
#define KVMESH_NS isa_avx2
#include "attn_kernel.h"

namespace kvmesh {
void run_items_avx2(const AttnArgs& a, const WorkItem* items, int64_t begin, int64_t end) {
  isa_avx2::run_items(a, items, begin, end);
}
}  // namespace kvmesh
