// The scalar instantiation of the KV requantization loops (see requant.h): requantize_scalar.
#define KVMESH_ISA 0
#define KVMESH_ISA_NAME scalar
#include "requant.h"
