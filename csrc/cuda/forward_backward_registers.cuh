// Small T: the forward-backward ops (forward_backward.cuh) with every per-position value in
// registers.
//
// For T <= kLanes (8, 16 or 32; float up to 32, double up to 16) one group of kLanes lanes per
// sentence, lane t owning tag t, and nothing per position in memory: each lane keeps its
// column of E (and, for the backward, its row) in registers, the group's p = exp(alpha) reaches
// the other lanes by shuffles, and the pairwise sums of the lane's column accumulate in
// registers. The generic kernel passes every row through the group's shared arena with a
// __syncwarp on each side, and loops over a run-time T; at small T its time per position is
// nearly all the latency of one dependent chain (one warp per scheduler: there is nothing else
// to issue). Here the chain of a forward step is exp -> T shuffles -> T multiply-adds -> log ->
// group max; of a backward step the same, with the v shift taken from the emissions' maximum
// (known one position ahead, so off the chain). The marginals and pairwise terms of a step hang
// off the chain and overlap it. Measured faster than the generic kernel on an H100, though still
// well above the sum of that chain's latencies (benchmarks/results/NOTES.md,
// benchmarks/results/gpu_nvidia_h100_80gb_hbm3_notes.md).
//
// Same numerics as forward_backward_kernel (factored log-space steps with the exact fallback,
// rows normalised to max 0, offsets in double); results agree to rounding. Where a fallback is
// needed by some lane, the whole warp runs it (its shuffles need every lane), each lane keeping
// the result only where it needed it.
//
// The kernel (at the end of this file) is a sequence of the phases below; every function that
// shuffles is called by every lane of the warp. Included by log_partition.cu only (see
// forward_backward_common.cuh).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "forward_backward_common.cuh"

