// CPU feature detection (__builtin_cpu_supports) and the active ISA path.
#include "dispatch.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <cpuid.h>

#include <atomic>

namespace kvmesh {

namespace {
std::atomic<int> g_active{-1};
}

// CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE and the given feature bit; at::cpu::init_amx asks Linux
// for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), without which the first tile instruction faults.
static bool cpu_has_amx(unsigned feature_bit) {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << feature_bit)) && (d & (1u << 24)) && at::cpu::init_amx();
#else
  (void)feature_bit;
  return false;
#endif
}

bool cpu_has_amx_bf16() { return cpu_has_amx(22); }

bool cpu_has_amx_int8() { return cpu_has_amx(25); }    // the GGUF kernel's tiles (gemm/gguf_gemm.cpp)

Isa cpu_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    if (!(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")))
      return ISA_AVX512;
    static const bool amx = cpu_has_amx_bf16();
    return amx ? ISA_AMX : ISA_AVX512BF16;
  }
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
    case ISA_AMX: return "amx";
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
  else if (name == "avx512bf16") want = ISA_AVX512BF16;
  else if (name == "amx") want = ISA_AMX;
  else TORCH_CHECK(false, "kvmesh: unknown kernel ISA '", name, "' (choose scalar, avx2, avx512, avx512bf16, amx or auto)");
  if (want > cpu_isa()) want = cpu_isa();
  g_active.store(want);
  return isa_name(Isa(want));
}

RunFn select_kernel(int D) {
  const Isa i = active_isa();
  if (i == ISA_AMX && D % 32 == 0) return run_items_amx;
  if (i >= ISA_AVX512BF16 && D % 32 == 0) return run_items_avx512bf16;
  if (i >= ISA_AVX512 && D % 16 == 0) return run_items_avx512;
  if (i >= ISA_AVX2) return run_items_avx2;
  return run_items_scalar;
}

}  // namespace kvmesh
