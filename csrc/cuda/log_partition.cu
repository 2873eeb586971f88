// CUDA kernels: log partition (forward algorithm), marginals and the analytic backward of
// log Z (forward-backward), one fused kernel per op with the whole time loop inside.
//
// Two kernels: for T <= 32 (float; 16 in double) register_forward_backward_kernel, with every
// per-position value in registers; otherwise forward_backward_kernel, described here.
// Layout: one group of G lanes per sentence (common.cuh); lane l owns tags l, l + G, ...
// Per position and tag the forward step is the factored log-space step of the CPU kernels
// (csrc/cpu/log_space.h):
//     alpha_next[t] = col_max[t] + log(sum_s p[s] * E[s][t]) + emit[t],
//     p[s] = exp(alpha_hat[s])  (alpha_hat normalised to max 0: p <= 1),
//     E[s][t] = exp(trans[s, t] - col_max[t])  (one table for the whole call),
// i.e. one exponential (p of the lane's own tag, shared through the group's arena), T
// multiply-adds and one logarithm per tag; a column whose sum falls below trusted_sum_min
// (csrc/numerics.h) is recomputed exactly (max-shifted logsumexp). The rows are normalised
// after every position (offsets accumulated in double), exactly like the CPU kernels, so
// float32 stays accurate on long sentences with large scores. Results agree with the CPU kernels to rounding, not bit
// for bit (different summation order, and the CPU also has a probability-space fast path).
//
// Marginals / backward / log Z with marginals: the forward pass stores the normalised alpha
// rows in the OUTPUT tensor itself (B, L, T) (no extra O(B L T) workspace), and the backward
// pass, from the last position to the first, reads row i, overwrites it with the marginals of
// position i, and reads row i-1 for the pairwise (transition) marginals. The same lane wrote
// and reads each entry. The running offsets (needed for the pairwise shift against log Z) go to
// a per-group (L,) double workspace. Marginals are normalised per position (they sum to one),
// pairwise marginals per position pair, as in the CPU kernels. Gradients of transitions /
// start / end are accumulated per group (in shared memory when it fits, else in a per-group
// slice of global memory) and summed over groups afterwards in a fixed order: deterministic for
// a given device.
//
// log_partition_with_marginals (the forward of a differentiable log Z, csrc/autograd.cpp) runs
// the same kernel for an upstream gradient of 1 and keeps per sentence what the backward sums
// over the batch: log Z, the marginals and the expected transition counts (B, T, T). The
// backward is then log_partition_backward_from_marginals (below): those scaled by the upstream
// gradient, with no second forward-backward pass and no second status read.
#include <torch/library.h>

#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

// kBackward: the gradients for a given grad_log_z, summed over the batch;
// kWithMarginals: log Z, and the gradients for grad_log_z = 1 kept per sentence.
enum class Output { kLogPartition, kMarginals, kBackward, kWithMarginals };

// Transition tables, one array of scalars:
//   [0, T*T)             e_col[s * T + t]   = exp(trans[s, t] - col_max[t])  (0 if col_max = -inf)
//   [T*T, T*T + T)       col_max[t]
//   [T*T + T, 2T*T + T)  e_row_t[t * T + s] = exp(trans[s, t] - row_max[s])  (0 if row_max = -inf)
//   [2T*T + T, 2T*T+2T)  row_max[s]
// Both tables are indexed [other][own] so that the lanes of a group, which own consecutive
// tags, read consecutive addresses.
__host__ __device__ inline int64_t table_elements(int64_t T) { return 2 * T * T + 2 * T; }

template <typename scalar_t>
__global__ void transition_tables_kernel(const scalar_t* transitions, int T, scalar_t* tables) {
  for (int line = blockIdx.x * blockDim.x + threadIdx.x; line < 2 * T; line += gridDim.x * blockDim.x) {
    const bool column = line < T;  // lines [0, T): columns t; [T, 2T): rows s
    const int own = column ? line : line - T;
    auto at = [&](int other) {
      return column ? transitions[other * T + own] : transitions[own * T + other];
    };
    scalar_t line_max = neg_inf<scalar_t>();
    for (int other = 0; other < T; ++other) line_max = max_(line_max, at(other));
    scalar_t* scaled = column ? tables : tables + T * T + T;
    (column ? tables + T * T : tables + 2 * T * T + T)[own] = line_max;
    for (int other = 0; other < T; ++other) {
      scaled[other * T + own] = line_max == neg_inf<scalar_t>() ? scalar_t(0) : exp_(at(other) - line_max);
    }
  }
}

template <typename scalar_t>
struct FbParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  const scalar_t* grad_log_z;   // (B,), kBackward only
  const scalar_t* tables;       // table_elements(T), global
  scalar_t* log_z;              // (B,), kLogPartition and kWithMarginals
  scalar_t* rows;               // (B, L, T): alpha rows, then the (weighted) marginals
  double* offsets;              // (slots, L), kBackward and kWithMarginals
  scalar_t* partials;           // (slots, T*T + 2T): per-group gradient sums, kBackward only
  scalar_t* counts;             // (B, T, T): expected transition counts, kWithMarginals only
  unsigned char* arena_workspace;  // (slots, arena_bytes) when the arenas are not in shared memory
  long long* status;
  int64_t batch, max_len;
  int num_tags;
  SharedPlan plan;
  size_t arena_bytes, accumulator_bytes;  // per group, aligned
};

// logsumexp_s(alpha[s] + trans[s, t]) exactly; -inf when every term is -inf.
template <typename scalar_t>
__device__ scalar_t exact_column_lse(const scalar_t* alpha, const scalar_t* transitions, int T, int t) {
  scalar_t m = neg_inf<scalar_t>();
  for (int s = 0; s < T; ++s) m = max_(m, alpha[s] + transitions[s * T + t]);
  if (m == neg_inf<scalar_t>()) return m;
  scalar_t sum = 0;
  for (int s = 0; s < T; ++s) sum += exp_(alpha[s] + transitions[s * T + t] - m);
  return m + log_(sum);
}

