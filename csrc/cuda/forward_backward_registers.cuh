// The forward-backward kernel for small T: the same op as forward_backward_kernel
// (forward_backward.cuh) with every per-position value in registers.
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
#pragma once

#include "forward_backward_common.cuh"

namespace crfkit {
namespace cuda {
namespace {

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

// A lane's share of the transition tables (layout: forward_backward_common.cuh): its column of E
// (forward, pairwise terms) and, when kRows, its row of E (backward), zeros beyond T; the column
// and row maxima, -inf off own.
template <typename scalar_t, int kLanes, bool kRows>
__device__ __forceinline__ void load_lane_tables(const scalar_t* tables, int T, int lane, bool own,
                                                 scalar_t (&e_col)[kLanes], scalar_t (&e_row)[kLanes],
                                                 scalar_t& col_max, scalar_t& row_max) {
  const scalar_t* col_max_table = tables + T * T;
  const scalar_t* e_row_t = col_max_table + T;
  const scalar_t* row_max_table = e_row_t + T * T;
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    e_col[s] = own && s < T ? tables[s * T + lane] : scalar_t(0);
    e_row[s] = kRows && own && s < T ? e_row_t[s * T + lane] : scalar_t(0);
  }
  col_max = own ? col_max_table[lane] : neg_inf<scalar_t>();
  row_max = own ? row_max_table[lane] : neg_inf<scalar_t>();
}

// The forward pass of one sentence of n positions, the lane's tag: returns alpha_hat[lane] of
// the last position (normalised to max 0 over the group; -inf off own), keeps every position's
// in `rows` (the lane's column, stride T) when kKeepRows, and the running offset (double) in
// `offset` and, when kKeepRows, per position in `offsets`. Every lane of the warp runs all
// `steps` (the warp's longest sentence), for the shuffles. `bad` is set when an emission the
// lane read is NaN or +inf.
template <typename scalar_t, bool kKeepRows, int kLanes>
__device__ __forceinline__ scalar_t register_forward_pass(const scalar_t* emit, scalar_t* rows, double* offsets,
                                                          int64_t n, int64_t steps, int T, int lane, bool own,
                                                          scalar_t start, scalar_t col_max,
                                                          const scalar_t (&e_col)[kLanes],
                                                          const scalar_t* own_transitions, double& offset,
                                                          bool& bad) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  scalar_t a = kNegInf;  // alpha_hat[lane], max 0 over the group
  if (n > 0 && own) {
    const scalar_t e = emit[0];
    bad |= is_nan_or_pos_inf(e);
    a = start + e;
  }
  scalar_t m = group_max(a, kLanes);
  if (n > 0) {
    offset = m == kNegInf ? -CUDART_INF : static_cast<double>(m);
    if (m != kNegInf) a -= m;
    if (kKeepRows && own) rows[0] = a;
    if (kKeepRows && lane == 0) offsets[0] = offset;
  }
  // Emissions two positions ahead: their load latency overlaps two steps.
  scalar_t emit_1 = own && n > 1 ? emit[T] : scalar_t(0);
  scalar_t emit_2 = own && n > 2 ? emit[2 * T] : scalar_t(0);
  // Position i + 2's emission by a pointer advanced T a step (read only while i + 2 < n): nvcc
  // then predicates one load, where `emit[(i + 2) * T]` (or an int64 offset) had it redo the
  // 64-bit address arithmetic each step (sm_90 SASS: benchmarks/results/NOTES.md).
  const scalar_t* emit_ahead = emit + 2 * T;
  for (int64_t i = 1; i < steps; ++i) {
    const bool active = i < n;
    const scalar_t e = emit_1;
    emit_1 = emit_2;
    emit_ahead += T;
    emit_2 = own && i + 2 < n ? *emit_ahead : scalar_t(0);
    bad |= active && is_nan_or_pos_inf(e);
    const scalar_t sum = group_dot(exp_(a), e_col);
    const bool sum_is_trusted = sum >= trusted_sum_min<scalar_t>();
    scalar_t x = col_max != kNegInf && sum_is_trusted ? col_max + log_(sum) : kNegInf;
    const bool need_exact = active && col_max != kNegInf && !sum_is_trusted;  // col_max = -inf off own
    if (__any_sync(kFullMask, need_exact)) {  // logsumexp_s(alpha_hat[s] + trans[s, lane])
      const scalar_t exact = group_exact_lse<scalar_t, kLanes>(a, own_transitions, T, T);
      if (need_exact) x = exact;
    }
    x += e;
    m = group_max(x, kLanes);
    if (active) {
      a = m == kNegInf ? x : x - m;
      offset += static_cast<double>(m);  // -inf once every sequence is forbidden
      if (kKeepRows && own) rows[i * T] = a;
      if (kKeepRows && lane == 0) offsets[i] = offset;
    }
  }
  return a;
}

// beta_{i-1}[lane] = logsumexp_t(trans[lane, t] + v[t]), v = emit_i + beta_i, factored with the
// shift max_t emit_i[t] (v - shift <= 0 since beta <= 0); exact (group_exact_lse) where the
// factored sum is too small to trust. Not yet normalised. Every lane of the warp must call it.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t register_beta(bool step, int T, scalar_t v, scalar_t emit_max_i,
                                                  scalar_t row_max, const scalar_t (&e_row)[kLanes],
                                                  const scalar_t* own_row) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t row_sum = group_dot(exp_(v - emit_max_i), e_row);
  const bool sum_is_trusted = row_sum >= trusted_sum_min<scalar_t>();
  scalar_t x = row_max != kNegInf && sum_is_trusted ? emit_max_i + row_max + log_(row_sum) : kNegInf;
  const bool need_exact = step && row_max != kNegInf && !sum_is_trusted;  // row_max = -inf off own
  if (__any_sync(kFullMask, need_exact)) {  // logsumexp_t(trans[lane, t] + v[t])
    const scalar_t exact = group_exact_lse<scalar_t, kLanes>(v, own_row, 1, T);
    if (need_exact) x = exact;
  }
  return x;
}

