#pragma GCC target("avx2,fma,f16c")
// The avx2 instantiation of the KV requantization loops (see requant.h): requantize_avx2.
#define KVMESH_ISA 1
#define KVMESH_ISA_NAME avx2
#include "requant.h"
