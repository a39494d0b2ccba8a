// Op registration: TORCH_LIBRARY(kvmesh) schemas and their CPU implementations (all of csrc/ but
// the GEMM's, which gemm/gemm_ops.cpp registers as a fragment of the library), plus the
// Python module (isa selection). Fake (meta) implementations are registered from Python
// (workers/kernels/__init__.py) with torch.library.register_fake.
#include <torch/extension.h>
#include <torch/library.h>

#include "dispatch.h"

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
}  // namespace kvmesh

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
        "Best kernel path this CPU supports.");
  m.def("active_isa", [] { return std::string(kvmesh::isa_name(kvmesh::active_isa())); },
        "Kernel path in use.");
  m.def("set_isa", &kvmesh::set_isa, "Select the kernel path (scalar, avx2, avx512, auto); returns the active one.");
}
