// The instruction-set level a copy of the CPU kernels is compiled for.
//
// setup.py compiles every kernel file of csrc/cpu/ once per level, with that level's -march and
// -DCRFKIT_CPU_ISA=<level>: baseline (x86-64), avx2 (x86-64-v3) and avx512 (x86-64-v4) in the
// default, portable build; one copy, `single`, when CRFKIT_ARCH names one target. Everything a
// kernel file defines, and everything in the csrc/cpu headers (and csrc/checks.h, numerics.h,
// backpointers.h) it includes, lives in the inline namespace crfkit::cpu::CRFKIT_CPU_ISA, so the
// copies share no symbol: the linker cannot replace one copy's out-of-line inline function by
// another's (a CPU without AVX-512 would then run AVX-512 code). csrc/cpu/dispatch.cpp, compiled
// once for the baseline, registers the kernels of the copy the CPU runs.
#pragma once

#include "../tensor.h"

#ifndef CRFKIT_CPU_ISA
#define CRFKIT_CPU_ISA single  // a file compiled on its own (an editor, a one-off build)
#endif

// A kernel file does not register its op: compiled once per level, every copy would register
// itself and the last one loaded would win, whatever the CPU. List the kernel in
// csrc/cpu/kernels.h instead; csrc/cpu/dispatch.cpp registers it.
#undef STABLE_TORCH_LIBRARY_IMPL
#define STABLE_TORCH_LIBRARY_IMPL(ns, key, m)                                                      \
  static_assert(false, "csrc/cpu kernel files do not register ops: list the kernel in "            \
                       "csrc/cpu/kernels.h, csrc/cpu/dispatch.cpp registers it");                \
  [[maybe_unused]] static void crfkit_unregistered_kernels(int m)

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// torch's intra-op thread pool (torch::stable::parallel_for), setting crfkit's in_parallel_region()
// flag (csrc/tensor.h) inside each task. In each copy's namespace: its instantiations are that
// copy's code (tools/check_isa_symbols.py attributes them by name). Do not throw inside a task:
// the exception would reach Python as a RuntimeError naming torch's shim, not as crfkit's message
// (the kernels record bad input per sentence and raise after the loop).
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
  torch::stable::parallel_for(begin, end, grain_size, [&f](int64_t task_begin, int64_t task_end) {
    struct Flag {
      bool outer = detail::in_parallel_task;
      Flag() { detail::in_parallel_task = true; }
      ~Flag() { detail::in_parallel_task = outer; }
    } flag;
    f(task_begin, task_end);
  });
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
