#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
// The avx512bf16 instantiation of the attention kernel (see attn_kernel.h): the AVX-512 one
// plus q K^T straight from a bfloat16 cache with vdpbf16ps (no conversion of K to float32).
// Compiled for baseline x86-64 plus the target above; only called after a run-time CPU
// feature check.
#define KVMESH_ISA 3
#define KVMESH_ISA_NAME avx512bf16
#include "attn_kernel.h"