// logsumexp_t(trans[s, t] + v[t]) exactly; -inf when every term is -inf.
template <typename scalar_t>
__device__ scalar_t exact_row_lse(const scalar_t* v, const scalar_t* transitions, int T, int s) {
  const scalar_t* row = transitions + s * T;
  scalar_t m = neg_inf<scalar_t>();
  for (int t = 0; t < T; ++t) m = max_(m, v[t] + row[t]);
  if (m == neg_inf<scalar_t>()) return m;
  scalar_t sum = 0;
  for (int t = 0; t < T; ++t) sum += exp_(v[t] + row[t] - m);
  return m + log_(sum);
}

// The pairwise marginals of column t, xi[s, t] = exp(alpha_prev[s] + trans[s, t] + v[t] + shift)
// for all s, where shift = offset[i-1] + beta_offset - log Z makes them probabilities. Factored
// (coef * p[s] * E[s][t], coef = exp(col_max[t] + v[t] + shift)) when the shift is small enough
// that no term that matters underflows, exactly otherwise (as the CPU kernel).
// kAccumulate = false: returns sum_s xi[s, t]; true: acc[s * T + t] += scale * xi[s, t].
template <typename scalar_t, bool kAccumulate>
__device__ scalar_t pairwise_column(int t, int T, scalar_t v_t, scalar_t shift, const scalar_t* alpha_prev,
                                    const scalar_t* p, const scalar_t* e_col, const scalar_t* col_max,
                                    const scalar_t* transitions, scalar_t scale, scalar_t* acc) {
  const scalar_t w = col_max[t] + v_t + shift;
  if (w == neg_inf<scalar_t>()) return 0;
  scalar_t sum = 0;
  if (w <= pairwise_fast_bound<scalar_t>()) {
    const scalar_t coef = exp_(w);
    if (kAccumulate) {
      const scalar_t c = scale * coef;
      for (int s = 0; s < T; ++s) acc[s * T + t] += c * (p[s] * e_col[s * T + t]);
    } else {
      for (int s = 0; s < T; ++s) sum += p[s] * e_col[s * T + t];
    }
    return coef * sum;
  }
  for (int s = 0; s < T; ++s) {
    const scalar_t xi = exp_(alpha_prev[s] + transitions[s * T + t] + v_t + shift);
    if (kAccumulate) {
      acc[s * T + t] += scale * xi;
    } else {
      sum += xi;
    }
  }
  return sum;
}

// The end of a sentence's forward pass, shared by both kernels: log Z = offset + m + log(sum)
// (m, sum: the group's max and sum of exp(alpha_hat + end - m)); 0 for an empty sentence, -inf
// when every sequence is forbidden. Reports bad emissions found by any lane of the group, writes
// log Z where the op returns it, and returns whether the sentence had bad emissions.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ bool finish_forward(const FbParams<scalar_t>& p, int64_t b, bool has_sentence, int64_t n,
                                               double offset, scalar_t m, scalar_t sum, bool bad, int lanes,
                                               int lane, double& log_z) {
  log_z = 0;  // the empty sequence of a length-0 sentence
  if (n > 0) {
    log_z = (offset == -CUDART_INF || m == neg_inf<scalar_t>()) ? -CUDART_INF
                                                                : offset + static_cast<double>(m + log_(sum));
  }
  bad = group_max(static_cast<int>(bad), lanes) != 0;
  if (bad && lane == 0) report(p.status, kBadEmissions, b);
  if (kOut == Output::kLogPartition || kOut == Output::kWithMarginals) {
    if (has_sentence && lane == 0) p.log_z[b] = static_cast<scalar_t>(log_z);
  }
  return bad;
}

// The weight of a sentence's gradients (its upstream gradient of log Z; 1 for the ops that
// return unweighted marginals), and whether its backward pass is skipped: empty, bad emissions,
// every sequence forbidden, or nothing to propagate. Skipped sentences get all-zero gradients
// (no NaN).
template <typename scalar_t, Output kOut>
__device__ __forceinline__ scalar_t gradient_weight(const FbParams<scalar_t>& p, int64_t b, bool has_sentence,
                                                    int64_t n, bool bad, double log_z, bool& skip) {
  const scalar_t g = kOut == Output::kBackward ? (has_sentence ? p.grad_log_z[b] : scalar_t(0)) : scalar_t(1);
  skip = n == 0 || bad || log_z == -CUDART_INF || g == 0;
  return g;
}

