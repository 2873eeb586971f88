// Numeric thresholds that every backend must share for its results to agree: the C++ CPU
// kernels (csrc/cpu/), the CUDA kernels (csrc/cuda/) and the numba kernels
// (crfkit/backends/numba_kernels.py, which cannot include this header: tests/test_numerics_header.py
// parses this file and holds its constants to the numba module's). One definition here, included
// by both CPU and CUDA code; it compiles with g++ and nvcc (__host__ __device__ under nvcc).
#pragma once

#ifdef __CUDACC__
#define CRFKIT_HOST_DEVICE __host__ __device__
#else
#define CRFKIT_HOST_DEVICE
#endif

namespace crfkit {
#ifdef CRFKIT_CPU_ISA  // a copy of the CPU kernels (csrc/cpu/isa.h): functions of its own
inline namespace CRFKIT_CPU_ISA {
#endif

// The smallest trusted probability-space sum. The log-space recursions factor
// logsumexp_s(alpha[s] + trans[s, t]) into a max plus the log of a sum of terms <= 1; a sum of
// positive terms at or above this value has lost at most T * min_normal to underflow, i.e. far
// less than one unit in the last place of the sum: it is trusted as it is. Below it the column
// is recomputed exactly in log space.
template <typename scalar_t>
CRFKIT_HOST_DEVICE constexpr scalar_t trusted_sum_min();
template <>
CRFKIT_HOST_DEVICE constexpr float trusted_sum_min<float>() { return 0x1p-92f; }
template <>
CRFKIT_HOST_DEVICE constexpr double trusted_sum_min<double>() { return 0x1p-960; }

// The pairwise (transition) marginals use exp(w) * p[s] * E[t][s]; for an exponent shift w at
// most this bound a term lost to underflow is below exp(log(min_normal) + bound), which is
// negligible next to the probabilities (<= 1) being accumulated (about 1e-29 for float, 1e-47
// for double). Above it the terms are computed exactly.
template <typename scalar_t>
CRFKIT_HOST_DEVICE constexpr scalar_t pairwise_fast_bound();
template <>
CRFKIT_HOST_DEVICE constexpr float pairwise_fast_bound<float>() { return 20.0f; }
template <>
CRFKIT_HOST_DEVICE constexpr double pairwise_fast_bound<double>() { return 600.0; }

#ifdef CRFKIT_CPU_ISA
}  // namespace CRFKIT_CPU_ISA
#endif
}  // namespace crfkit
