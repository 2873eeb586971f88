// Which copy of the CPU kernels csrc/cpu/dispatch.cpp registered (crfkit._C.cpu_isa()).
#pragma once

namespace crfkit {
namespace cpu {

// "baseline", "avx2" or "avx512" in the default build (the best level the CPU runs, or the lower
// one CRFKIT_CPU_ISA asked for); "march=<name>" in a build of one copy (CRFKIT_ARCH=<name>).
const char* cpu_isa_in_use();

}  // namespace cpu
}  // namespace crfkit
