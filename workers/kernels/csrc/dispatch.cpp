// The paged-attention kernel of a level and head dim (dispatch.h).
#include "dispatch.h"

namespace kvmesh {

namespace {
Isa attention_level(Isa i, int D) {
  if (i == Isa::kAmx && D % 32 == 0) return Isa::kAmx;
  if (i >= Isa::kAvx512Bf16 && D % 32 == 0) return Isa::kAvx512Bf16;
  if (i >= Isa::kAvx512 && D % 16 == 0) return Isa::kAvx512;
  if (i >= Isa::kAvx2) return Isa::kAvx2;
  return Isa::kScalar;
}
}  // namespace

RunFn select_kernel(Isa isa, int D) {
  switch (attention_level(isa, D)) {
    case Isa::kAmx: return run_items_amx;
    case Isa::kAvx512Bf16: return run_items_avx512bf16;
    case Isa::kAvx512: return run_items_avx512;
    case Isa::kAvx2: return run_items_avx2;
    default: return run_items_scalar;
  }
}

const char* attention_path(Isa isa, int D) { return isa_name(attention_level(isa, D)); }

}  // namespace kvmesh
