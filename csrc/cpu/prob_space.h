// Probability-space forward-backward: the fast path of log Z, marginals and their backward.
//
// In log space every position costs T exponentials and T logarithms (csrc/cpu/log_space.h).
// Here the recursions run on scaled probabilities instead:
//     a_i[t] = alpha_i[t] - c_i  exponentiated and scaled so that max_t a_i[t] = 1,
//     a_i[t] = (sum_s a_{i-1}[s] E[s, t]) * w_i[t] / m_i,   E = exp(trans - max trans),
//                                                           w_i = exp(emit_i - max emit_i),
// so a position costs one T x T matrix-vector product and one logarithm (of the scale m_i).
// Marginals and pairwise marginals are products of a, E, w and the scaled beta, normalised per
// position (they sum to one), so the backward needs no transcendental function at all.
//
// Accumulation is in double for every input dtype. The one risk of probability space is
// underflow: a state whose probability is representable in log space but not as a scaled
// double. Every scaled quantity that can matter is checked to stay at or above `kMinScaled`
// relative to its position's maximum (and E, w_end likewise); with products of at most five
// such factors nothing reaches the subnormal range. A sentence that fails a check returns
// false and the caller recomputes it exactly in log space (in practice: position-wise score
// ranges above ~100 nats, e.g. scores of magnitude 1e4). Forbidden (-inf) scores are exact
// zeros here and need no check.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace crfkit {
namespace cpu {

constexpr double kMinScaled = 0x1p-150;  // e^-104: the dynamic range kept per position

// exp(x - x_max) for the finite entries of x (0 for -inf), and x_max; `ok` is cleared when a
// finite entry falls below kMinScaled (its probability would not survive the products).
template <typename scalar_t>
inline double exp_shifted(const scalar_t* x, int64_t n, double* __restrict__ out, bool& ok) {
  double x_max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) x_max = std::max(x_max, static_cast<double>(x[i]));
  if (x_max == -std::numeric_limits<double>::infinity()) {
    std::fill(out, out + n, 0.0);
    return x_max;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = exp_nonpositive(static_cast<double>(x[i]) - x_max);
  bool in_range = true;
  for (int64_t i = 0; i < n; ++i) {
    in_range &= (out[i] >= kMinScaled) | (x[i] == -std::numeric_limits<scalar_t>::infinity());
  }
  ok = ok && in_range;
  return x_max;
}

// Per call: transitions and end scores exponentiated once.
struct ProbTables {
  int64_t T = 0;
  bool usable = true;            // false: some finite transition / end score is out of range
  double trans_max = 0;          // max finite transition (0 when all are -inf)
  double end_max = 0;
  std::vector<double> by_col;    // [t][s] = exp(trans[s, t] - trans_max)
  std::vector<double> by_row;    // [s][t] = the same, row-major
  std::vector<double> end_w;     // exp(end[t] - end_max)

