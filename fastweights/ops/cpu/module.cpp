// The extension's one module definition: every kernel family registers itself from its own
// source file; the ISA level (isa.h) is read and set here.
#include <torch/extension.h>

#include "isa.h"

void register_chunk_delta(pybind11::module& m);       // chunk_delta.cpp
void register_chunk_delta_bf16(pybind11::module& m);  // chunk_delta_bf16.cpp
void register_gemm_bf16(pybind11::module& m);         // gemm_bf16_check.cpp (test and benchmark entry points)
void register_decode_step(pybind11::module& m);       // decode_step.cpp
void register_short_conv(pybind11::module& m);        // short_conv.cpp
void register_l2norm(pybind11::module& m);            // l2norm.cpp
void register_chunk_linear_attn(pybind11::module& m); // chunk_linear_attn.cpp
void register_chunk_kda(pybind11::module& m);         // chunk_kda.cpp
void register_chunk_kda_bf16(pybind11::module& m);    // chunk_kda_bf16.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the ISA level: fastweights/ops/cpu/dispatch.py reads what the build can run and sets what the kernels take
  namespace fc = fastweights::cpu;
  m.def("set_isa", [](int64_t level) {
    TORCH_CHECK(level >= fc::kPortable && level <= fc::kBuildMaxIsa, "set_isa: `level` must be in [0, ",
                fc::kBuildMaxIsa, "] for this build, got ", level);
    fc::isa_slot().store(int(level), std::memory_order_relaxed);
  }, "the ISA path every kernel takes from now on (0 portable, 1 avx2, 2 avx512bf16, 3 amx)", pybind11::arg("level"));
  m.def("isa", &fc::isa, "the ISA path the kernels take now");
  m.attr("build_max_isa") = int(fc::kBuildMaxIsa);
  m.attr("build_has_mkl") = fc::kBuildHasMkl;
  m.attr("build_has_brgemm") = fc::kBuildHasBrgemm;
  register_chunk_delta(m);
  register_chunk_delta_bf16(m);
  register_gemm_bf16(m);
  register_decode_step(m);
  register_short_conv(m);
  register_l2norm(m);
  register_chunk_linear_attn(m);
  register_chunk_kda(m);
  register_chunk_kda_bf16(m);
}