template <typename scalar_t, Output kOut, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) forward_backward_kernel(const FbParams<scalar_t> p) {
  constexpr bool kKeepRows = kOut != Output::kLogPartition;
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
  // kWithMarginals: the pairwise marginals go to each sentence's counts, and the start / end
  // gradients are left to the backward (the marginals' first and last rows).
  constexpr bool kCountsPerSentence = kOut == Output::kWithMarginals;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int T = p.num_tags;
  const int G = p.plan.lanes;
  const int groups_per_block = p.plan.groups_per_block;
  const int group = threadIdx.x / G;
  const int lane = threadIdx.x % G;
  const int64_t slot = (int64_t)blockIdx.x * groups_per_block + group;
  const int64_t L = p.max_len;
  const scalar_t kNegInf = neg_inf<scalar_t>();

  // Shared memory in plan order: arenas, accumulators, tables.
  unsigned char* cursor = shared_raw;
  unsigned char* arena_bytes = group_arena<kAllShared>(cursor, p.plan, p.arena_bytes, p.arena_workspace, group, slot);
  const int64_t accumulator_elements = (int64_t)T * T + 2 * T;
  const bool acc_in_shared = kAllShared || p.plan.accumulator_in_shared;
  scalar_t* acc = nullptr;  // [s * T + t] transitions, then start (T), then end (T)
  if (kPairwise) {
    if (!acc_in_shared) {
      // zero-initialised by the host; with counts per sentence, set for each sentence below
      acc = kCountsPerSentence ? nullptr : p.partials + slot * accumulator_elements;
    } else {
      acc = reinterpret_cast<scalar_t*>(cursor + group * p.accumulator_bytes);
      cursor += groups_per_block * p.accumulator_bytes;
      for (int t = lane; t < T; t += G) {
        for (int s = 0; s < T; ++s) acc[s * T + t] = 0;
        acc[T * T + t] = 0;
        acc[T * T + T + t] = 0;
      }
    }
  }
  const scalar_t* tables = stage_table<kAllShared>(cursor, p.plan.tables_in_shared, p.tables, table_elements(T));
  __syncthreads();  // the only block-wide barrier: tables are ready
  const scalar_t* e_col = tables;
  const scalar_t* col_max = tables + T * T;
  const scalar_t* e_row_t = col_max + T;
  const scalar_t* row_max = e_row_t + T * T;

  // The group's arena, (T,) vectors: the two alpha rows, p = exp(alpha) of the previous row,
  // and for the backward beta, v = emit + beta, q = exp(v - max v), alpha of the previous row.
  scalar_t* arena = reinterpret_cast<scalar_t*>(arena_bytes);
  scalar_t* const alpha_a = arena;
  scalar_t* const alpha_b = arena + T;
  scalar_t* const pbuf = arena + 2 * T;
  scalar_t* const beta = arena + 3 * T;
  scalar_t* const vbuf = arena + 4 * T;
  scalar_t* const qbuf = arena + 5 * T;
  scalar_t* const alpha_prev = arena + 6 * T;

  const int64_t grid_groups = (int64_t)gridDim.x * groups_per_block;
  for (int64_t first = (int64_t)blockIdx.x * groups_per_block; first < p.batch; first += grid_groups) {
    __syncwarp();  // the previous sentence is finished by every lane before the arena is reused
    const int64_t b = first + group;
    const bool has_sentence = b < p.batch;
    const int64_t n = has_sentence ? safe_length(p.lengths, b, L) : 0;  // 0 if out of range: read nothing
    const int64_t steps = warp_max(n);
    const int64_t b_safe = has_sentence ? b : 0;
    const scalar_t* emit = p.emissions + b_safe * L * T;
    scalar_t* rows = kKeepRows ? p.rows + b_safe * L * T : nullptr;
    double* offsets = kPairwise ? p.offsets + slot * L : nullptr;
    if (kCountsPerSentence && !acc_in_shared) acc = p.counts + b_safe * T * T;  // written by no one else

    // ---- forward: normalised alpha rows, running offset in double ----
    bool bad = false;
    double offset = 0;
    scalar_t* cur = alpha_a;
    scalar_t* next = alpha_b;
    scalar_t local = kNegInf;
    if (n > 0) {
      for (int t = lane; t < T; t += G) {
        const scalar_t e = emit[t];
        bad |= is_nan_or_pos_inf(e);
        const scalar_t x = p.start[t] + e;
        cur[t] = x;
        local = max_(local, x);
      }
    }
    scalar_t m = group_max(local, G);
    if (n > 0) {
      offset = m == kNegInf ? -CUDART_INF : static_cast<double>(m);
      for (int t = lane; t < T; t += G) {
        if (m != kNegInf) cur[t] -= m;
        if (kKeepRows) rows[t] = cur[t];
      }
      if (kPairwise && lane == 0) offsets[0] = offset;
    }
    // The emission of the lane's first tag is loaded one position ahead, so that its latency
    // overlaps a whole step (the time loop is latency-bound); further tags (T > G) are read
    // when used. Only positions within the sentence are ever read.
    scalar_t emit_ahead = lane < T && n > 1 ? emit[T + lane] : scalar_t(0);
    for (int64_t i = 1; i < steps; ++i) {
      const bool active = i < n;
      __syncwarp();  // cur complete; everyone done reading pbuf of the previous step
      if (active) {
        for (int t = lane; t < T; t += G) pbuf[t] = exp_(cur[t]);
      }
      __syncwarp();  // pbuf complete
      local = kNegInf;
      if (active) {
        const scalar_t* emit_i = emit + i * T;
        const scalar_t emit_first = emit_ahead;
        if (lane < T && i + 1 < n) emit_ahead = emit_i[T + lane];
        for (int t = lane; t < T; t += G) {
          const scalar_t e = t == lane ? emit_first : emit_i[t];
          bad |= is_nan_or_pos_inf(e);
          const scalar_t c_max = col_max[t];
          scalar_t x = kNegInf;
          if (c_max != kNegInf) {
            scalar_t sum = 0;
            for (int s = 0; s < T; ++s) sum += pbuf[s] * e_col[s * T + t];
            x = sum >= trusted_sum_min<scalar_t>() ? c_max + log_(sum)
                                                   : exact_column_lse(cur, p.transitions, T, t);
          }
          x += e;
          next[t] = x;
          local = max_(local, x);
        }
      }
      m = group_max(local, G);
      if (active) {
        for (int t = lane; t < T; t += G) {
          if (m != kNegInf) next[t] -= m;
          if (kKeepRows) rows[i * T + t] = next[t];
        }
        offset += static_cast<double>(m);  // -inf once every sequence is forbidden
        if (kPairwise && lane == 0) offsets[i] = offset;
        scalar_t* swap = cur;
        cur = next;
        next = swap;
      }
    }
    // log Z = offset + logsumexp_t(alpha_hat[t] + end[t])
    local = kNegInf;
    if (n > 0) {
      for (int t = lane; t < T; t += G) local = max_(local, cur[t] + p.end[t]);
    }
    m = group_max(local, G);
    scalar_t sum = 0;
    if (n > 0 && m != kNegInf) {
      for (int t = lane; t < T; t += G) sum += exp_(cur[t] + p.end[t] - m);
    }
    sum = group_sum(sum, G);
    double log_z;
    bad = finish_forward<scalar_t, kOut>(p, b_safe, has_sentence, n, offset, m, sum, bad, G, lane, log_z);
    if (kOut == Output::kLogPartition) continue;

    // ---- backward: beta rows (normalised, offset in double), marginals, pairwise marginals ----
    bool skip;
    const scalar_t g = gradient_weight<scalar_t, kOut>(p, b_safe, has_sentence, n, bad, log_z, skip);
    if (n > 0 && skip) {  // the rows hold alpha: clear them
      for (int64_t i = 0; i < n; ++i) {
        for (int t = lane; t < T; t += G) rows[i * T + t] = 0;
      }
    }
    double beta_offset = 0;
    local = kNegInf;
    if (!skip) {
      for (int t = lane; t < T; t += G) {
        beta[t] = p.end[t];
        local = max_(local, beta[t]);
      }
    }
    m = group_max(local, G);
    if (!skip) {
      if (m != kNegInf) {
        for (int t = lane; t < T; t += G) beta[t] -= m;
      }
      beta_offset = static_cast<double>(m);
    }
    // One position ahead, for the lane's first tag (as in the forward): the emission of the
    // next step's v and the alpha row the next step needs for the pairwise terms; and the
    // running offset of the forward that the pairwise shift needs.
    const bool ahead = !skip && lane < T;
    scalar_t emit_ahead_b = ahead && n > 1 ? emit[(n - 1) * T + lane] : scalar_t(0);
    scalar_t alpha_ahead = ahead && n > 1 ? rows[(n - 2) * T + lane] : scalar_t(0);
    double offset_ahead = kPairwise && !skip && n > 1 ? offsets[n - 2] : 0.0;
    for (int64_t j = 0; j < steps; ++j) {
      const bool active = !skip && j < n;
      const int64_t i = n - 1 - j;
      // Marginals at position i, normalised over tags (see csrc/cpu/log_partition.cpp).
      // Alpha of row i: from the rows for the last position, else from alpha_prev, where the
      // previous step put it (the lane's own entries).
      local = kNegInf;
      if (active) {
        for (int t = lane; t < T; t += G) {
          const scalar_t u = (j == 0 ? rows[i * T + t] : alpha_prev[t]) + beta[t];
          vbuf[t] = u;  // own entry, as scratch until step C below
          local = max_(local, u);
        }
      }
      const scalar_t u_max = group_max(local, G);
      scalar_t part = 0;
      if (active && u_max != kNegInf) {
        for (int t = lane; t < T; t += G) {
          const scalar_t x = exp_(vbuf[t] - u_max);
          vbuf[t] = x;
          part += x;
        }
      }
      const scalar_t total = group_sum(part, G);
      if (active) {
        const scalar_t scale = g / total;
        for (int t = lane; t < T; t += G) {
          const scalar_t mu = u_max == kNegInf ? scalar_t(0) : vbuf[t] * scale;
          rows[i * T + t] = mu;
          if (kPairwise && !kCountsPerSentence) {
            if (i == n - 1) acc[T * T + T + t] += mu;  // end
            if (i == 0) acc[T * T + t] += mu;          // start
          }
        }
      }
      const bool step = active && i > 0;  // positions i-1 -> i remain
      // C: v = emit_i + beta_i
      local = kNegInf;
      scalar_t alpha_first = 0;
      double offset_prev = 0;
      if (step) {
        const scalar_t* emit_i = emit + i * T;
        const scalar_t emit_first = emit_ahead_b;
        alpha_first = alpha_ahead;
        offset_prev = offset_ahead;
        if (lane < T && i - 1 > 0) emit_ahead_b = emit_i[-T + lane];
        if (lane < T && i - 2 >= 0) alpha_ahead = rows[(i - 2) * T + lane];
        if (kPairwise && i - 2 >= 0) offset_ahead = offsets[i - 2];
        for (int t = lane; t < T; t += G) {
          const scalar_t x = (t == lane ? emit_first : emit_i[t]) + beta[t];
          vbuf[t] = x;
          local = max_(local, x);
        }
      }
      const scalar_t v_max = group_max(local, G);
      // D: q = exp(v - max v); alpha of row i-1 (for the next step's marginals) and its
      // exponential for the pairwise terms
      if (step) {
        for (int t = lane; t < T; t += G) {
          qbuf[t] = v_max == kNegInf ? scalar_t(0) : exp_(vbuf[t] - v_max);
          const scalar_t a = t == lane ? alpha_first : rows[(i - 1) * T + t];
          alpha_prev[t] = a;
          if (kPairwise) pbuf[t] = exp_(a);
        }
      }
      __syncwarp();  // vbuf, qbuf, alpha_prev, pbuf complete
      if (kPairwise) {
        const scalar_t shift = step ? static_cast<scalar_t>(offset_prev + beta_offset - log_z) : scalar_t(0);
        scalar_t pair_part = 0;
        if (step) {
          for (int t = lane; t < T; t += G) {
            pair_part += pairwise_column<scalar_t, false>(t, T, vbuf[t], shift, alpha_prev, pbuf, e_col, col_max,
                                                          p.transitions, scalar_t(0), nullptr);
          }
        }
        const scalar_t pair_total = group_sum(pair_part, G);
        if (step && pair_total > 0) {
          const scalar_t scale = g / pair_total;
          for (int t = lane; t < T; t += G) {
            pairwise_column<scalar_t, true>(t, T, vbuf[t], shift, alpha_prev, pbuf, e_col, col_max, p.transitions,
                                            scale, acc);
          }
        }
      }
      // F: beta_{i-1}[s] = logsumexp_t(trans[s, t] + v[t]), in place (beta is read by its owner only)
      local = kNegInf;
      if (step) {
        for (int s = lane; s < T; s += G) {
          const scalar_t r_max = row_max[s];
          scalar_t x = kNegInf;
          if (r_max != kNegInf && v_max != kNegInf) {
            scalar_t row_sum = 0;
            for (int t = 0; t < T; ++t) row_sum += qbuf[t] * e_row_t[t * T + s];
            x = row_sum >= trusted_sum_min<scalar_t>() ? v_max + r_max + log_(row_sum)
                                                       : exact_row_lse(vbuf, p.transitions, T, s);
          }
          beta[s] = x;
          local = max_(local, x);
        }
      }
      m = group_max(local, G);
      if (step) {
        if (m != kNegInf) {
          for (int s = lane; s < T; s += G) beta[s] -= m;
        }
        beta_offset += static_cast<double>(m);
      }
      __syncwarp();  // everyone done reading vbuf, qbuf, pbuf, alpha_prev of this step
    }
    if (kCountsPerSentence && acc_in_shared && has_sentence) {  // own columns to the sentence's counts
      scalar_t* out = p.counts + b * T * T;
      for (int t = lane; t < T; t += G) {
        for (int s = 0; s < T; ++s) {
          out[s * T + t] = acc[s * T + t];
          acc[s * T + t] = 0;
        }
      }
    }
  }
  if (kOut == Output::kBackward && acc_in_shared) {  // own entries to the group's slice
    scalar_t* out = p.partials + slot * accumulator_elements;
    for (int t = lane; t < T; t += G) {
      for (int s = 0; s < T; ++s) out[s * T + t] = acc[s * T + t];
      out[T * T + t] = acc[T * T + t];
      out[T * T + T + t] = acc[T * T + T + t];
    }
  }
}