namespace crfkit {
namespace cuda {
namespace {

template <typename scalar_t>
constexpr int register_max_tags() { return sizeof(scalar_t) == 4 ? 32 : 16; }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_lane(scalar_t v, int source, int lanes) {
  return __shfl_sync(kFullMask, v, source, lanes);
}

// sum_s value[s] * weights[s] over the group's first T lanes, value[s] being lane s's `value`
// (two chains of multiply-adds: the sum is on the kernel's critical path).
//
// The shuffles run over all kLanes lanes, unconditionally. Lanes at and beyond T add 0 * 0:
// their weights are 0, and both callers' values there are exp(-inf) = 0 (the backward's is NaN
// only when every lane's is, a sum the caller does not use). Adding +0 to a sum of non-negative
// terms changes no bit, so the result is that of the T terms alone (the emulator's outputs are
// identical to the conditional version's). A conditional shuffle, `if (s < T)`, compiles
// (sm_90) into a branch and a divergence check around each SHFL, so each multiply-add waits for
// its own shuffle before the next shuffle is issued (benchmarks/results/NOTES.md has the SASS
// counts; not yet timed on a GPU).
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t group_dot(scalar_t value, const scalar_t (&weights)[kLanes]) {
  scalar_t even = 0, odd = 0;
#pragma unroll
  for (int s = 0; s < kLanes; s += 2) {
    even += from_lane(value, s, kLanes) * weights[s];
    odd += from_lane(value, s + 1, kLanes) * weights[s + 1];
  }
  return even + odd;
}

// logsumexp_s(value[s] + terms[s * stride]) over the group's first T lanes, exactly (the
// fallback when a factored sum underflowed); -inf when every term is -inf. Every lane of the
// warp must call it.
template <typename scalar_t, int kLanes>
__device__ scalar_t group_exact_lse(scalar_t value, const scalar_t* terms, int64_t stride, int T) {
  scalar_t top = neg_inf<scalar_t>();
  for (int s = 0; s < T; ++s) top = max_(top, from_lane(value, s, kLanes) + terms[s * stride]);
  scalar_t total = 0;
  for (int s = 0; s < T; ++s) {
    const scalar_t term = from_lane(value, s, kLanes) + terms[s * stride];
    total += top == neg_inf<scalar_t>() ? scalar_t(0) : exp_(term - top);
  }
  return top == neg_inf<scalar_t>() ? top : top + log_(total);
}

// ---- what a lane holds for the whole call ---------------------------------------------------

// This lane's place: lane t owns tag t (own: t < T).
struct Lane {
  int T;     // tags, <= kLanes
  int lane;  // 0 .. kLanes-1
  bool own;  // lane < T
};

// The lane's part of the transition tables (forward_backward_common.cuh): its tag's maxima and
// start / end scores (-inf off own), and where its column and row of the transitions are, for the
// exact fallbacks. Its column and row of E are arrays of their own (lane_tables): a struct that
// holds an array indexed in a loop stays in memory until the loops are unrolled, and so would
// these scalars, which changes the machine code nvcc makes of them.
template <typename scalar_t>
struct LaneTables {
  scalar_t col_max, row_max, start, end;
  const scalar_t* own_transitions;  // column `lane`: [s * T]
  const scalar_t* own_row;          // row `lane`: [t]
};

// The lane's LaneTables, and its column of E, e_col[s] = E[s][lane] (forward, pairwise), and row
// of E, e_row[t] = exp(trans[lane, t] - row_max[lane]) (backward, not for log Z), zeros beyond T.
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ LaneTables<scalar_t> lane_tables(const FbParams<scalar_t>& p, const Lane& ln,
                                                            scalar_t (&e_col)[kLanes], scalar_t (&e_row)[kLanes]) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = ln.T, lane = ln.lane;
  const bool own = ln.own;
  const TransitionTables<scalar_t> tab = transition_tables(p.tables, T);
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    e_col[s] = own && s < T ? tab.e_col[s * T + lane] : scalar_t(0);
    e_row[s] = keeps_rows(kOut) && own && s < T ? tab.e_row_t[s * T + lane] : scalar_t(0);
  }
  const scalar_t col_max = own ? tab.col_max[lane] : kNegInf;
  const scalar_t row_max = own ? tab.row_max[lane] : kNegInf;
  const scalar_t start = own ? p.start[lane] : kNegInf;
  const scalar_t end = own ? p.end[lane] : kNegInf;
  LaneTables<scalar_t> lt;
  lt.col_max = col_max;
  lt.row_max = row_max;
  lt.start = start;
  lt.end = end;
  lt.own_transitions = p.transitions + (own ? lane : 0);
  lt.own_row = p.transitions + (own ? lane : 0) * T;
  return lt;
}

// Sentence first + group and the lane's columns (stride T) of its emissions and rows; the
// group's offsets.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ Sentence<scalar_t> lane_sentence(const FbParams<scalar_t>& p, const scalar_t* emissions,
                                                            int64_t first, int group, int64_t L, const Lane& ln,
                                                            int64_t slot) {
  Sentence<scalar_t> s = locate_sentence(p, first, group, L);
  s.emit = emissions + s.b_safe * L * ln.T + ln.lane;
  s.rows = keeps_rows(kOut) ? p.rows + s.b_safe * L * ln.T + ln.lane : nullptr;
  s.offsets = keeps_rows(kOut) ? p.offsets + slot * L : nullptr;
  return s;
}

// ---- forward ----------------------------------------------------------------------------------

// The forward pass's state: alpha[lane] = a + offset, a = alpha_hat[lane] (max 0 over the group).
template <typename scalar_t>
struct LaneForward {
  scalar_t a;     // -inf off own
  double offset;  // the maxima taken out so far (-inf once every sequence is forbidden)
  bool bad;       // a NaN or +inf emission of the lane's tag
};

// Position 0: a = start + emit_0 - m, offset = m (m: the group's max); a to rows[0] and the
// offset to offsets[0] where the op keeps them.
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ LaneForward<scalar_t> lane_forward_first(const Sentence<scalar_t>& s,
                                                                    const LaneTables<scalar_t>& lt, const Lane& ln) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int64_t n = s.n;
  const bool own = ln.own;
  bool bad = false;
  double offset = 0;
  scalar_t a = kNegInf;
  if (n > 0 && own) {
    const scalar_t e = s.emit[0];
    bad |= is_nan_or_pos_inf(e);
    a = lt.start + e;
  }
  const scalar_t m = group_max(a, kLanes);
  if (n > 0) {
    offset = m == kNegInf ? -CUDART_INF : static_cast<double>(m);
    if (m != kNegInf) a -= m;
    if (keeps_rows(kOut) && own) s.rows[0] = a;
    if (keeps_rows(kOut) && ln.lane == 0) s.offsets[0] = offset;
  }
  LaneForward<scalar_t> f;
  f.a = a;
  f.offset = offset;
  f.bad = bad;
  return f;
}

