// The generic forward-backward kernel, for any T (csrc/cuda/log_partition.cu describes the
// algorithm and the memory layout): one group of G lanes per sentence, rows in the group's
// arena in shared (or global) memory.
#pragma once

#include "forward_backward_common.cuh"

namespace crfkit {
namespace cuda {
namespace {


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

// The group's accumulators start at zero: the lane's columns t of the transitions, and its start
// and end entries.
template <typename scalar_t>
__device__ __forceinline__ void zero_own_accumulators(scalar_t* acc, int T, int G, int lane) {
  for (int t = lane; t < T; t += G) {
    for (int s = 0; s < T; ++s) acc[s * T + t] = 0;
    acc[T * T + t] = 0;
    acc[T * T + T + t] = 0;
  }
}

// The lane's columns t of a sentence's transition counts, from the group's accumulator in shared
// memory, which they leave at zero for the next sentence.
template <typename scalar_t>
__device__ __forceinline__ void move_own_counts(scalar_t* out, scalar_t* acc, int T, int G, int lane) {
  for (int t = lane; t < T; t += G) {
    for (int s = 0; s < T; ++s) {
      out[s * T + t] = acc[s * T + t];
      acc[s * T + t] = 0;
    }
  }
}

// The lane's entries of the group's accumulators (columns t of the transitions, start[t],
// end[t]) to its slice of the partial sums.
template <typename scalar_t>
__device__ __forceinline__ void store_own_accumulators(scalar_t* out, const scalar_t* acc, int T, int G, int lane) {
  for (int t = lane; t < T; t += G) {
    for (int s = 0; s < T; ++s) out[s * T + t] = acc[s * T + t];
    out[T * T + t] = acc[T * T + t];
    out[T * T + T + t] = acc[T * T + T + t];
  }
}

// The forward's line t before its emission, lse_s(cur(s) + trans(s, t)) for the normalised
// alpha row cur: from the factored tables (pbuf = exp(cur)), exactly where the factored sum
// underflows; -inf where no transition reaches t.
template <typename scalar_t>
__device__ __forceinline__ scalar_t forward_column(int t, int T, const scalar_t* cur, const scalar_t* pbuf,
                                                   const scalar_t* e_col, const scalar_t* col_max,
                                                   const scalar_t* transitions) {
  const scalar_t c_max = col_max[t];
  scalar_t x = neg_inf<scalar_t>();
  if (c_max != neg_inf<scalar_t>()) {
    scalar_t sum = 0;
    for (int s = 0; s < T; ++s) sum += pbuf[s] * e_col[s * T + t];
    x = sum >= trusted_sum_min<scalar_t>() ? c_max + log_(sum) : exact_column_lse(cur, transitions, T, t);
  }
  return x;
}

// beta_{i-1}(s) = lse_t(trans(s, t) + v(t)), from the factored tables (qbuf = exp(v - v_max)),
// exactly where the factored sum underflows.
template <typename scalar_t>
__device__ __forceinline__ scalar_t backward_row(int s, int T, const scalar_t* vbuf, const scalar_t* qbuf,
                                                 scalar_t v_max, const scalar_t* e_row_t, const scalar_t* row_max,
                                                 const scalar_t* transitions) {
  const scalar_t r_max = row_max[s];
  scalar_t x = neg_inf<scalar_t>();
  if (r_max != neg_inf<scalar_t>() && v_max != neg_inf<scalar_t>()) {
    scalar_t row_sum = 0;
    for (int t = 0; t < T; ++t) row_sum += qbuf[t] * e_row_t[t * T + s];
    x = row_sum >= trusted_sum_min<scalar_t>() ? v_max + r_max + log_(row_sum)
                                               : exact_row_lse(vbuf, transitions, T, s);
  }
  return x;
}

// One group of G lanes per sentence; the grid is persistent (a group takes sentences first,
// first + the grid's groups, ...). Per sentence: the forward pass (alpha rows), log Z
// (finish_forward), and for the ops that need it the backward pass (marginals, pairwise
// marginals); a group's gradients go out at the end.
//
// The time loops stay in this body on purpose: moving the forward or the backward pass into
// __forceinline__ functions changed the sm_90 machine code of some instantiations (ptxas
// allocated registers differently, with more spills in places), and an earlier split of this
// kind ran slower on a GPU. The two per-tag steps above (forward_column, backward_row) leave the
// machine code equivalent (benchmarks/results/NOTES.md). Check such a change with
// tools/cuda_compile_check/compare_sass.py.
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
      zero_own_accumulators(acc, T, G, lane);
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
          scalar_t x = forward_column(t, T, cur, pbuf, e_col, col_max, p.transitions);
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
    // Zero rows: beyond the sentence (the host does not clear the output) and, for a skipped
    // sentence, its own (they hold alpha).
    if (has_sentence) {
      for (int64_t i = skip ? 0 : n; i < L; ++i) {
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
          const scalar_t x = backward_row(s, T, vbuf, qbuf, v_max, e_row_t, row_max, p.transitions);
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
      move_own_counts(p.counts + b * T * T, acc, T, G, lane);
    }
  }
  if (kOut == Output::kBackward && acc_in_shared) {  // own entries to the group's slice
    store_own_accumulators(p.partials + slot * accumulator_elements, acc, T, G, lane);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