// ---- small T: the same op with every per-position value in registers -----------------------
// For T <= kLanes (8, 16 or 32; float up to 32, double up to 16) one group of kLanes lanes per
// sentence, lane t owning tag t, and nothing per position in memory: each lane keeps its
// column of E (and, for the backward, its row) in registers, the group's p = exp(alpha) reaches
// the other lanes by shuffles, and the pairwise sums of the lane's column accumulate in
// registers. The generic kernel above passes every row through the group's shared arena with a
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

template <typename scalar_t, Output kOut, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) register_forward_backward_kernel(const FbParams<scalar_t> p) {
  constexpr bool kKeepRows = kOut != Output::kLogPartition;
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
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
  scalar_t e_col[kLanes], e_row[kLanes];
  const scalar_t* col_max_table = p.tables + T * T;
  const scalar_t* e_row_t = col_max_table + T;
  const scalar_t* row_max_table = e_row_t + T * T;
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    e_col[s] = own && s < T ? p.tables[s * T + lane] : scalar_t(0);
    e_row[s] = kKeepRows && own && s < T ? e_row_t[s * T + lane] : scalar_t(0);
  }
  const scalar_t col_max = own ? col_max_table[lane] : kNegInf;
  const scalar_t row_max = own ? row_max_table[lane] : kNegInf;
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
    // log Z = offset + logsumexp_t(alpha_hat[t] + end[t])
    const scalar_t last = n > 0 ? a + end : kNegInf;
    m = group_max(last, kLanes);
    const scalar_t sum = group_sum(n > 0 && m != kNegInf ? exp_(last - m) : scalar_t(0), kLanes);
    double log_z;
    bad = finish_forward<scalar_t, kOut>(p, b_safe, has_sentence, n, offset, m, sum, bad, kLanes, lane, log_z);
    if (kOut == Output::kLogPartition) continue;

    // ---- backward: beta_hat (max 0, offset in double), marginals, pairwise marginals ----
    bool skip;
    const scalar_t g = gradient_weight<scalar_t, kOut>(p, b_safe, has_sentence, n, bad, log_z, skip);
    if (n > 0 && skip && own) {  // the rows hold alpha: clear them
      for (int64_t i = 0; i < n; ++i) rows[i * T] = 0;
    }
    __syncwarp();  // offsets[] from lane 0 visible to the group
    scalar_t beta = skip ? kNegInf : end;
    m = group_max(beta, kLanes);
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

      // beta_{i-1}[lane] = logsumexp_t(trans[lane, t] + v[t]), v = emit_i + beta_i, factored
      // with the shift max_t emit_i[t] (v - shift <= 0 since beta <= 0).
      const scalar_t v = emit_i + beta;  // -inf off own
      const scalar_t row_sum = group_dot(exp_(v - emit_max_i), e_row);
      const bool sum_is_trusted = row_sum >= trusted_sum_min<scalar_t>();
      scalar_t x = row_max != kNegInf && sum_is_trusted ? emit_max_i + row_max + log_(row_sum) : kNegInf;
      const bool need_exact = step && row_max != kNegInf && !sum_is_trusted;  // row_max = -inf off own
      if (__any_sync(kFullMask, need_exact)) {  // logsumexp_t(trans[lane, t] + v[t])
        const scalar_t exact = group_exact_lse<scalar_t, kLanes>(v, own_row, 1, T);
        if (need_exact) x = exact;
      }

      // Pairwise marginals of positions (i-1, i), lane's column: xi[s] = exp(alpha_prev[s] +
      // trans[s, lane] + v[lane] + shift), accumulated with weight g / (their sum).
      if (kPairwise) {
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
    if (kOut == Output::kWithMarginals && has_sentence) {  // the lane's column of the counts
      scalar_t* out = p.counts + b * T * T;
#pragma unroll
      for (int s = 0; s < kLanes; ++s) {
        if (own && s < T) out[s * T + lane] = acc[s];
        acc[s] = 0;
      }
    }
  }
  if (kOut == Output::kBackward && lane < T) {  // the lane's entries of the group's slice
    scalar_t* out = p.partials + slot * ((int64_t)T * T + 2 * T);
#pragma unroll
    for (int s = 0; s < kLanes; ++s) {
      if (s < T) out[s * T + lane] = acc[s];
    }
    out[T * T + lane] = acc_start;
    out[T * T + T + lane] = acc_end;
  }
}