// logsumexp_s(alpha_hat[s] + trans[s, lane]) from the group's a: factored, col_max +
// log(sum_s exp(a[s]) * E[s][lane]) (group_dot), or exactly (group_exact_lse, run by the whole
// warp when any active lane needs it); -inf off own or for a forbidden column.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t lane_alpha_lse(scalar_t a, bool active, const scalar_t (&e_col)[kLanes],
                                                   const LaneTables<scalar_t>& lt, int T) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t sum = group_dot(exp_(a), e_col);
  const bool sum_is_trusted = sum >= trusted_sum_min<scalar_t>();
  scalar_t x = lt.col_max != kNegInf && sum_is_trusted ? lt.col_max + log_(sum) : kNegInf;
  const bool need_exact = active && lt.col_max != kNegInf && !sum_is_trusted;  // col_max = -inf off own
  if (__any_sync(kFullMask, need_exact)) {  // logsumexp_s(alpha_hat[s] + trans[s, lane])
    const scalar_t exact = group_exact_lse<scalar_t, kLanes>(a, lt.own_transitions, T, T);
    if (need_exact) x = exact;
  }
  return x;
}

// Positions 1 .. n-1 (the loop runs to the warp's longest sentence): a = logsumexp_s(a[s] +
// trans[s, lane]) + emit_i - m, offset += m; a to rows[i], the offset to offsets[i].
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ void lane_forward_rows(const Sentence<scalar_t>& s, const scalar_t (&e_col)[kLanes],
                                                  const LaneTables<scalar_t>& lt, const Lane& ln,
                                                  LaneForward<scalar_t>& f) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = ln.T;
  const bool own = ln.own;
  const int64_t n = s.n;
  bool bad = f.bad;
  double offset = f.offset;
  scalar_t a = f.a;
  // Emissions two positions ahead: their load latency overlaps two steps.
  scalar_t emit_1 = own && n > 1 ? s.emit[T] : scalar_t(0);
  scalar_t emit_2 = own && n > 2 ? s.emit[2 * T] : scalar_t(0);
  // Position i + 2's emission by a pointer advanced T a step (read only while i + 2 < n): nvcc
  // then predicates one load, where `emit[(i + 2) * T]` (or an int64 offset) had it redo the
  // 64-bit address arithmetic each step (sm_90 SASS: benchmarks/results/NOTES.md).
  const scalar_t* emit_ahead = s.emit + 2 * T;
  for (int64_t i = 1; i < s.steps; ++i) {
    const bool active = i < n;
    const scalar_t e = emit_1;
    emit_1 = emit_2;
    emit_ahead += T;
    emit_2 = own && i + 2 < n ? *emit_ahead : scalar_t(0);
    bad |= active && is_nan_or_pos_inf(e);
    scalar_t x = lane_alpha_lse(a, active, e_col, lt, T);
    x += e;
    const scalar_t m = group_max(x, kLanes);
    if (active) {
      a = m == kNegInf ? x : x - m;
      offset += static_cast<double>(m);  // -inf once every sequence is forbidden
      if (keeps_rows(kOut) && own) s.rows[i * T] = a;
      if (keeps_rows(kOut) && ln.lane == 0) s.offsets[i] = offset;
    }
  }
  f.a = a;
  f.offset = offset;
  f.bad = bad;
}

// log Z = offset + logsumexp_t(alpha_hat[t] + end[t]) from the last position (finish_forward:
// also writes it and reports bad emissions); returns whether the sentence had bad emissions.
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ bool lane_log_z(const FbParams<scalar_t>& p, const Sentence<scalar_t>& s,
                                           const LaneTables<scalar_t>& lt, const Lane& ln,
                                           const LaneForward<scalar_t>& f, double& log_z) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t last = s.n > 0 ? f.a + lt.end : kNegInf;
  const scalar_t m = group_max(last, kLanes);
  const scalar_t sum = group_sum(s.n > 0 && m != kNegInf ? exp_(last - m) : scalar_t(0), kLanes);
  return finish_forward<scalar_t, kOut>(p, s.b_safe, s.has_sentence, s.n, f.offset, m, sum, f.bad, kLanes, ln.lane,
                                        log_z);
}

// ---- backward ---------------------------------------------------------------------------------

