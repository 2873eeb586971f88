// exp(x) for x <= 0 (-inf included), branch-free so that loops over arrays vectorise.
//
// The probability-space path exponentiates shifted scores (x - max <= 0) at every position;
// std::exp is a library call per element. This is the textbook reduction
//     exp(x) = 2^k * exp(r),  k = round(x / ln 2),  r = x - k ln 2 in [-ln2/2, ln2/2]
// with exp(r) by its Taylor polynomial of degree 13 (remainder < 5e-18 relative, below half an
// ulp of a double), and 2^k assembled in the exponent bits. Arguments below -708 (where 2^k
// would leave the normal range) and -inf give exactly 0. Accuracy: about 1 ulp of std::exp.
#pragma once

#include <bit>
#include <cstdint>

#include "isa.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// Real is double (Int = int64_t) or a vector of doubles (Int = the matching int64 vector, for the
// batch-lane kernels of prob_lanes.h): one body, so that both compute the same bits.
template <typename Real, typename Int>
inline Real exp_nonpositive_generic(Real x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 0.6931471803691238;      // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact
  constexpr double kLn2Lo = 1.9082149292705877e-10;  // in few bits so that k * kLn2Hi is exact
  constexpr double kShifter = 0x1.8p52;               // adding it rounds to an integer
  const Real min_arg = Real{} + (-708.0);
  const Real xc = x < min_arg ? min_arg : x;
  const Real shifted = xc * kLog2e + kShifter;
  const Real kf = shifted - kShifter;  // round(x / ln 2)
  const Int k = std::bit_cast<Int>(shifted) - std::bit_cast<int64_t>(kShifter);
  const Real r = (xc - kf * kLn2Hi) - kf * kLn2Lo;
  Real p = Real{} + 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const Real scale = std::bit_cast<Real>((k + 1023) << 52);
  return x < min_arg ? Real{} : p * scale;
}

inline double exp_nonpositive(double x) { return exp_nonpositive_generic<double, int64_t>(x); }

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