struct FbOutputs {
  at::Tensor log_z;   // (B,)
  at::Tensor rows;    // (B, L, T) marginals (weighted by grad_log_z for the backward)
  at::Tensor counts;  // (B, T, T) expected transition counts (kWithMarginals)
  at::Tensor grad_transitions, grad_start, grad_end;
};

template <typename scalar_t, Output kOut>
void launch_forward_backward(const CrfArgs& a, const at::Tensor& grad_log_z, FbOutputs& out, Status& status) {
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
  constexpr bool kWithMarginals = kOut == Output::kWithMarginals;
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const auto options = a.emissions.options();
  const cudaStream_t stream = current_stream();
  if (kOut == Output::kLogPartition || kWithMarginals) out.log_z = at::empty({B}, options);
  if (kOut != Output::kLogPartition) out.rows = at::zeros_like(a.emissions);
  if (kWithMarginals && B == 0) out.counts = at::zeros({0, T, T}, options);
  if (B == 0) {
    if (kOut == Output::kBackward) {
      out.grad_transitions = at::zeros({T, T}, options);
      out.grad_start = at::zeros({T}, options);
      out.grad_end = at::zeros({T}, options);
    }
    return;
  }
  at::Tensor tables = at::empty({table_elements(T)}, options);
  transition_tables_kernel<scalar_t><<<(int)std::min<int64_t>((2 * T + 127) / 128, 1024), 128, 0, stream>>>(
      a.transitions.data_ptr<scalar_t>(), (int)T, tables.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // The kernel and where its buffers live: the register kernel for small T (no shared memory,
  // blocks of 4 warps, one group of kLanes >= 8 lanes per sentence), else the generic one.
  const bool in_registers = T <= register_max_tags<scalar_t>();
  const size_t arena_bytes = align_up((kOut == Output::kLogPartition ? 3 : 7) * T * sizeof(scalar_t));
  const int64_t accumulator_elements = kPairwise ? T * T + 2 * T : 0;
  const size_t accumulator_bytes = align_up(accumulator_elements * sizeof(scalar_t));
  const size_t table_bytes = align_up(table_elements(T) * sizeof(scalar_t));
  SharedPlan plan;
  void (*kernel)(const FbParams<scalar_t>) = nullptr;
  if (in_registers) {
    plan.lanes = std::max(8, lanes_per_sentence(T));
    plan.threads = kMaxThreadsPerBlock;
    plan.groups_per_block = plan.threads / plan.lanes;
    kernel = plan.lanes == 8    ? register_forward_backward_kernel<scalar_t, kOut, 8>
             : plan.lanes == 16 ? register_forward_backward_kernel<scalar_t, kOut, 16>
                                : register_forward_backward_kernel<scalar_t, kOut, register_max_tags<scalar_t>()>;
  } else {
    plan = plan_shared(T, arena_bytes, accumulator_bytes, table_bytes);
    kernel = all_in_shared(plan, kPairwise) ? forward_backward_kernel<scalar_t, kOut, true>
                                            : forward_backward_kernel<scalar_t, kOut, false>;
  }
  const int64_t blocks = persistent_blocks(kernel, plan, B);
  const int64_t slots = blocks * plan.groups_per_block;

  const auto bytes = options.dtype(at::kByte);
  at::Tensor arena_workspace = plan.arena_in_shared ? at::Tensor() : at::empty({slots * (int64_t)arena_bytes}, bytes);
  // The forward offsets per position: the generic kernel needs them for the pairwise terms, the
  // register kernel also for the marginals (exp(alpha + beta - log Z) with its known shift).
  const bool keep_offsets = kPairwise || (in_registers && kOut == Output::kMarginals);
  at::Tensor offsets = keep_offsets ? at::empty({slots, L}, options.dtype(at::kDouble)) : at::Tensor();
  // Accumulators in registers or shared memory are written whole (a group's slice of `partials`
  // at its end, each sentence's `counts` at the sentence's end); those in global memory are
  // accumulated into directly, so they start at zero.
  const bool written_whole = in_registers || plan.accumulator_in_shared;
  at::Tensor partials;
  if (kOut == Output::kBackward) {
    partials = written_whole ? at::empty({slots, accumulator_elements}, options)
                             : at::zeros({slots, accumulator_elements}, options);
  }
  if (kWithMarginals) out.counts = written_whole ? at::empty({B, T, T}, options) : at::zeros({B, T, T}, options);

  FbParams<scalar_t> params;
  params.emissions = a.emissions.data_ptr<scalar_t>();
  params.transitions = a.transitions.data_ptr<scalar_t>();
  params.start = a.start.data_ptr<scalar_t>();
  params.end = a.end.data_ptr<scalar_t>();
  params.lengths = a.lengths.data_ptr<int64_t>();
  params.grad_log_z = kOut == Output::kBackward ? grad_log_z.data_ptr<scalar_t>() : nullptr;
  params.tables = tables.data_ptr<scalar_t>();
  params.log_z = out.log_z.defined() ? out.log_z.data_ptr<scalar_t>() : nullptr;
  params.rows = kOut != Output::kLogPartition ? out.rows.data_ptr<scalar_t>() : nullptr;
  params.offsets = keep_offsets ? offsets.data_ptr<double>() : nullptr;
  params.partials = partials.defined() ? partials.data_ptr<scalar_t>() : nullptr;
  params.counts = kWithMarginals ? out.counts.data_ptr<scalar_t>() : nullptr;
  params.arena_workspace = arena_workspace.defined() ? arena_workspace.data_ptr<uint8_t>() : nullptr;
  params.status = status.data();
  params.batch = B;
  params.max_len = L;
  params.num_tags = (int)T;
  params.plan = plan;
  params.arena_bytes = arena_bytes;
  params.accumulator_bytes = accumulator_bytes;
  kernel<<<(unsigned)blocks, plan.threads, plan.shared_bytes, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (kOut == Output::kBackward) {  // fixed-order sum over the groups' partial sums: deterministic
    const at::Tensor sums = partials.sum(0);
    out.grad_transitions = sums.narrow(0, 0, T * T).reshape({T, T}).clone();
    out.grad_start = sums.narrow(0, T * T, T).clone();
    out.grad_end = sums.narrow(0, T * T + T, T).clone();
  }
}

// Table indices are int: T * T must fit.
void check_num_tags(int64_t T) {
  TORCH_CHECK_VALUE(T * T < (int64_t{1} << 31), "crfkit: the CUDA kernels support num_tags up to 46340, got ", T);
}

// One forward-backward launch for arguments checked and validated into `status` (the caller
// raises from it): log Z, marginals or gradients, as kOut says, for the emissions' dtype
// (launch_forward_backward<scalar_t, kOut>).
template <Output kOut>
FbOutputs dispatch_forward_backward(const CrfArgs& a, const at::Tensor& grad_log_z_in, Status& status) {
  const int64_t B = a.emissions.size(0);
  check_num_tags(a.emissions.size(2));
  at::Tensor grad_log_z;
  if (kOut == Output::kBackward) {
    grad_log_z = grad_log_z_in.contiguous();
    check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {B}, a.emissions, "emissions");
  }
  FbOutputs out;
  AT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_forward_backward_cuda", [&] {
    launch_forward_backward<scalar_t, kOut>(a, grad_log_z, out, status);
  });
  return out;
}