// The marginal of the lane's tag at position i, weighted by g: exp(alpha + beta - log Z) with
// the known shift offset_i + beta_offset - log Z, normalised over tags (as the CPU kernels; the
// sum is 1 up to rounding). The shift keeps every term <= 1; should the sum come out unusable
// (an extreme shift), the max-shifted form is used instead (by the whole warp). 0 off own or
// when inactive.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t lane_marginal(scalar_t alpha_i, scalar_t beta, double offset_i,
                                                  double beta_offset, double log_z, scalar_t g, bool own,
                                                  bool active) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t shift_i = static_cast<scalar_t>(offset_i + beta_offset - log_z);
  scalar_t mu = own && active ? exp_(alpha_i + beta + shift_i) : scalar_t(0);
  const scalar_t total = group_sum(mu, kLanes);
  const bool unusable = active && !(total >= trusted_sum_min<scalar_t>() && total <= scalar_t(2 * kLanes));
  mu *= g / total;
  if (__any_sync(kFullMask, unusable)) {
    const scalar_t u = own ? alpha_i + beta : kNegInf;
    const scalar_t u_max = group_max(u, kLanes);
    const scalar_t x = own && u_max != kNegInf ? exp_(u - u_max) : scalar_t(0);
    const scalar_t x_total = group_sum(x, kLanes);
    if (unusable) mu = u_max == kNegInf ? scalar_t(0) : x * (g / x_total);
  }
  return mu;
}

// beta_{i-1}[lane] = logsumexp_t(trans[lane, t] + v[t]), v = emit_i + beta_i, factored with the
// shift emit_max = max_t emit_i[t] (v - shift <= 0 since beta <= 0): emit_max + row_max +
// log(sum_t exp(v[t] - emit_max) * E_row[lane][t]) (group_dot), or exactly (group_exact_lse, run
// by the whole warp when any stepping lane needs it); -inf off own or for a forbidden row.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t lane_beta_lse(scalar_t v, scalar_t emit_max, bool step,
                                                  const scalar_t (&e_row)[kLanes], const LaneTables<scalar_t>& lt,
                                                  int T) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t row_sum = group_dot(exp_(v - emit_max), e_row);
  const bool sum_is_trusted = row_sum >= trusted_sum_min<scalar_t>();
  scalar_t x = lt.row_max != kNegInf && sum_is_trusted ? emit_max + lt.row_max + log_(row_sum) : kNegInf;
  const bool need_exact = step && lt.row_max != kNegInf && !sum_is_trusted;  // row_max = -inf off own
  if (__any_sync(kFullMask, need_exact)) {  // logsumexp_t(trans[lane, t] + v[t])
    const scalar_t exact = group_exact_lse<scalar_t, kLanes>(v, lt.own_row, 1, T);
    if (need_exact) x = exact;
  }
  return x;
}

// Pairwise marginals of positions (i-1, i), the lane's column: xi[s] = exp(alpha_prev[s] +
// trans[s, lane] + v[lane] + shift), shift = offset_prev + beta_offset - log Z, added to acc[s]
// with weight g / (their sum over the group). Factored, coef * exp(alpha_prev[s]) * E[s][lane]
// with coef = exp(col_max + v + shift), unless the shift is too large for that (the exact
// terms, computed where any lane of the warp needs them).
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void lane_pairwise(scalar_t v, scalar_t alpha_prev, double offset_prev, double beta_offset,
                                              double log_z, scalar_t g, bool step, const scalar_t (&e_col)[kLanes],
                                              const LaneTables<scalar_t>& lt, const Lane& ln,
                                              scalar_t (&acc)[kLanes]) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = ln.T;
  const scalar_t shift = static_cast<scalar_t>(offset_prev + beta_offset - log_z);
  const scalar_t w = lt.col_max + v + shift;  // -inf off own or when the column is forbidden
  const bool pair_is_factored = w <= pairwise_fast_bound<scalar_t>();
  scalar_t coef = exp_(w);
  const scalar_t pr = exp_(alpha_prev);
  scalar_t column[kLanes];
  scalar_t column_sum = 0;
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    column[s] = from_lane(pr, s, kLanes) * e_col[s];  // 0 * 0 beyond T (see group_dot)
    column_sum += column[s];
  }
  scalar_t part = w == kNegInf ? scalar_t(0) : coef * column_sum;
  const bool pair_exact = step && w != kNegInf && !pair_is_factored;
  if (__any_sync(kFullMask, pair_exact)) {
    scalar_t exact_sum = 0;
#pragma unroll
    for (int s = 0; s < kLanes; ++s) {
      if (s < T) {
        const scalar_t alpha_s = from_lane(alpha_prev, s, kLanes);
        if (pair_exact) {
          column[s] = exp_(alpha_s + lt.own_transitions[s * T] + v + shift);
          exact_sum += column[s];
        }
      }
    }
    if (pair_exact) {
      coef = 1;
      part = exact_sum;
    }
  }
  const scalar_t pair_total = group_sum(step ? part : scalar_t(0), kLanes);
  if (step && ln.own && pair_total > 0 && w != kNegInf) {
    const scalar_t scale = coef * (g / pair_total);
#pragma unroll
    for (int s = 0; s < kLanes; ++s) acc[s] += scale * column[s];
  }
}

