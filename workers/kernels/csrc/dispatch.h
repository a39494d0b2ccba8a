// Run-time choice of the kernel's instruction set (see dispatch.cpp).
#pragma once
#include <string>

#include "attn_args.h"

namespace kvmesh {

using RunFn = void (*)(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_scalar(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx2(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx512(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_avx512bf16(const AttnArgs&, const WorkItem*, int64_t, int64_t);
void run_items_amx(const AttnArgs&, const WorkItem*, int64_t, int64_t);

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };

bool cpu_has_amx_bf16();          // AMX-BF16 present and its tile state granted by the kernel
bool cpu_has_amx_int8();          // AMX-INT8 present and its tile state granted by the kernel
Isa cpu_isa();                    // the best path this CPU supports
Isa active_isa();                 // the path in use (<= cpu_isa())
const char* isa_name(Isa);
// Selects a path by name ("scalar", "avx2", "avx512", "avx512bf16", "amx", "auto"); a path above cpu_isa() is
// lowered to it. Returns the name of the path now active. Throws on an unknown name.
std::string set_isa(const std::string& name);
// The kernel for head_dim D under the active path (AVX-512 needs D % 16 == 0, else AVX2;
// AVX512-BF16 and AMX need D % 32 == 0, else AVX-512; AMX: the AVX512-BF16 kernel plus AMX tiles
// for items of many rows over a bfloat16 cache).
RunFn select_kernel(int D);

}  // namespace kvmesh
