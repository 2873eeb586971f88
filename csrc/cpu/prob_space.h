// Probability-space forward-backward: the fast path of log Z, marginals and their backward.
//
// In log space every position costs T exponentials and T logarithms (csrc/cpu/log_space.h).
// Here the recursions run on scaled probabilities instead:
//     a_i[t] = alpha_i[t] - c_i  exponentiated and scaled so that max_t a_i[t] is in [1, 2),
//     a_i[t] = (sum_s a_{i-1}[s] E[s, t]) * w_i[t] * 2^-e_i,   E = exp(trans - max trans),
//                                                             w_i = exp(emit_i - max emit_i),
// with 2^e_i the power of two at or below the row's maximum m_i (exact: it changes no mantissa
// bit), so a position costs one T x T matrix-vector product and no transcendental function
// (log Z adds up the e_i instead of a logarithm of each m_i, and no division is needed).
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
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "isa.h"
#include "lanes.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

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

// Tag vectors in the fast path are handled kLanes doubles at a time (one register: 8 doubles
// with AVX-512, 4 with AVX2, 2 otherwise); tables are padded to a multiple of it with zeros.
constexpr int64_t kLanes = Lanes<double>::kCount;
inline int64_t padded_tags(int64_t T) { return padded_to_lanes<double>(T); }

// Per call: transitions and end scores exponentiated once.
struct ProbTables {
  int64_t T = 0;
  int64_t stride = 0;            // row stride of by_col / by_row: T rounded up to kLanes
  bool usable = true;            // false: some finite transition / end score is out of range
  double trans_max = 0;          // max finite transition (0 when all are -inf)
  double end_max = 0;
  std::vector<double> by_col;    // [t][s] = exp(trans[s, t] - trans_max), zero past s = T
  std::vector<double> by_row;    // [s][t] = the same, row-major, zero past t = T
  std::vector<double> end_w;     // exp(end[t] - end_max), zero past t = T (stride values)

  template <typename scalar_t>
  ProbTables(const scalar_t* trans, const scalar_t* end, int64_t num_tags)
      : T(num_tags), stride(padded_tags(num_tags)), by_col(num_tags * stride, 0.0),
        by_row(num_tags * stride, 0.0), end_w(stride, 0.0) {
    std::vector<double> dense(T * T);
    const double max_t = exp_shifted(trans, T * T, dense.data(), usable);
    trans_max = max_t == -std::numeric_limits<double>::infinity() ? 0.0 : max_t;
    for (int64_t s = 0; s < T; ++s) {
      for (int64_t t = 0; t < T; ++t) {
        by_row[s * stride + t] = dense[s * T + t];
        by_col[t * stride + s] = dense[s * T + t];
      }
    }
    end_max = exp_shifted(end, T, end_w.data(), usable);
  }
};

// ---- Tag vectors in lanes ------------------------------------------------------------------
// Every per-position vector of the fast path (alpha, beta, exponentiated emissions, their
// products) is stored padded to `stride` doubles, with zeros in the padding, so that the loops
// below run over whole LaneVectors and need no tail (lanes.h).
using LaneVector = Lanes<double>::Vector;
using LaneMask = Lanes<double>::Mask;