// The backward's inputs, loaded ahead of the step for position i so that their latency overlaps
// the steps in between: the emissions at i and i-1 and the max of i's (the v shift), alpha_hat
// and the forward offsets at i, i-1 and i-2. They move one position back after each step.
template <typename scalar_t>
struct LaneWindow {
  scalar_t emit_i, emit_next, emit_max_i;
  scalar_t alpha_i, alpha_prev, alpha_ahead;
  double offset_i, offset_prev, offset_ahead;
};

// The lane's sums of the start / end marginals over the group's sentences (kBackward).
template <typename scalar_t>
struct EndpointSums {
  scalar_t start, end;
};

// The backward pass of a sentence whose forward left a in rows and the offsets: beta_hat (max 0,
// offset in double), the marginals over rows, the pairwise marginals into acc (transitions
// s -> lane) and the first / last marginals into ends (kBackward), positions n-1 .. 0 (the loop
// runs to the warp's longest sentence).
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ void lane_backward_pass(const Sentence<scalar_t>& s, const scalar_t (&e_col)[kLanes],
                                                   const scalar_t (&e_row)[kLanes], const LaneTables<scalar_t>& lt,
                                                   const Lane& ln, scalar_t (&acc)[kLanes],
                                                   EndpointSums<scalar_t>& ends, scalar_t g, bool skip,
                                                   double log_z) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = ln.T;
  const bool own = ln.own;
  const int64_t n = s.n;
  scalar_t acc_start = ends.start, acc_end = ends.end;
  scalar_t beta = skip ? kNegInf : lt.end;
  scalar_t m = group_max(beta, kLanes);
  double beta_offset = 0;
  if (!skip) {
    if (m != kNegInf) beta -= m;
    beta_offset = static_cast<double>(m);
  }
  const bool go = !skip && own;
  auto load_emit = [&](int64_t i) { return go && i >= 0 ? s.emit[i * T] : kNegInf; };
  auto load_alpha = [&](int64_t i) { return go && i >= 0 ? s.rows[i * T] : kNegInf; };
  auto load_offset = [&](int64_t i) { return !skip && i >= 0 ? s.offsets[i] : 0.0; };
  LaneWindow<scalar_t> w;
  w.emit_i = load_emit(n - 1);
  w.emit_next = load_emit(n - 2);
  w.emit_max_i = group_max(w.emit_i, kLanes);
  w.alpha_i = load_alpha(n - 1);
  w.alpha_prev = load_alpha(n - 2);
  w.alpha_ahead = load_alpha(n - 3);
  w.offset_i = load_offset(n - 1);
  w.offset_prev = load_offset(n - 2);
  w.offset_ahead = load_offset(n - 3);
  for (int64_t j = 0; j < s.steps; ++j) {
    const bool active = !skip && j < n;
    const int64_t i = n - 1 - j;
    const bool step = active && i > 0;  // positions i-1 -> i remain
    // the next step's inputs, loaded now
    const scalar_t emit_later = load_emit(i - 2);
    const scalar_t alpha_later = load_alpha(i - 3);
    const double offset_later = load_offset(i - 3);
    const scalar_t emit_max_next = group_max(w.emit_next, kLanes);

    const scalar_t mu = lane_marginal<scalar_t, kLanes>(w.alpha_i, beta, w.offset_i, beta_offset, log_z, g, own, active);
    if (active && own) {
      s.rows[i * T] = mu;
      if (kOut == Output::kBackward) {
        if (i == n - 1) acc_end += mu;
        if (i == 0) acc_start += mu;
      }
    }
    const scalar_t v = w.emit_i + beta;  // -inf off own
    const scalar_t x = lane_beta_lse(v, w.emit_max_i, step, e_row, lt, T);
    if (has_pairwise(kOut)) {
      lane_pairwise(v, w.alpha_prev, w.offset_prev, beta_offset, log_z, g, step, e_col, lt, ln, acc);
    }

    // beta_{i-1} normalised to max 0; the window moves one position back
    m = group_max(x, kLanes);
    if (step) {
      beta = m == kNegInf ? x : x - m;
      beta_offset += static_cast<double>(m);
    }
    w.emit_i = w.emit_next;
    w.emit_next = emit_later;
    w.emit_max_i = emit_max_next;
    w.alpha_i = w.alpha_prev;
    w.alpha_prev = w.alpha_ahead;
    w.alpha_ahead = alpha_later;
    w.offset_i = w.offset_prev;
    w.offset_prev = w.offset_ahead;
    w.offset_ahead = offset_later;
  }
  ends.start = acc_start;
  ends.end = acc_end;
}