// Pairwise marginals of positions (i-1, i), the lane's column: xi[s] = exp(alpha_prev[s] +
// trans[s, lane] + v[lane] + shift), accumulated into acc[s] with weight g / (their sum over
// the group). Factored (coef * p[s] * E[s][lane]) when no term that matters underflows,
// exactly otherwise. Every lane of the warp must call it.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void register_pairwise(bool step, bool own, int T, scalar_t v, scalar_t alpha_prev,
                                                  double offset_prev, double beta_offset, double log_z,
                                                  scalar_t col_max, const scalar_t (&e_col)[kLanes],
                                                  const scalar_t* own_transitions, scalar_t g,
                                                  scalar_t (&acc)[kLanes]) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t shift = static_cast<scalar_t>(offset_prev + beta_offset - log_z);
  const scalar_t w = col_max + v + shift;  // -inf off own or when the column is forbidden
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
          column[s] = exp_(alpha_s + own_transitions[s * T] + v + shift);
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
  if (step && own && pair_total > 0 && w != kNegInf) {
    const scalar_t scale = coef * (g / pair_total);
#pragma unroll
    for (int s = 0; s < kLanes; ++s) acc[s] += scale * column[s];
  }
}

// The backward pass of one sentence, the lane's tag, from the last position to the first:
// beta_hat (max 0, offset in double), the marginals over the alpha rows in `rows`, and with
// kPairwise the pairwise marginals into acc (with kOut == kBackward, the start / end gradients
// into acc_start / acc_end). A skipped sentence (gradient_weight) only has its rows cleared.
// Every lane of the warp runs all `steps`, for the shuffles. The marginals' step stays in this
// body: as a __forceinline__ function of its own it changed the sm_90 machine code (checked with
// tools/cuda_compile_check/compare_sass.py), as did the generic kernel's splits.
template <typename scalar_t, Output kOut, int kLanes>
__device__ __forceinline__ void register_backward_pass(const scalar_t* emit, scalar_t* rows, const double* offsets,
                                                       int64_t n, int64_t steps, int T, bool own, scalar_t g,
                                                       bool skip, double log_z, scalar_t end, scalar_t col_max,
                                                       scalar_t row_max, const scalar_t (&e_col)[kLanes],
                                                       const scalar_t (&e_row)[kLanes],
                                                       const scalar_t* own_transitions, const scalar_t* own_row,
                                                       scalar_t (&acc)[kLanes], scalar_t& acc_start,
                                                       scalar_t& acc_end) {
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
  const scalar_t kNegInf = neg_inf<scalar_t>();
  if (n > 0 && skip && own) {  // the rows hold alpha: clear them
    for (int64_t i = 0; i < n; ++i) rows[i * T] = 0;
  }
  __syncwarp();  // offsets[] from lane 0 visible to the group
  scalar_t beta = skip ? kNegInf : end;
  scalar_t m = group_max(beta, kLanes);
  double beta_offset = 0;
  if (!skip) {
    if (m != kNegInf) beta -= m;
    beta_offset = static_cast<double>(m);
  }
  // Ahead of the step for position i: its emission and the emissions' max (the v shift), the
  // alpha rows and forward offsets of i and i - 1. Loaded one or two positions ahead.
  const bool go = !skip && own;
  auto load_emit = [&](int64_t i) { return go && i >= 0 ? emit[i * T] : kNegInf; };
  auto load_alpha = [&](int64_t i) { return go && i >= 0 ? rows[i * T] : kNegInf; };
  auto load_offset = [&](int64_t i) { return !skip && i >= 0 ? offsets[i] : 0.0; };
  scalar_t emit_i = load_emit(n - 1), emit_next = load_emit(n - 2);
  scalar_t emit_max_i = group_max(emit_i, kLanes);
  scalar_t alpha_i = load_alpha(n - 1), alpha_prev = load_alpha(n - 2), alpha_ahead = load_alpha(n - 3);
  double offset_i = load_offset(n - 1), offset_prev = load_offset(n - 2), offset_ahead = load_offset(n - 3);
  for (int64_t j = 0; j < steps; ++j) {
    const bool active = !skip && j < n;
    const int64_t i = n - 1 - j;
    const bool step = active && i > 0;  // positions i-1 -> i remain
    // the next step's inputs, loaded now
    const scalar_t emit_later = load_emit(i - 2);
    const scalar_t alpha_later = load_alpha(i - 3);
    const double offset_later = load_offset(i - 3);
    const scalar_t emit_max_next = group_max(emit_next, kLanes);

    // Marginals at position i: exp(alpha + beta - log Z), normalised over tags (as the CPU
    // kernels; the sum is 1 up to rounding). The known shift keeps every term <= 1; should
    // the sum come out unusable (an extreme shift), the max-shifted form is used instead.
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
    if (active && own) {
      rows[i * T] = mu;
      if (kOut == Output::kBackward) {
        if (i == n - 1) acc_end += mu;
        if (i == 0) acc_start += mu;
      }
    }

    // beta_{i-1} (register_beta), then the pairwise marginals of positions (i-1, i) from the same v
    const scalar_t v = emit_i + beta;  // -inf off own
    const scalar_t x = register_beta<scalar_t, kLanes>(step, T, v, emit_max_i, row_max, e_row, own_row);
    if (kPairwise) {
      register_pairwise<scalar_t, kLanes>(step, own, T, v, alpha_prev, offset_prev, beta_offset, log_z, col_max,
                                          e_col, own_transitions, g, acc);
    }

    // beta_{i-1} normalised to max 0; the offsets move one position back
    m = group_max(x, kLanes);
    if (step) {
      beta = m == kNegInf ? x : x - m;
      beta_offset += static_cast<double>(m);
    }
    emit_i = emit_next;
    emit_next = emit_later;
    emit_max_i = emit_max_next;
    alpha_i = alpha_prev;
    alpha_prev = alpha_ahead;
    alpha_ahead = alpha_later;
    offset_i = offset_prev;
    offset_prev = offset_ahead;
    offset_ahead = offset_later;
  }
}