// The body of the forward-backward ops below: checks and validates the arguments, launches
// (dispatch_forward_backward) and raises from the status words (checked_launch, common.cuh).
template <Output kOut>
FbOutputs forward_backward_op(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& lengths,
                              const at::Tensor& start, const at::Tensor& end, const at::Tensor& grad_log_z = {}) {
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    return dispatch_forward_backward<kOut>(a, grad_log_z, status);
  });
}

}  // namespace

// log Z (B,) launched on the current stream for arguments already checked and validated
// (common.cuh); the caller raises from `status` (kbest_viterbi_with_log_probs in kbest.cu).
at::Tensor launch_log_partition(const CrfArgs& a, Status& status) {
  return dispatch_forward_backward<Output::kLogPartition>(a, at::Tensor(), status).log_z;
}

namespace {

// log Z per sentence: (B,).
at::Tensor log_partition_cuda(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& lengths,
                              const at::Tensor& start, const at::Tensor& end) {
  return forward_backward_op<Output::kLogPartition>(emissions, transitions, lengths, start, end).log_z;
}

// P(y_i = t | x): (B, L, T), zero at padded positions.
at::Tensor marginals_cuda(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& lengths,
                          const at::Tensor& start, const at::Tensor& end) {
  return forward_backward_op<Output::kMarginals>(emissions, transitions, lengths, start, end).rows;
}

// Gradients of sum_b grad_log_z[b] * log Z[b] with respect to emissions (B, L, T),
// transitions (T, T), start (T,) and end (T,).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_partition_backward_cuda(
    const at::Tensor& grad_log_z, const at::Tensor& emissions, const at::Tensor& transitions,
    const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
  FbOutputs out = forward_backward_op<Output::kBackward>(emissions, transitions, lengths, start, end, grad_log_z);
  return {out.rows, out.grad_transitions, out.grad_start, out.grad_end};
}

