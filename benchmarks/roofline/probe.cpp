// Microbenchmarks of what this machine does per second on the kinds of work crfkit's CPU
// kernels must do (benchmarks/roofline/__init__.py turns them into a lower bound per op).
// Built at benchmark time with the kernels' own flags (-O3 -march=native -fopenmp, no fast
// math) and timed on all of torch's threads, so a rate is the machine's, not one core's.
//
//   fma_double / fma_float  multiply-adds per second: independent accumulator chains held in
//                           registers, the machine's peak (each pass: kLanes per thread)
//   exp_double              crfkit's exp (csrc/cpu/fast_exp.h) on lane vectors, per second
//   max_plus_float          out = max(out, x + row) updates per second (Viterbi / k-best work)
// Each returns the seconds that `repeats` passes took; the work per pass is in the Python.
#include <omp.h>
#include <torch/extension.h>

#include <chrono>
#include <vector>

#include "../../csrc/cpu/fast_exp.h"
#include "../../csrc/cpu/lanes.h"

namespace {

constexpr int kLanes = 256;  // elements per thread: in L1, many independent chains

template <typename F>
double timed_parallel(int64_t repeats, F&& body) {
  const auto begin = std::chrono::steady_clock::now();
  double sink = 0;
#pragma omp parallel reduction(+ : sink)
  { sink += body(repeats); }
  const auto end = std::chrono::steady_clock::now();
  if (sink == 42.4242) std::printf(" ");  // keep the work observable
  return std::chrono::duration<double>(end - begin).count();
}

// 512 bytes of independent chains (8 AVX-512 / 16 AVX2 registers): enough chains to cover the
// FMA latency on both FMA pipes, few enough to stay in registers.
template <typename scalar_t>
double fma(int64_t repeats) {
  return timed_parallel(repeats, [](int64_t n) {
    constexpr int kChains = 512 / sizeof(scalar_t);
    scalar_t acc[kChains];
    for (int j = 0; j < kChains; ++j) acc[j] = scalar_t(1) + scalar_t(j) * scalar_t(1e-3);
    const scalar_t a = scalar_t(0.999999), b = scalar_t(1e-7);
    for (int64_t r = 0; r < n * (kLanes / kChains); ++r) {
#pragma GCC unroll 128
      for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * a + b;
    }
    double s = 0;
    for (int j = 0; j < kChains; ++j) s += acc[j];
    return s;
  });
}

// In lane vectors of doubles, the form the batch-lane kernels call (prob_lanes.h): GCC does not
// vectorise the scalar exp_nonpositive loop in every build (AVX2: its int64 bit arithmetic), and
// a scalar rate made the lanes' log Z pass 100% of its roofline there (2026-11-23: 0.39 G/s).
double exp_double(int64_t repeats) {
  using Vector = crfkit::cpu::Lanes<double>::Vector;
  using Mask = crfkit::cpu::Lanes<double>::Mask;
  constexpr int kPerVector = crfkit::cpu::Lanes<double>::kCount;
  constexpr int kVectors = kLanes / kPerVector;
  return timed_parallel(repeats, [](int64_t n) {
    std::vector<Vector> x(kVectors), out(kVectors);
    for (int j = 0; j < kVectors; ++j) {
      for (int i = 0; i < kPerVector; ++i) x[j][i] = -0.01 * static_cast<double>(j * kPerVector + i);
    }
    double s = 0;
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < kVectors; ++j) out[j] = crfkit::cpu::exp_nonpositive_generic<Vector, Mask>(x[j]);
      s += out[r % kVectors][0];
      x[r % kVectors][0] -= 1e-9;  // the next pass is not the same computation
    }
    return s;
  });
}

double max_plus_float(int64_t repeats) {
  return timed_parallel(repeats, [](int64_t n) {
    std::vector<float> out(kLanes, 0.f), row(kLanes);
    for (int j = 0; j < kLanes; ++j) row[j] = -0.001f * j;
    float x = -1.f;
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < kLanes; ++j) out[j] = std::max(out[j], x + row[j]);
      x += 1e-6f;
    }
    double s = 0;
    for (int j = 0; j < kLanes; ++j) s += out[j];
    return s;
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lanes", [] { return kLanes; });
  m.def("threads", [] { return omp_get_max_threads(); });
  m.def("fma_double", &fma<double>);
  m.def("fma_float", &fma<float>);
  m.def("exp_double", &exp_double);
  m.def("max_plus_float", &max_plus_float);
}
