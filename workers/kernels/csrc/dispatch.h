// Run-time choice of the paged-attention kernel (dispatch.cpp) at the active level (isa.h).
#pragma once

#include "attn_args.h"
#include "isa.h"

namespace kvmesh {

using RunFn = void (*)(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_scalar(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx2(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx512(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx512bf16(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_amx(const AttnArgs&, const WorkItem*, int64_t, int64_t);

// The kernel for head_dim D at level `isa`: every level has one, but AVX-512 needs D % 16 == 0
// (else avx2), AVX512-BF16 and AMX need D % 32 == 0 (else avx512); amx is the avx512bf16
// kernel plus AMX tiles for items of many rows over a bfloat16 cache.
RunFn select_kernel(Isa isa, int D);

// The name of the level select_kernel(isa, D) runs.
const char* attention_path(Isa isa, int D);

}  // namespace kvmesh