  template <typename scalar_t>
  ProbTables(const scalar_t* trans, const scalar_t* end, int64_t num_tags)
      : T(num_tags), by_col(num_tags * num_tags), by_row(num_tags * num_tags), end_w(num_tags) {
    const double max_t = exp_shifted(trans, T * T, by_row.data(), usable);
    trans_max = max_t == -std::numeric_limits<double>::infinity() ? 0.0 : max_t;
    for (int64_t s = 0; s < T; ++s)
      for (int64_t t = 0; t < T; ++t) by_col[t * T + s] = by_row[s * T + t];
    end_max = exp_shifted(end, T, end_w.data(), usable);
  }
};

// out[j] = sum_k x[k] * m[k * T + j] for a T x T row-major m. Written as a sum of scaled rows
// (each out[j] still accumulates in k order) rather than as dot products, because without
// -ffast-math the compiler may not reorder a dot product's sum and so would not vectorise it;
// here the inner loop runs over independent outputs and vectorises as it is.
inline void axpy_rows(const double* __restrict__ m, const double* __restrict__ x, int64_t T,
                      double* __restrict__ out) {
  std::fill(out, out + T, 0.0);
  for (int64_t k = 0; k < T; ++k) {
    const double xk = x[k];
    if (xk == 0) continue;  // unreachable states (and forbidden tags) contribute nothing
    const double* row = m + k * T;
    for (int64_t j = 0; j < T; ++j) out[j] += xk * row[j];
  }
}

inline double max_of_doubles(const double* x, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Scaled forward pass of one sentence (n >= 1). With keep_rows, a_rows (n, T) and w_rows (n, T)
// keep what the backward needs; otherwise a_rows holds two rolling rows. Writes log Z and
// returns false if the sentence needs the exact log-space path.
template <typename scalar_t>
bool prob_forward(const scalar_t* emit, const scalar_t* start, const ProbTables& tab, int64_t n,
                  bool keep_rows, double* a_rows, double* w_rows, double* d, double* log_z) {
  const int64_t T = tab.T;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  bool ok = true;
  double* a = a_rows;
  for (int64_t t = 0; t < T; ++t) d[t] = static_cast<double>(start[t]) + emit[t];
  double log_scale = exp_shifted(d, T, a, ok);  // a_0 = exp(start + emit_0 - max)
  if (keep_rows) std::fill(w_rows, w_rows + T, 1.0);  // unused at position 0
  if (!ok) return false;
  if (log_scale == neg_inf) {
    *log_z = neg_inf;
    return true;
  }
  for (int64_t i = 1; i < n; ++i) {
    const double* a_prev = a;
    a = keep_rows ? a_rows + i * T : a_rows + (i % 2) * T;
    double* w = keep_rows ? w_rows + i * T : d + T;  // d has room for 2T
    const double emit_max = exp_shifted(emit + i * T, T, w, ok);
    if (emit_max == neg_inf) {  // every tag forbidden here
      *log_z = neg_inf;
      return ok;
    }
    axpy_rows(tab.by_row.data(), a_prev, T, d);  // d[t] = sum_s a_prev[s] E[s, t]
    double m = 0;
    for (int64_t t = 0; t < T; ++t) m = std::max(m, a[t] = d[t] * w[t]);
    if (m == 0) {  // no state reachable (underflow is excluded by the checks): log Z = -inf
      *log_z = neg_inf;
      return ok;
    }
    const double inv_m = 1.0 / m;
    for (int64_t t = 0; t < T; ++t) {
      a[t] *= inv_m;
      // A reachable state (d > 0, allowed emission) must keep a representable probability.
      // (An allowed emission far below the maximum was already caught by exp_shifted.)
      if (d[t] > 0 && w[t] > 0 && a[t] < kMinScaled) ok = false;
    }
    if (!ok) return false;
    log_scale += tab.trans_max + emit_max + std::log(m);
  }
  double z = 0;
  for (int64_t t = 0; t < T; ++t) z += a[t] * tab.end_w[t];
  *log_z = z > 0 ? log_scale + tab.end_max + std::log(z) : neg_inf;
  return ok;
}

// Scaled backward pass of one sentence after prob_forward(keep_rows) with finite log Z:
// marginals scaled by g into grad_emit (n, T); with kPairwise the transition (T, T, added),
// start and end gradients too. Returns false if the sentence needs the exact path (the caller
// then discards everything written here). pair_acc: T * T doubles of scratch (kPairwise).
template <typename scalar_t, bool kPairwise>
bool prob_backward(const ProbTables& tab, int64_t n, const double* a_rows, const double* w_rows,
                   scalar_t g, scalar_t* grad_emit, scalar_t* grad_trans, scalar_t* grad_start,
                   scalar_t* grad_end, double* b, double* work, double* pair_acc) {
  const int64_t T = tab.T;
  double* gw = work;       // w_i * b_i, scaled
  double* b_prev = work + T;
  // The pairwise marginals xi_i[s, t] = u_i[s] E[s, t] gw_i[t] share the factor E[s, t] at every
  // position: accumulate sum_i u_i[s] gw_i[t] (a rank-one update, pure multiply-adds in double)
  // and multiply by E once at the end.
  if (kPairwise) std::fill(pair_acc, pair_acc + T * T, 0.0);
  std::copy(tab.end_w.begin(), tab.end_w.end(), b);  // beta_{n-1} = exp(end - max)
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* a = a_rows + i * T;
    double total = 0;
    for (int64_t t = 0; t < T; ++t) total += a[t] * b[t];
    if (!(total > 0)) return false;
    const double scale = static_cast<double>(g) / total;
    scalar_t* mu = grad_emit + i * T;
    for (int64_t t = 0; t < T; ++t) mu[t] = static_cast<scalar_t>(a[t] * b[t] * scale);
    if (kPairwise && i == n - 1) std::copy(mu, mu + T, grad_end);
    if (kPairwise && i == 0) std::copy(mu, mu + T, grad_start);
    if (i == 0) {
      if (kPairwise) {
        for (int64_t s = 0; s < T; ++s) {
          const double* row = &tab.by_row[s * T];
          const double* acc = pair_acc + s * T;
          scalar_t* out = grad_trans + s * T;
          for (int64_t t = 0; t < T; ++t) out[t] += static_cast<scalar_t>(row[t] * acc[t]);
        }
      }
      break;
    }

    const double* w = w_rows + i * T;
    for (int64_t t = 0; t < T; ++t) gw[t] = w[t] * b[t];
    const double gw_max = max_of_doubles(gw, T);
    if (!(gw_max > 0)) return false;
    for (int64_t t = 0; t < T; ++t) gw[t] /= gw_max;
    axpy_rows(tab.by_col.data(), gw, T, b_prev);  // b_prev[s] = sum_t E[s, t] gw[t]
    const double* a_prev = a_rows + (i - 1) * T;
    if (kPairwise) {
      // xi[s, t] = a_{i-1}[s] E[s, t] w_i[t] b_i[t] / sum over (s, t); that sum is
      // sum_s a_{i-1}[s] b_prev[s].
      double pair_total = 0;
      for (int64_t s = 0; s < T; ++s) pair_total += a_prev[s] * b_prev[s];
      if (!(pair_total > 0)) return false;
      const double pair_scale = static_cast<double>(g) / pair_total;
      for (int64_t s = 0; s < T; ++s) {
        const double left = a_prev[s] * pair_scale;
        if (left == 0) continue;
        double* __restrict__ acc = pair_acc + s * T;
        for (int64_t t = 0; t < T; ++t) acc[t] += left * gw[t];
      }
    }
    const double b_max = max_of_doubles(b_prev, T);
    if (!(b_max > 0)) return false;
    for (int64_t s = 0; s < T; ++s) {
      b[s] = b_prev[s] / b_max;
      // A state on some path (reachable: a > 0) must keep a representable beta.
      if (a_prev[s] > 0 && b[s] > 0 && b[s] < kMinScaled) return false;
    }
  }
  return true;
}

}  // namespace cpu
}  // namespace crfkit
