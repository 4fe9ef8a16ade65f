// Which instruction-set path the kernels take, decided once at load and changeable only to a
// lower path (for tests): one process-wide level that every kernel reads before it picks code.
//
//   kPortable    no hand-written intrinsics, no MKL: products by the blocked loop in gemm.h
//   kAvx2        MKL's sgemm_/dgemm_ for fp32/fp64 products; bf16 operands widened to fp32
//   kAvx512Bf16  bf16 products by the vdpbf16ps micro-kernel (gemm_bf16.h)
//   kAmx         bf16 products by oneDNN's brgemm (at::native::cpublas::brgemm: AMX tiles)
//
// The level is a runtime choice; what a build *can* run is fixed when it is compiled (the
// flags below), so the Python side (dispatch.py) takes the lower of the CPU's flags, the build's
// abilities and FASTWEIGHTS_CPU_ISA, and sets it here through set_isa.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <atomic>

namespace fastweights {
namespace cpu {

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512Bf16 = 2, kAmx = 3 };

// MKL's BLAS symbols are exported by x86 builds of libtorch_cpu; the builder defines
// FASTWEIGHTS_MKL only where torch reports MKL (elsewhere the portable products run).
#if defined(FASTWEIGHTS_MKL)
constexpr bool kBuildHasMkl = true;
#else
constexpr bool kBuildHasMkl = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr bool kBuildHasAvx512Bf16 = true;
#else
constexpr bool kBuildHasAvx512Bf16 = false;
#endif

// torch's header defines the macro where its brgemm takes bf16; oneDNN's ukernels exist on x86 only.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && (defined(__x86_64__) || defined(_M_X64))
constexpr bool kBuildHasBrgemm = true;
#else
constexpr bool kBuildHasBrgemm = false;
#endif

// The highest level this build can run (the CPU may allow less; dispatch.py decides).
constexpr int kBuildMaxIsa = !kBuildHasMkl ? kPortable
                             : kBuildHasBrgemm && kBuildHasAvx512Bf16 ? kAmx
                             : kBuildHasAvx512Bf16 ? kAvx512Bf16
                                                   : kAvx2;

// One slot per loaded library (an inline function's static is shared by every translation unit).
inline std::atomic<int>& isa_slot() {
  static std::atomic<int> level{kBuildMaxIsa == kAmx ? int(kAvx512Bf16) : kBuildMaxIsa};  // AMX only when asked
  return level;
}
inline int isa() { return isa_slot().load(std::memory_order_relaxed); }

}  // namespace cpu
}  // namespace fastweights
