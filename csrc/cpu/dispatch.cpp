// Registers the CPU kernels for the CPU dispatch key, from one copy of csrc/cpu (csrc/cpu/isa.h).
//
// The default build has three copies: baseline (x86-64), avx2 (x86-64-v3) and avx512
// (x86-64-v4). At load, this file picks the best level the CPU runs, or the lower one the
// environment variable CRFKIT_CPU_ISA=baseline|avx2|avx512 asks for (tests, A/B timings), and
// registers that copy's function for every op of csrc/cpu/kernels.h: a call then goes straight to
// it, with nothing in between. A build of one copy (CRFKIT_ARCH=native, none or a -march name)
// registers its only copy.
//
// This file is compiled once, for the baseline, as is everything outside the kernel copies: it
// must run on any x86-64 CPU, and the torch templates m.impl instantiates stay out of the copies.

#include "dispatch.h"


#include <cstdlib>
#include <string>

#include <strings.h>  // strcasecmp

#include "kernels.h"

#define CRFKIT_STRINGIFY_(x) #x
#define CRFKIT_STRINGIFY(x) CRFKIT_STRINGIFY_(x)

namespace crfkit {
namespace cpu {

#if defined(CRFKIT_CPU_DISPATCH)
#if !defined(__x86_64__)
#error "the dispatch build is for x86-64 (setup.py builds one copy elsewhere)"
#endif
namespace baseline {
CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL)
}
namespace avx2 {
CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL)
}
namespace avx512 {
CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL)
}
#else
namespace single {
CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL)
}
#endif

namespace {

#if defined(CRFKIT_CPU_DISPATCH)
enum Level { kBaseline, kAvx2, kAvx512 };
constexpr const char* kLevelNames[] = {"baseline", "avx2", "avx512"};

// The best level this CPU runs: every feature of the x86-64-v3 / v4 level the copy was compiled
// for (-march=x86-64-v3 may use any of them). __builtin_cpu_supports also asks the operating
// system: GCC's and Clang's runtime report AVX and AVX-512 only when XCR0 (xgetbv) says the
// kernel saves the ymm / zmm and mask registers.
Level best_level() {
  __builtin_cpu_init();  // may run before the runtime's own constructor (static initialisation)
  const bool v3 = __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("movbe");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
  return v4 ? kAvx512 : v3 ? kAvx2 : kBaseline;
}

// The level to register: the best one, or the lower one CRFKIT_CPU_ISA asks for. A level above
// the best, or an unknown name, is refused with a warning (never run code the CPU lacks).
Level chosen_level() {
  static const Level level = [] {
    const Level best = best_level();
    const char* asked = std::getenv("CRFKIT_CPU_ISA");
    if (asked == nullptr || asked[0] == '\0') return best;
    for (int l = kBaseline; l <= kAvx512; ++l) {
      if (strcasecmp(asked, kLevelNames[l]) != 0) continue;
      if (l <= best) return static_cast<Level>(l);
      return best;  // crfkit/_extension.py warns
    }
    return best;  // crfkit/_extension.py warns
  }();
  return level;
}
#endif

}  // namespace

const char* cpu_isa_in_use() {
#if defined(CRFKIT_CPU_DISPATCH)
  return kLevelNames[chosen_level()];
#else
  static const std::string name = "march=" CRFKIT_STRINGIFY(CRFKIT_CPU_ARCH);
  return name.c_str();
#endif
}

// The warnings for a CRFKIT_CPU_ISA this build cannot honour are Python's (crfkit/_extension.py,
// from cpu_isa_in_use()): the stable ABI has no warning channel.
STABLE_TORCH_LIBRARY_IMPL(crfkit, CPU, m) {
#if defined(CRFKIT_CPU_DISPATCH)
  const Level level = chosen_level();
#define CRFKIT_REGISTER_CPU_KERNEL(op, ...)                                                  \
  m.impl(#op, level == kAvx512 ? TORCH_BOX(&avx512::op##_cpu)                                \
              : level == kAvx2 ? TORCH_BOX(&avx2::op##_cpu)                                  \
                               : TORCH_BOX(&baseline::op##_cpu));
#else
#define CRFKIT_REGISTER_CPU_KERNEL(op, ...) m.impl(#op, TORCH_BOX(&single::op##_cpu));
#endif
  CRFKIT_CPU_KERNELS(CRFKIT_REGISTER_CPU_KERNEL)
#undef CRFKIT_REGISTER_CPU_KERNEL
}

}  // namespace cpu
}  // namespace crfkit
