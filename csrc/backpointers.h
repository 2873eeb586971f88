// Backpointer storage shared by the CPU and CUDA decoders.
#pragma once

#include <cstdint>

namespace crfkit {
#ifdef CRFKIT_CPU_ISA  // a copy of the CPU kernels (csrc/cpu/isa.h): functions of its own
inline namespace CRFKIT_CPU_ISA {
#endif

// Backpointers are stored in the smallest unsigned type that holds every code
// (code = predecessor tag * K + predecessor rank < num_codes = T * K): calls f with a value of
// that type, uint8_t, uint16_t or uint32_t.
template <typename F>
void dispatch_backpointer_type(int64_t num_codes, F&& f) {
  if (num_codes <= 256) {
    f(uint8_t{});
  } else if (num_codes <= 65536) {
    f(uint16_t{});
  } else {
    f(uint32_t{});
  }
}

#ifdef CRFKIT_CPU_ISA
}  // namespace CRFKIT_CPU_ISA
#endif
}  // namespace crfkit
