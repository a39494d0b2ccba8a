// CPU feature detection (__builtin_cpu_supports, CPUID) and the active level: see isa.h.
#include "isa.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <cpuid.h>

#include <algorithm>
#include <atomic>

namespace kvmesh {

namespace {
std::atomic<int> g_active{-1};

// CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE and the given feature bit; at::cpu::init_amx asks Linux
// for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), without which the first tile instruction faults.
bool cpu_has_amx(unsigned feature_bit) {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << feature_bit)) && (d & (1u << 24)) && at::cpu::init_amx();
#else
  (void)feature_bit;
  return false;
#endif
}

Isa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return Isa::kScalar;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
    return Isa::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  return cpu_has_amx_bf16() ? Isa::kAmx : Isa::kAvx512Bf16;
#else
  return Isa::kScalar;
#endif
}
}  // namespace

bool cpu_has_amx_bf16() {
  static const bool ok = cpu_has_amx(22);
  return ok;
}

bool cpu_has_amx_int8() {
  static const bool ok = cpu_has_amx(25);
  return ok;
}

bool cpu_has_avx512vnni() {
#if defined(__x86_64__)
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return ok;
#else
  return false;
#endif
}

Isa cpu_isa() {
  static const Isa best = detect();
  return best;
}

Isa active_isa() {
  const int a = g_active.load(std::memory_order_relaxed);
  return a >= 0 ? Isa(a) : cpu_isa();
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa set_isa(const std::string& name) {
  Isa want = cpu_isa();
  if (!(name == "auto" || name.empty())) {
    int i = 0;
    while (i < kNumIsas && name != isa_name(Isa(i))) ++i;
    TORCH_CHECK(i < kNumIsas, "kvmesh: unknown kernel ISA '", name,
                "' (choose scalar, avx2, avx512, avx512bf16, amx or auto)");
    want = std::min(Isa(i), cpu_isa());
  }
  g_active.store(int(want), std::memory_order_relaxed);
  return want;
}

}  // namespace kvmesh
