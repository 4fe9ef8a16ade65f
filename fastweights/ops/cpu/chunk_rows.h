// What the KDA and linear-attention chunk kernels add to chunk_common.h: a bump allocator over a
// task's scratch block, and the gather / scatter of one head's chunk rows.
#pragma once

#include "chunk_common.h"

namespace fastweights {
namespace cpu {
namespace chunk {

using ::fastweights::cpu::mm;
using ::fastweights::cpu::round16;

// Bump allocator over one task's scratch block (sizes rounded to 16 elements).
template <typename T>
struct Carve {
  T* p;
  T* take(int64_t count) {
    T* out = p;
    p += round16(count);
    return out;
  }
};

// Rows t0 .. t0 + C − 1 of one head's strided [T, width] rows into dense dst [C, ld]; rows at
// or past `length` are zeros (a no-op token for every rule here).
template <typename T>
inline void gather_rows(const T* src, int64_t stride, int64_t t0, int64_t length, int64_t C, int64_t width, T* dst,
                        int64_t ld) {
  for (int64_t i = 0; i < C; ++i) {
    if (t0 + i < length) std::memcpy(dst + i * ld, src + (t0 + i) * stride, sizeof(T) * width);
    else std::fill(dst + i * ld, dst + i * ld + width, T(0));
  }
}

// The inverse: rows of a dense [C, ld] tile into the token-major buffer [N, NC·C, H, width] at
// (n, t0, h); the buffer has NC·C rows, so the padded tail is written too and dropped in Python.
template <typename T>
inline void scatter_rows(const T* src, int64_t ld, int64_t C, int64_t width, T* buffer, int64_t n, int64_t NCC,
                         int64_t H, int64_t hh, int64_t t0) {
  for (int64_t i = 0; i < C; ++i)
    std::memcpy(buffer + ((n * NCC + t0 + i) * H + hh) * width, src + i * ld, sizeof(T) * width);
}

}  // namespace chunk
}  // namespace cpu
}  // namespace fastweights
