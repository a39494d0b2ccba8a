// The scalar instantiation of the attention kernel (see attn_kernel.h). Compiled for baseline
// x86-64 plus the target above; only called after a run-time CPU feature check.
#define KVMESH_ISA 0
#define KVMESH_NS isa_scalar
#include "attn_kernel.h"

namespace kvmesh {
void run_items_scalar(const AttnArgs& a, const WorkItem* items, int64_t begin, int64_t end) {
  isa_scalar::run_items(a, items, begin, end);
}
}  // namespace kvmesh
