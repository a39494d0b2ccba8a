// CPU feature detection (__builtin_cpu_supports) and the active ISA path.
#include "dispatch.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace kvmesh {

namespace {
std::atomic<int> g_active{-1};
}

Isa cpu_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") ? ISA_AVX512BF16 : ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return ISA_AVX2;
#endif
  return ISA_SCALAR;
}

Isa active_isa() {
  int a = g_active.load();
  if (a < 0) {
    a = cpu_isa();
    g_active.store(a);
  }
  return Isa(a);
}

const char* isa_name(Isa i) {
  switch (i) {
    case ISA_AVX512BF16: return "avx512bf16";
    case ISA_AVX512: return "avx512";
    case ISA_AVX2: return "avx2";
    default: return "scalar";
  }
}

std::string set_isa(const std::string& name) {
  int want;
  if (name == "auto" || name.empty()) want = cpu_isa();
  else if (name == "scalar") want = ISA_SCALAR;
  else if (name == "avx2") want = ISA_AVX2;
  else if (name == "avx512") want = ISA_AVX512;
  else if (name == "avx512bf16" || name == "amx") want = ISA_AVX512BF16;   // amx: the GEMM's name (no AMX attention)
  else TORCH_CHECK(false, "kvmesh: unknown kernel ISA '", name, "' (choose scalar, avx2, avx512, avx512bf16 or auto)");
  if (want > cpu_isa()) want = cpu_isa();
  g_active.store(want);
  return isa_name(Isa(want));
}

RunFn select_kernel(int D) {
  const Isa i = active_isa();
  if (i == ISA_AVX512BF16 && D % 32 == 0) return run_items_avx512bf16;
  if (i >= ISA_AVX512 && D % 16 == 0) return run_items_avx512;
  if (i >= ISA_AVX2) return run_items_avx2;
  return run_items_scalar;
}

}  // namespace kvmesh
