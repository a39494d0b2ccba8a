#pragma GCC target("avx2,fma,f16c")
// The avx2 instantiation of the attention kernel (see attn_kernel.h). Compiled for baseline
// x86-64 plus the target above; only called after a run-time CPU feature check.
#define KVMESH_ISA 1
#define KVMESH_ISA_NAME avx2
#include "attn_kernel.h"