inline LaneVector lane_max(LaneVector a, LaneVector b) { return a > b ? a : b; }
inline double horizontal_max(LaneVector v) {
  double m = v[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, v[j]);
  return m;
}
inline double horizontal_sum(LaneVector v) {
  double s = 0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// max of a padded vector (its padding must not exceed its maximum: 0 for probabilities,
// -inf for scores)
inline double max_padded(const double* x, int64_t stride) {
  LaneVector m = load_lanes(x);
  for (int64_t j = kLanes; j < stride; j += kLanes) m = lane_max(m, load_lanes(x + j));
  return horizontal_max(m);
}
inline double dot_padded(const double* x, const double* y, int64_t stride) {
  LaneVector s = load_lanes(x) * load_lanes(y);
  for (int64_t j = kLanes; j < stride; j += kLanes) s += load_lanes(x + j) * load_lanes(y + j);
  return horizontal_sum(s);
}

// Power-of-two scaling: for m > 0 normal, returns 2^-e with m * 2^-e in [1, 2), and adds e to
// `exponent`. Exact: it changes no mantissa bit. Callers require m >= kMinNormalScale.
inline double inverse_power_of_two(double m, int64_t& exponent) {
  const int64_t biased = (std::bit_cast<int64_t>(m) >> 52) & 0x7ff;
  exponent += biased - 1023;
  return std::bit_cast<double>((2046 - biased) << 52);
}
constexpr double kMinNormalScale = 0x1p-1000;  // checks keep valid maxima far above this
constexpr double kLn2 = 0.6931471805599453;

// out = x * y elementwise over padded nonnegative vectors; returns max(out) (0 if all are 0).
inline double multiply_padded(const double* x, const double* y, int64_t stride, double* out) {
  LaneVector m = {};
  for (int64_t j = 0; j < stride; j += kLanes) {
    const LaneVector p = load_lanes(x + j) * load_lanes(y + j);
    store_lanes(out + j, p);
    m = lane_max(m, p);
  }
  return horizontal_max(m);
}

// Scores x (T values, any dtype) as doubles padded with -inf, so that their exponentials are
// zero in the padding.
template <typename scalar_t>
inline void load_scores(const scalar_t* x, int64_t T, int64_t stride, double* out) {
  for (int64_t t = 0; t < T; ++t) out[t] = static_cast<double>(x[t]);
  std::fill(out + T, out + stride, -std::numeric_limits<double>::infinity());
}

// out = exp(x - shift) over a padded vector; false if an allowed (finite) score falls below
// kMinScaled relative to the shift (its probability would not survive the products).
inline bool exp_padded(const double* x, double shift, int64_t stride, double* __restrict__ out) {
  for (int64_t j = 0; j < stride; ++j) out[j] = exp_nonpositive(x[j] - shift);
  const LaneVector min_scaled = LaneVector{} + kMinScaled;
  const LaneVector neg_inf = LaneVector{} - std::numeric_limits<double>::infinity();
  LaneMask lost = {};
  for (int64_t j = 0; j < stride; j += kLanes) {
    lost |= (load_lanes(out + j) < min_scaled) & (load_lanes(x + j) != neg_inf);
  }
  return !any_lane(lost);
}

// out[j] = sum_k x[k] * m[k * stride + j] for j < stride (the padding of m gives zeros there),
// with kVectors = stride / kLanes. The accumulators stay in registers for the whole sum (a
// plain loop stores and reloads out[] for every k); two independent sets, for even and odd k,
// hide the latency of the multiply-adds. This is the hot loop of the fast path.
template <int kVectors>
inline void matvec_in_registers(const double* __restrict__ m, int64_t stride,
                                const double* __restrict__ x, int64_t T, double* __restrict__ out) {
  LaneVector even[kVectors] = {}, odd[kVectors] = {};
  int64_t k = 0;
  for (; k + 2 <= T; k += 2) {
    const double x0 = x[k], x1 = x[k + 1];
    const double* row0 = m + k * stride;
    const double* row1 = row0 + stride;
    for (int v = 0; v < kVectors; ++v) {
      even[v] += x0 * load_lanes(row0 + v * kLanes);
      odd[v] += x1 * load_lanes(row1 + v * kLanes);
    }
  }
  if (k < T) {
    for (int v = 0; v < kVectors; ++v) even[v] += x[k] * load_lanes(m + k * stride + v * kLanes);
  }
  for (int v = 0; v < kVectors; ++v) store_lanes(out + v * kLanes, even[v] + odd[v]);
}

// The same for any T: a sum of scaled rows (the inner loop over independent outputs
// vectorises without reordering any sum).
inline void matvec_rows(const double* __restrict__ m, int64_t stride,
                        const double* __restrict__ x, int64_t T, double* __restrict__ out) {
  std::fill(out, out + stride, 0.0);
  for (int64_t k = 0; k < T; ++k) {
    const double xk = x[k];
    if (xk == 0) continue;  // unreachable states (and forbidden tags) contribute nothing
    const double* row = m + k * stride;
    for (int64_t j = 0; j < stride; ++j) out[j] += xk * row[j];
  }
}

// out (stride doubles) = x (T doubles) times the padded T x stride matrix m.
inline void matvec(const double* m, int64_t stride, const double* x, int64_t T, double* out) {
  switch (stride / kLanes) {
    case 1: return matvec_in_registers<1>(m, stride, x, T, out);
    case 2: return matvec_in_registers<2>(m, stride, x, T, out);
    case 3: return matvec_in_registers<3>(m, stride, x, T, out);
    case 4: return matvec_in_registers<4>(m, stride, x, T, out);
    case 5: return matvec_in_registers<5>(m, stride, x, T, out);
    case 6: return matvec_in_registers<6>(m, stride, x, T, out);
    case 7: return matvec_in_registers<7>(m, stride, x, T, out);
    case 8: return matvec_in_registers<8>(m, stride, x, T, out);
    default: return matvec_rows(m, stride, x, T, out);  // T > 64: more than the registers
  }
}

// ---- The scans --------------------------------------------------------------------------------
// Scaled forward pass of one sentence (n >= 1). Rows are tab.stride doubles apart. With
// keep_rows, a_rows (n, stride) and w_rows (n, stride) keep what the backward needs; otherwise
// a_rows holds two rolling rows. Writes log Z and returns false if the sentence needs the exact
// log-space path. scratch: 3 * tab.stride doubles.
template <typename scalar_t>
bool prob_forward(const scalar_t* emit, const scalar_t* start, const ProbTables& tab, int64_t n,
                  bool keep_rows, double* a_rows, double* w_rows, double* scratch, double* log_z) {
  const int64_t T = tab.T, stride = tab.stride;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  double* scores = scratch;
  double* d = scratch + stride;
  double* a = a_rows;
  load_scores(emit, T, stride, scores);
  for (int64_t t = 0; t < T; ++t) scores[t] += static_cast<double>(start[t]);
  double log_scale = max_padded(scores, stride);
  if (keep_rows) {  // unused at position 0
    std::fill(w_rows, w_rows + T, 1.0);
    std::fill(w_rows + T, w_rows + stride, 0.0);
  }
  if (log_scale == neg_inf) {
    *log_z = neg_inf;
    return true;
  }
  if (!exp_padded(scores, log_scale, stride, a)) return false;  // a_0 = exp(start + emit_0 - max)
  const LaneVector zero = {}, min_scaled = zero + kMinScaled;
  int64_t exponent = 0;  // log Z = log_scale + exponent * ln 2 + ...
  for (int64_t i = 1; i < n; ++i) {
    const double* a_prev = a;
    a = keep_rows ? a_rows + i * stride : a_rows + (i % 2) * stride;
    double* w = keep_rows ? w_rows + i * stride : scratch + 2 * stride;
    load_scores(emit + i * T, T, stride, scores);
    const double emit_max = max_padded(scores, stride);
    if (emit_max == neg_inf) {  // every tag forbidden here
      *log_z = neg_inf;
      return true;
    }
    if (!exp_padded(scores, emit_max, stride, w)) return false;
    matvec(tab.by_row.data(), stride, a_prev, T, d);  // d[t] = sum_s a_prev[s] E[s, t]
    const double m = multiply_padded(d, w, stride, a);
    if (m == 0) {  // no state reachable (underflow is excluded by the checks): log Z = -inf
      *log_z = neg_inf;
      return true;
    }
    if (!(m >= kMinNormalScale)) return false;
    const double scale = inverse_power_of_two(m, exponent);
    LaneMask lost = {};
    for (int64_t j = 0; j < stride; j += kLanes) {
      const LaneVector a_j = load_lanes(a + j) * scale;
      store_lanes(a + j, a_j);
      // A reachable state (d > 0, allowed emission) must keep a representable probability.
      // (An allowed emission far below the maximum was already caught by exp_padded.)
      lost |= (load_lanes(d + j) > zero) & (load_lanes(w + j) > zero) & (a_j < min_scaled);
    }
    if (any_lane(lost)) return false;
    log_scale += tab.trans_max + emit_max;
  }
  const double z = dot_padded(a, tab.end_w.data(), stride);
  *log_z = z > 0 ? log_scale + static_cast<double>(exponent) * kLn2 + tab.end_max + std::log(z)
                 : neg_inf;
  return true;
}

// Scaled backward pass of one sentence after prob_forward(keep_rows) with finite log Z:
// marginals scaled by g into grad_emit (n, T); with kPairwise the transition gradients too
// (T, T, added); the start and end ones where those are not null. Returns false if the
// sentence needs the exact path (the caller then discards everything written here).
// scratch: 3 * tab.stride doubles, plus T * stride for the pairwise sums (kPairwise).
template <typename scalar_t, bool kPairwise>
bool prob_backward(const ProbTables& tab, int64_t n, const double* a_rows, const double* w_rows,
                   scalar_t g, scalar_t* grad_emit, scalar_t* grad_trans, scalar_t* grad_start,
                   scalar_t* grad_end, double* scratch) {
  const int64_t T = tab.T, stride = tab.stride;
  double* b = scratch;                 // beta_i, scaled
  double* gw = scratch + stride;       // w_i * b_i, scaled
  double* b_prev = scratch + 2 * stride;
  double* pair_acc = scratch + 3 * stride;
  const LaneVector zero = {}, min_scaled = zero + kMinScaled;
  // The pairwise marginals xi_i[s, t] = u_i[s] E[s, t] gw_i[t] share the factor E[s, t] at every
  // position: accumulate sum_i u_i[s] gw_i[t] (a rank-one update, pure multiply-adds in double)
  // and multiply by E once at the end.
  if (kPairwise) std::fill(pair_acc, pair_acc + T * stride, 0.0);
  std::copy(tab.end_w.begin(), tab.end_w.end(), b);  // beta_{n-1} = exp(end - max), padded
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* a = a_rows + i * stride;
    const double total = dot_padded(a, b, stride);
    if (!(total > 0)) return false;
    const double scale = static_cast<double>(g) / total;
    scalar_t* mu = grad_emit + i * T;
    for (int64_t t = 0; t < T; ++t) mu[t] = static_cast<scalar_t>(a[t] * b[t] * scale);
    if (grad_end != nullptr && i == n - 1) std::copy(mu, mu + T, grad_end);
    if (grad_start != nullptr && i == 0) std::copy(mu, mu + T, grad_start);
    if (i == 0) {
      if (kPairwise) {
        for (int64_t s = 0; s < T; ++s) {
          const double* row = &tab.by_row[s * stride];
          const double* acc = pair_acc + s * stride;
          scalar_t* out = grad_trans + s * T;
          for (int64_t t = 0; t < T; ++t) out[t] += static_cast<scalar_t>(row[t] * acc[t]);
        }
      }
      break;
    }

    const double* w = w_rows + i * stride;
    const double gw_max = multiply_padded(w, b, stride, gw);
    if (!(gw_max >= kMinNormalScale)) return false;
    int64_t unused_exponent = 0;
    const double gw_scale = inverse_power_of_two(gw_max, unused_exponent);
    for (int64_t j = 0; j < stride; j += kLanes) store_lanes(gw + j, load_lanes(gw + j) * gw_scale);
    matvec(tab.by_col.data(), stride, gw, T, b_prev);  // b_prev[s] = sum_t E[s, t] gw[t]
    const double* a_prev = a_rows + (i - 1) * stride;
    if (kPairwise) {
      // xi[s, t] = a_{i-1}[s] E[s, t] w_i[t] b_i[t] / sum over (s, t); that sum is
      // sum_s a_{i-1}[s] b_prev[s].
      const double pair_total = dot_padded(a_prev, b_prev, stride);
      if (!(pair_total > 0)) return false;
      const double pair_scale = static_cast<double>(g) / pair_total;
      for (int64_t s = 0; s < T; ++s) {
        const double left = a_prev[s] * pair_scale;
        if (left == 0) continue;
        double* acc = pair_acc + s * stride;
        for (int64_t j = 0; j < stride; j += kLanes) {
          store_lanes(acc + j, load_lanes(acc + j) + left * load_lanes(gw + j));
        }
      }
    }
    const double b_max = max_padded(b_prev, stride);
    if (!(b_max >= kMinNormalScale)) return false;
    const double b_scale = inverse_power_of_two(b_max, unused_exponent);
    LaneMask lost = {};
    for (int64_t j = 0; j < stride; j += kLanes) {
      const LaneVector b_j = load_lanes(b_prev + j) * b_scale;
      store_lanes(b + j, b_j);
      // A state on some path (reachable: a > 0) must keep a representable beta.
      lost |= (load_lanes(a_prev + j) > zero) & (b_j > zero) & (b_j < min_scaled);
    }
    if (any_lane(lost)) return false;
  }
  return true;
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