// log Z (B,) and its gradients for grad_log_z = 1, per sentence: the marginals (B, L, T) and the
// expected transition counts (B, T, T). One forward-backward pass, as on the CPU
// (csrc/cpu/log_partition.cpp, log_partition_with_marginals_cpu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> log_partition_with_marginals_cuda(
    const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& lengths, const at::Tensor& start,
    const at::Tensor& end) {
  FbOutputs out = forward_backward_op<Output::kWithMarginals>(emissions, transitions, lengths, start, end);
  return {out.log_z, out.rows, out.counts};
}

// E[number of s -> t transitions] per sentence: (B, T, T).
at::Tensor expected_transition_counts_cuda(const at::Tensor& emissions, const at::Tensor& transitions,
                                           const at::Tensor& lengths, const at::Tensor& start,
                                           const at::Tensor& end) {
  return forward_backward_op<Output::kWithMarginals>(emissions, transitions, lengths, start, end).counts;
}

// ---- the backward from saved marginals ----------------------------------------------------------
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 4096;  // grid-stride loops cover the rest

int64_t elementwise_blocks(int64_t count) {
  return grid_stride_blocks(count, kElementwiseThreads, kMaxElementwiseBlocks);
}

// grad_emissions[b, i, t] = grad_log_z[b] * marginals[b, i, t] within sentence b's length,
// exactly 0 beyond it (also for an infinite grad_log_z).
template <typename scalar_t>
__global__ void scale_marginals_kernel(const scalar_t* grad_log_z, const scalar_t* marginals, const int64_t* lengths,
                                       scalar_t* grad_emissions, int64_t batch, int64_t max_len, int64_t T) {
  const int64_t count = batch * max_len * T;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = k / (max_len * T);
    const int64_t i = k / T % max_len;
    grad_emissions[k] = i < lengths[b] ? grad_log_z[b] * marginals[k] : scalar_t(0);
  }
}

