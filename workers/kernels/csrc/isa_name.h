// Symbol names of the per-ISA instantiations. A translation unit that instantiates a kernel
// header (attn_kernel.h, requant.h) defines KVMESH_ISA_NAME (scalar, avx2, avx512, ...) first;
// KVMESH_ISA_SYM(run_items_) is then run_items_avx2 etc.
#pragma once
#define KVMESH_CAT_(a, b) a##b
#define KVMESH_CAT(a, b) KVMESH_CAT_(a, b)
#define KVMESH_ISA_SYM(prefix) KVMESH_CAT(prefix, KVMESH_ISA_NAME)