// kWithMarginals: the lane's column of the sentence's counts (B, T, T), and acc back to zero.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void lane_write_counts(const FbParams<scalar_t>& p, const Lane& ln, int64_t b,
                                                  scalar_t (&acc)[kLanes]) {
  const int T = ln.T;
  scalar_t* out = p.counts + b * T * T;
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    if (ln.own && s < T) out[s * T + ln.lane] = acc[s];
    acc[s] = 0;
  }
}

// kBackward: the lane's entries of the group's slice of partials (slots, T*T + 2T).
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void lane_write_partials(const FbParams<scalar_t>& p, const Lane& ln, int64_t slot,
                                                    const scalar_t (&acc)[kLanes], const EndpointSums<scalar_t>& ends) {
  const int T = ln.T, lane = ln.lane;
  scalar_t* out = p.partials + slot * ((int64_t)T * T + 2 * T);
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    if (s < T) out[s * T + lane] = acc[s];
  }
  out[T * T + lane] = ends.start;
  out[T * T + T + lane] = ends.end;
}

// ---- the kernel -------------------------------------------------------------------------------

template <typename scalar_t, Output kOut, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) register_forward_backward_kernel(const FbParams<scalar_t> p) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  Lane ln;
  ln.T = p.num_tags;
  ln.lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  ln.own = ln.lane < ln.T;  // the lane owns tag `lane`
  const int64_t slot = (int64_t)blockIdx.x * kGroupsPerBlock + group;
  const int64_t L = p.max_len;
  const scalar_t* __restrict__ emissions = p.emissions;

  scalar_t e_col[kLanes], e_row[kLanes];
  const LaneTables<scalar_t> lt = lane_tables<scalar_t, kOut, kLanes>(p, ln, e_col, e_row);
  // The pairwise sums of the lane's column: acc[s] for transitions s -> lane.
  scalar_t acc[kLanes];
#pragma unroll
  for (int s = 0; s < kLanes; ++s) acc[s] = 0;
  EndpointSums<scalar_t> ends;
  ends.start = 0;
  ends.end = 0;

  const int64_t grid_groups = (int64_t)gridDim.x * kGroupsPerBlock;
  for (int64_t first = (int64_t)blockIdx.x * kGroupsPerBlock; first < p.batch; first += grid_groups) {
    const Sentence<scalar_t> s = lane_sentence<scalar_t, kOut>(p, emissions, first, group, L, ln, slot);

    // ---- forward ----
    LaneForward<scalar_t> f = lane_forward_first<scalar_t, kOut, kLanes>(s, lt, ln);
    lane_forward_rows<scalar_t, kOut, kLanes>(s, e_col, lt, ln, f);
    double log_z;
    const bool bad = lane_log_z<scalar_t, kOut, kLanes>(p, s, lt, ln, f, log_z);
    if (kOut == Output::kLogPartition) continue;

    // ---- backward: beta_hat (max 0, offset in double), marginals, pairwise marginals ----
    bool skip;
    const scalar_t g = gradient_weight<scalar_t, kOut>(p, s.b_safe, s.has_sentence, s.n, bad, log_z, skip);
    if (s.n > 0 && skip && ln.own) {  // the rows hold alpha: clear them
      for (int64_t i = 0; i < s.n; ++i) s.rows[i * ln.T] = 0;
    }
    __syncwarp();  // offsets[] from lane 0 visible to the group
    lane_backward_pass<scalar_t, kOut, kLanes>(s, e_col, e_row, lt, ln, acc, ends, g, skip, log_z);
    if (kOut == Output::kWithMarginals && s.has_sentence) lane_write_counts(p, ln, s.b, acc);
  }
  if (kOut == Output::kBackward && ln.own) lane_write_partials(p, ln, slot, acc, ends);
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
