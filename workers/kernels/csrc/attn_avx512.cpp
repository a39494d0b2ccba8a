#pragma GCC target("avx512f,avx2,fma,f16c")
// The avx512 instantiation of the attention kernel (see attn_kernel.h). Compiled for baseline
// x86-64 plus the target above; only called after a run-time CPU feature check.
#define KVMESH_ISA 2
#define KVMESH_ISA_NAME avx512
#include "attn_kernel.h"