// The lane's column of a sentence's transition counts (out[s * T + lane] for s < T, where the
// lane owns a tag), from its accumulators, which it leaves at zero for the next sentence.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void move_counts_column(scalar_t* out, scalar_t (&acc)[kLanes], int T, int lane, bool own) {
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    if (own && s < T) out[s * T + lane] = acc[s];
    acc[s] = 0;
  }
}

// The lane's entries of the group's slice of the partial sums (lane < T): its column of the
// transitions, start[lane] and end[lane].
template <typename scalar_t, int kLanes>
__device__ __forceinline__ void store_accumulators(scalar_t* out, const scalar_t (&acc)[kLanes], scalar_t acc_start,
                                                   scalar_t acc_end, int T, int lane) {
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    if (s < T) out[s * T + lane] = acc[s];
  }
  out[T * T + lane] = acc_start;
  out[T * T + T + lane] = acc_end;
}

// One group of kLanes lanes per sentence, lane t owning tag t; the grid is persistent (a group
// takes sentences first, first + the grid's groups, ...). The lane's tables go to registers once;
// then per sentence: the forward pass, log Z, and for the ops that need it the backward pass;
// the gradients the groups accumulated over their sentences go out at the end.
template <typename scalar_t, Output kOut, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) register_forward_backward_kernel(const FbParams<scalar_t> p) {
  constexpr bool kKeepRows = kOut != Output::kLogPartition;
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  const int T = p.num_tags;
  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  const bool own = lane < T;  // the lane owns tag `lane`
  const int64_t slot = (int64_t)blockIdx.x * kGroupsPerBlock + group;
  const int64_t L = p.max_len;
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t* __restrict__ emissions = p.emissions;

  // The lane's column of E (forward, pairwise) and row of E (backward); zeros beyond T.
  scalar_t e_col[kLanes], e_row[kLanes], col_max, row_max;
  load_lane_tables<scalar_t, kLanes, kKeepRows>(p.tables, T, lane, own, e_col, e_row, col_max, row_max);
  const scalar_t start = own ? p.start[lane] : kNegInf;
  const scalar_t end = own ? p.end[lane] : kNegInf;
  const scalar_t* own_transitions = p.transitions + (own ? lane : 0);  // column `lane`: [s * T]
  const scalar_t* own_row = p.transitions + (own ? lane : 0) * T;      // row `lane`: [t]

  // Pairwise sums of the lane's column: acc[s] for transitions s -> lane; start / end (kBackward).
  scalar_t acc[kLanes];
#pragma unroll
  for (int s = 0; s < kLanes; ++s) acc[s] = 0;
  scalar_t acc_start = 0, acc_end = 0;

  const int64_t grid_groups = (int64_t)gridDim.x * kGroupsPerBlock;
  for (int64_t first = (int64_t)blockIdx.x * kGroupsPerBlock; first < p.batch; first += grid_groups) {
    const int64_t b = first + group;
    const bool has_sentence = b < p.batch;
    const int64_t n = has_sentence ? safe_length(p.lengths, b, L) : 0;  // 0 if out of range: read nothing
    const int64_t steps = warp_max(n);
    const int64_t b_safe = has_sentence ? b : 0;
    const scalar_t* emit = emissions + b_safe * L * T + lane;  // the lane's column, stride T
    scalar_t* rows = kKeepRows ? p.rows + b_safe * L * T + lane : nullptr;
    double* offsets = kKeepRows ? p.offsets + slot * L : nullptr;

    // ---- forward ----
    bool bad = false;
    double offset = 0;
    const scalar_t a = register_forward_pass<scalar_t, kKeepRows, kLanes>(emit, rows, offsets, n, steps, T, lane, own,
                                                                         start, col_max, e_col, own_transitions,
                                                                         offset, bad);
    // log Z = offset + logsumexp_t(alpha_hat[t] + end[t])
    const scalar_t last = n > 0 ? a + end : kNegInf;
    scalar_t m = group_max(last, kLanes);
    const scalar_t sum = group_sum(n > 0 && m != kNegInf ? exp_(last - m) : scalar_t(0), kLanes);
    double log_z;
    bad = finish_forward<scalar_t, kOut>(p, b_safe, has_sentence, n, offset, m, sum, bad, kLanes, lane, log_z);
    if (kOut == Output::kLogPartition) continue;

    // ---- backward: beta_hat (max 0, offset in double), marginals, pairwise marginals ----
    bool skip;
    const scalar_t g = gradient_weight<scalar_t, kOut>(p, b_safe, has_sentence, n, bad, log_z, skip);
    register_backward_pass<scalar_t, kOut, kLanes>(emit, rows, offsets, n, steps, T, own, g, skip, log_z, end, col_max,
                                                   row_max, e_col, e_row, own_transitions, own_row, acc, acc_start,
                                                   acc_end);
    if (has_sentence && own) {  // positions beyond the sentence: 0 (the host does not clear the rows)
      for (int64_t i = n; i < L; ++i) rows[i * T] = 0;
    }
    if (kOut == Output::kWithMarginals && has_sentence) {  // the lane's column of the counts
      move_counts_column(p.counts + b * T * T, acc, T, lane, own);
    }
  }
  if (kOut == Output::kBackward && lane < T) {  // the lane's entries of the group's slice
    store_accumulators(p.partials + slot * ((int64_t)T * T + 2 * T), acc, acc_start, acc_end, T, lane);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
