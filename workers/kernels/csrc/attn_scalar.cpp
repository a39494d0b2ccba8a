// The scalar instantiation of the attention kernel (see attn_kernel.h), compiled for baseline
// x86-64: the path of last resort, for any CPU.
#define KVMESH_ISA 0
#define KVMESH_ISA_NAME scalar
#include "attn_kernel.h"