// The gradients shared by all sentences: transitions [0, T*T), start [T*T, T*T + T), end
// [T*T + T, T*T + 2T), one WARP per entry: lane l sums the sentences b = l, l + 32, ... in order,
// then a butterfly over the lanes adds the 32 partial sums, in the same order on every run
// (deterministic for a given device; it differs from the CPU kernel's sequential order by
// rounding only). One thread per entry summing all B sentences in order was slow, mostly
// waiting on one load after another (benchmarks/results/NOTES.md has the timings).
// Start / end read each sentence's first / last row of marginals; empty sentences (and lengths
// out of range, reported by validate_inputs_kernel) add nothing.
template <typename scalar_t>
__global__ void sum_parameter_grads_kernel(const scalar_t* grad_log_z, const scalar_t* marginals,
                                           const scalar_t* counts, const int64_t* lengths,
                                           scalar_t* grad_transitions, scalar_t* grad_start, scalar_t* grad_end,
                                           int64_t batch, int64_t max_len, int64_t T) {
  const int64_t count = T * T + 2 * T;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  for (int64_t k = (int64_t)blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; k < count;
       k += (int64_t)gridDim.x * warps_per_block) {  // k is warp-uniform: the shuffles below are legal
    const bool is_transition = k < T * T;
    const bool is_start = !is_transition && k < T * T + T;
    const int64_t t = is_transition ? 0 : (is_start ? k - T * T : k - T * T - T);
    scalar_t sum = 0;
    for (int64_t b = lane; b < batch; b += kWarpSize) {
      if (is_transition) {
        sum += grad_log_z[b] * counts[b * T * T + k];
      } else {
        const int64_t n = safe_length(lengths, b, max_len);
        if (n > 0) sum += grad_log_z[b] * marginals[(b * max_len + (is_start ? 0 : n - 1)) * T + t];
      }
    }
    sum = group_sum(sum, kWarpSize);
    if (lane == 0) (is_transition ? grad_transitions + k : (is_start ? grad_start : grad_end) + t)[0] = sum;
  }
}

// The backward of log_partition_with_marginals: the gradients of sum_b grad_log_z[b] log Z[b]
// with respect to emissions (B, L, T), transitions (T, T), start (T,) and end (T,), from that
// op's marginals (B, L, T) and transition counts (B, T, T). Two small kernels and the lengths'
// range check (one status read).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_partition_backward_from_marginals_cuda(
    const at::Tensor& grad_log_z_in, const at::Tensor& marginals_in, const at::Tensor& counts_in,
    const at::Tensor& lengths_in) {
  const at::Tensor grad_log_z = grad_log_z_in.contiguous(), marginals = marginals_in.contiguous(),
                   counts = counts_in.contiguous(), lengths = lengths_in.contiguous();
  check_backward_from_marginals_arguments(grad_log_z, marginals, counts, lengths);
  TORCH_CHECK(marginals.is_cuda(), "crfkit: the CUDA kernels take CUDA tensors, got marginals on ",
              marginals.device());
  const c10::cuda::CUDAGuard guard(marginals.device());
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  check_num_tags(T);
  Status status(marginals);
  launch_validate_inputs(lengths, L, at::Tensor(), at::Tensor(), at::Tensor(), status);
  auto grad_emissions = at::empty_like(marginals);
  auto grad_transitions = at::empty({T, T}, marginals.options());
  auto grad_start = at::empty({T}, marginals.options());
  auto grad_end = at::empty({T}, marginals.options());
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES(marginals.scalar_type(), "crfkit_log_partition_backward_from_marginals_cuda", [&] {
    const int64_t elements = B * L * T;
    if (elements > 0) {
      scale_marginals_kernel<scalar_t><<<elementwise_blocks(elements), kElementwiseThreads, 0, stream>>>(
          grad_log_z.data_ptr<scalar_t>(), marginals.data_ptr<scalar_t>(), lengths.data_ptr<int64_t>(),
          grad_emissions.data_ptr<scalar_t>(), B, L, T);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t entries = T * T + 2 * T;  // one warp each
    sum_parameter_grads_kernel<scalar_t><<<elementwise_blocks(entries * kWarpSize), kElementwiseThreads, 0, stream>>>(
        grad_log_z.data_ptr<scalar_t>(), marginals.data_ptr<scalar_t>(), counts.data_ptr<scalar_t>(),
        lengths.data_ptr<int64_t>(), grad_transitions.data_ptr<scalar_t>(), grad_start.data_ptr<scalar_t>(),
        grad_end.data_ptr<scalar_t>(), B, L, T);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  status.raise_if_bad(lengths, L);
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

}  // namespace

TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("log_partition", &log_partition_cuda);
  m.impl("marginals", &marginals_cuda);
  m.impl("log_partition_backward", &log_partition_backward_cuda);
  m.impl("log_partition_with_marginals", &log_partition_with_marginals_cuda);
  m.impl("log_partition_backward_from_marginals", &log_partition_backward_from_marginals_cuda);
  m.impl("expected_transition_counts", &expected_transition_counts_cuda);
}

}  // namespace cuda
}  // namespace crfkit
