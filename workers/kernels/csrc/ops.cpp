// Op registration: TORCH_LIBRARY(kvmesh) schemas and their CPU implementations (all of csrc/ but
// the GEMMs', which gemm/*.cpp register as fragments of the library), plus the Python module:
// the kernel level (isa.h) and the path each kernel family takes at it. Fake (meta)
// implementations are registered from Python (workers/kernels/__init__.py) with
// torch.library.register_fake.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>   // the module's functions take and return strings: no tensor crosses it
#include <pybind11/stl.h>
#include <torch/library.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "dispatch.h"
#include "isa.h"

namespace kvmesh {
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& kv_data, const std::optional<at::Tensor>& scales,
                               const at::Tensor& qsl, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                               double scale, const std::optional<at::Tensor>& prefix_group,
                               const std::optional<at::Tensor>& prefix_block_tables,
                               const std::optional<at::Tensor>& prefix_lens);
void reshape_and_cache_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data,
                           const std::optional<at::Tensor>& scales, const at::Tensor& slot_mapping);
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);               // norm.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps);
at::Tensor silu_and_mul_bf16_cpu(const at::Tensor& x);                                             // activation.cpp
at::Tensor rotary_bf16_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);     // rotary.cpp
// the path (a level's name, or "none": the op raises) each family takes at a level
const char* kv_write_path(Isa);          // cache_write.cpp
const char* norm_path(Isa);              // norm.cpp
const char* rotary_path(Isa);            // rotary.cpp
const char* silu_path(Isa);              // activation.cpp
}  // namespace kvmesh
namespace kvmesh_gemm {
const char* gemm_path(kvmesh::Isa);      // gemm/gemm_ops.cpp
const char* int4_path(kvmesh::Isa);      // gemm/int4_gemv.cpp
const char* int8_path(kvmesh::Isa);      // gemm/int8_gemv.cpp
const char* gguf_path(kvmesh::Isa);      // gemm/gguf_gemm.cpp
}  // namespace kvmesh_gemm

namespace {
// {op: the path it takes at the active level}; paged_attention's for head dims that are
// multiples of 32 (others: dispatch.h)
std::map<std::string, std::string> kernel_paths() {
  using namespace kvmesh;
  const Isa i = active_isa();
  return {{"paged_attention", attention_path(i, 64)}, {"reshape_and_cache", kv_write_path(i)},
          {"bf16_linear", kvmesh_gemm::gemm_path(i)},  {"int4_linear", kvmesh_gemm::int4_path(i)},
          {"int8_linear", kvmesh_gemm::int8_path(i)},  {"gguf_linear", kvmesh_gemm::gguf_path(i)},
          {"rms_norm", norm_path(i)},                  {"rotary_bf16", rotary_path(i)},
          {"silu_and_mul_bf16", silu_path(i)}};
}
}  // namespace

TORCH_LIBRARY(kvmesh, m) {
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) kv_data, Tensor(b!)? scales, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor kv_data, Tensor? scales, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, Tensor? prefix_group=None, Tensor? prefix_block_tables=None, "
        "Tensor? prefix_lens=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul_bf16(Tensor x) -> Tensor");
  m.def("rotary_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("reshape_and_cache", &kvmesh::reshape_and_cache_cpu);
  m.impl("paged_attention", &kvmesh::paged_attention_cpu);
  m.impl("rms_norm", &kvmesh::rms_norm_cpu);
  m.impl("add_rms_norm", &kvmesh::add_rms_norm_cpu);
  m.impl("silu_and_mul_bf16", &kvmesh::silu_and_mul_bf16_cpu);
  m.impl("rotary_bf16", &kvmesh::rotary_bf16_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_isa", [] { return std::string(kvmesh::isa_name(kvmesh::cpu_isa())); },
        "The best kernel level this CPU supports.");
  m.def("active_isa", [] { return std::string(kvmesh::isa_name(kvmesh::active_isa())); },
        "The kernel level in use.");
  m.def("set_isa", [](const std::string& name) { return std::string(kvmesh::isa_name(kvmesh::set_isa(name))); },
        "Select the kernel level (scalar, avx2, avx512, avx512bf16, amx, auto; one above the CPU's is lowered "
        "to it); returns the level now in use.");
  m.def("paths", &kernel_paths, "{op: the path it takes at the active level}.");
}
