// The one instruction-set switch of kvmesh's kernels (as llama.cpp's ggml-cpu: the CPU's
// features are detected once, at run time, in one place, and every kernel family asks here
// which level to run). isa.cpp implements it; workers/kernels/__init__.py sets it from the
// kernel_isa setting (KVMESH_KERNEL_ISA) once per process, at load.
//
// Levels, lowest first (each includes the ones below it):
//   scalar      baseline x86-64 code (what the compiler makes of plain loops; SSE2 at most)
//   avx2        AVX2 + FMA + F16C
//   avx512      + AVX-512 F, BW, VL and DQ (Skylake-SP and later, AMD Zen 4 and later)
//   avx512bf16  + AVX512-BF16
//   amx         + AMX-TILE and AMX-BF16, with the tile state granted by the kernel
// A kernel family with no code at a level runs its nearest lower one (its docstring says
// which levels it has); features beyond the ladder that one family alone uses (AVX512-VNNI
// and AMX-INT8 for the GGUF kernel) are asked for with the cpu_has_* functions below.
#pragma once
#include <string>

namespace kvmesh {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
constexpr int kNumIsas = 5;

// "scalar", "avx2", "avx512", "avx512bf16" or "amx"
const char* isa_name(Isa);

// The best level this CPU supports (detected on the first call, then cached).
Isa cpu_isa();

// The level in use: cpu_isa() until set_isa chose another. One relaxed atomic load: the
// kernels call it once per op call.
Isa active_isa();

// Selects the level by name ("scalar", "avx2", "avx512", "avx512bf16", "amx", or "auto" /
// "" for cpu_isa()). A level above cpu_isa() is lowered to it (the caller, which knows the
// name it was given, logs that). Returns the level now in use. Throws c10::Error
// (RuntimeError in Python) on an unknown name, leaving the level unchanged.
Isa set_isa(const std::string& name);

// Features beyond the ladder (detected once; AMX ones also ask Linux for the tile state).
bool cpu_has_amx_bf16();
bool cpu_has_amx_int8();
bool cpu_has_avx512vnni();

}  // namespace kvmesh
