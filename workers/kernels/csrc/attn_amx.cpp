#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
// The amx instantiation of the attention kernel (see attn_kernel.h): the avx512bf16 one, plus
// the AMX-BF16 tile path (attn_amx.h) for items of many query rows over a bfloat16 cache.
// Compiled for baseline x86-64 plus the target above; only called after a run-time check of
// the CPU's AMX-BF16 and the kernel's permission to use the tile state.
#define KVMESH_ISA 4
#define KVMESH_ISA_NAME amx
#include "attn_kernel.h"
