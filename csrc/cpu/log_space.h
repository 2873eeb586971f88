// Log-space building blocks of the CPU forward / backward recursions.
//
// The recursions need alpha_next[t] = logsumexp_s(alpha[s] + trans[s, t]). Done literally that
// is T*T exponentials per position. Instead we factor the exponent:
//     exp(alpha[s] + trans[s, t]) = exp(a_max) * exp(col_max[t]) * p[s] * E[t][s]
// with p[s] = exp(alpha[s] - a_max) and E[t][s] = exp(trans[s, t] - col_max[t]) computed once
// per call, so a position costs T exponentials, a T x T matrix-vector product and T logs.
// Every factor is <= 1, so nothing overflows; the one risk is underflow, when the terms that
// matter are far below exp(a_max + col_max[t]). The dot product is then tiny, and whenever it
// falls below `trusted_sum_min` (csrc/numerics.h) we recompute that column exactly in log
// space. The exact path is what the reference does; the fast path agrees with it to rounding
// (tests/test_parity.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../numerics.h"  // trusted_sum_min, pairwise_fast_bound
#include "isa.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

template <typename scalar_t>
constexpr scalar_t neg_inf() {
  return -std::numeric_limits<scalar_t>::infinity();
}

template <typename scalar_t>
inline scalar_t max_of(const scalar_t* x, int64_t n) {
  scalar_t m = neg_inf<scalar_t>();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// logsumexp_i(x[i * stride] + y[i * stride]) exactly; -inf when every term is -inf.
template <typename scalar_t>
inline scalar_t logsumexp_sum(const scalar_t* x, int64_t x_stride, const scalar_t* y,
                              int64_t y_stride, int64_t n) {
  scalar_t m = neg_inf<scalar_t>();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i * x_stride] + y[i * y_stride]);
  if (m == neg_inf<scalar_t>()) return m;
  scalar_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i * x_stride] + y[i * y_stride] - m);
  return m + std::log(s);
}

template <typename scalar_t>
inline scalar_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  scalar_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// trans[s, t] = line_max + log(scaled[.]) along one axis, precomputed once per call.
// `by_column` (forward): scaled is [t][s] = exp(trans[s, t] - col_max[t]).
// by row (backward):     scaled is [s][t] = exp(trans[s, t] - row_max[s]).
// A line that is entirely -inf has max -inf and scaled entries 0 (never NaN).
template <typename scalar_t>
struct ScaledTransitions {
  int64_t T = 0;
  std::vector<scalar_t> line_max;  // (T,)
  std::vector<scalar_t> scaled;    // (T, T), the line index first

  ScaledTransitions(const scalar_t* trans, int64_t num_tags, bool by_column)
      : T(num_tags), line_max(num_tags, neg_inf<scalar_t>()), scaled(num_tags * num_tags, 0) {
    auto at = [&](int64_t line, int64_t k) {
      return by_column ? trans[k * T + line] : trans[line * T + k];
    };
    for (int64_t line = 0; line < T; ++line) {
      for (int64_t k = 0; k < T; ++k) line_max[line] = std::max(line_max[line], at(line, k));
      if (line_max[line] == neg_inf<scalar_t>()) continue;
      for (int64_t k = 0; k < T; ++k) scaled[line * T + k] = std::exp(at(line, k) - line_max[line]);
    }
  }
};

// out[t] = logsumexp_s(alpha[s] + trans[s, t]) + emit[t]   (one forward step).
// `p` is scratch of size T. by_col must be ScaledTransitions(trans, T, /*by_column=*/true).
template <typename scalar_t>
inline void forward_step(const scalar_t* alpha, const scalar_t* trans,
                         const ScaledTransitions<scalar_t>& by_col, const scalar_t* emit,
                         scalar_t* out, scalar_t* p) {
  const int64_t T = by_col.T;
  const scalar_t a_max = max_of(alpha, T);
  if (a_max == neg_inf<scalar_t>()) {
    std::fill(out, out + T, neg_inf<scalar_t>());
    return;
  }
  for (int64_t s = 0; s < T; ++s) p[s] = std::exp(alpha[s] - a_max);
  for (int64_t t = 0; t < T; ++t) {
    const scalar_t c_max = by_col.line_max[t];
    if (c_max == neg_inf<scalar_t>()) {
      out[t] = neg_inf<scalar_t>();
      continue;
    }
    const scalar_t sum = dot(&by_col.scaled[t * T], p, T);
    const scalar_t lse = sum >= trusted_sum_min<scalar_t>()
                             ? a_max + c_max + std::log(sum)
                             : logsumexp_sum(alpha, 1, trans + t, T, T);
    out[t] = lse + emit[t];
  }
}

// out[s] = logsumexp_t(trans[s, t] + v[t])   (one backward step, v = emit_next + beta_next).
// `q` is scratch of size T. by_row must be ScaledTransitions(trans, T, /*by_column=*/false).
template <typename scalar_t>
inline void backward_step(const scalar_t* v, const scalar_t* trans,
                          const ScaledTransitions<scalar_t>& by_row, scalar_t* out, scalar_t* q) {
  const int64_t T = by_row.T;
  const scalar_t v_max = max_of(v, T);
  if (v_max == neg_inf<scalar_t>()) {
    std::fill(out, out + T, neg_inf<scalar_t>());
    return;
  }
  for (int64_t t = 0; t < T; ++t) q[t] = std::exp(v[t] - v_max);
  for (int64_t s = 0; s < T; ++s) {
    const scalar_t r_max = by_row.line_max[s];
    if (r_max == neg_inf<scalar_t>()) {
      out[s] = neg_inf<scalar_t>();
      continue;
    }
    const scalar_t sum = dot(&by_row.scaled[s * T], q, T);
    out[s] = sum >= trusted_sum_min<scalar_t>() ? v_max + r_max + std::log(sum)
                                                : logsumexp_sum(v, 1, trans + s * T, 1, T);
  }
}

// Shift x in place so that its maximum is 0 and return the shift (-inf if all are -inf, in
// which case x is left as it is). Keeping the per-position vectors near 0 and the running
// offsets in double keeps float32 accurate for long sentences with large scores.
template <typename scalar_t>
inline double normalise(scalar_t* x, int64_t n) {
  const scalar_t m = max_of(x, n);
  if (m == neg_inf<scalar_t>()) return -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) x[i] -= m;
  return static_cast<double>(m);
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
