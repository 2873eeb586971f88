// The generic forward-backward kernel (any T; log_partition.cu launches it for T above
// register_max_tags, forward_backward_registers.cuh): log Z, marginals, the analytic backward of
// log Z and log Z with marginals, the whole time loop in one launch.
//
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
// float32 stays accurate on long sentences with large scores. Results agree with the CPU
// kernels to rounding, not bit for bit (different summation order, and the CPU also has a
// probability-space fast path).
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
// The kernel (at the end of this file) is a sequence of the phases below; each phase loops over
// the lane's tags, and the group's shuffles and __syncwarp calls stay where every lane of the
// warp reaches them (all groups of a warp run to its longest sentence, predicated off beyond
// their own). Included by log_partition.cu only (see forward_backward_common.cuh).
#pragma once

#include <cstdint>

#include "common.cuh"
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

// ---- the group and its buffers --------------------------------------------------------------

// This lane's place: T tags over the G lanes of its group, lane l owning tags l, l + G, ...
struct Group {
  int T;     // tags
  int G;     // lanes per group (a power of two <= 32)
  int lane;  // 0 .. G-1
};

// The group's arena, seven (T,) vectors (the forward uses the first three): in shared memory, or
// in the group's slice of a global workspace (group_arena, common.cuh).
template <typename scalar_t>
struct Arena {
  scalar_t* alpha_a;     // the two alpha rows of the forward, current and next (they swap)
  scalar_t* alpha_b;
  scalar_t* pbuf;        // p = exp(alpha_hat) of the previous row (forward), of row i-1 (pairwise)
  scalar_t* beta;        // beta_hat of position i, max 0 (each lane reads its own entries only)
  scalar_t* vbuf;        // v = emit_i + beta_i (scratch for the marginals before that)
  scalar_t* qbuf;        // q = exp(v - max v)
  scalar_t* alpha_prev;  // alpha_hat of row i-1, for the next step's marginals
};

template <typename scalar_t>
__device__ __forceinline__ Arena<scalar_t> arena_at(unsigned char* bytes, int T) {
  scalar_t* arena = reinterpret_cast<scalar_t*>(bytes);
  Arena<scalar_t> a;
  a.alpha_a = arena;
  a.alpha_b = arena + T;
  a.pbuf = arena + 2 * T;
  a.beta = arena + 3 * T;
  a.vbuf = arena + 4 * T;
  a.qbuf = arena + 5 * T;
  a.alpha_prev = arena + 6 * T;
  return a;
}

// The group's gradient accumulator, (T*T + 2T,): acc[s * T + t] for transitions, then start (T),
// then end (T); nullptr for the ops without pairwise terms. In shared memory it is placed at
// `cursor` (moved past the block's accumulators) and zeroed here, each lane its own columns.
// Else it is the group's slice of `partials` (zeroed by the host), or for kWithMarginals each
// sentence's counts, set per sentence (nullptr here).
template <typename scalar_t, Output kOut>
__device__ __forceinline__ scalar_t* group_accumulator(const FbParams<scalar_t>& p, const Group& grp,
                                                       bool acc_in_shared, int group, int64_t slot,
                                                       int64_t accumulator_elements, unsigned char*& cursor) {
  constexpr bool kCountsPerSentence = kOut == Output::kWithMarginals;
  scalar_t* acc = nullptr;
  if (has_pairwise(kOut)) {
    if (!acc_in_shared) {
      acc = kCountsPerSentence ? nullptr : p.partials + slot * accumulator_elements;
    } else {
      acc = reinterpret_cast<scalar_t*>(cursor + group * p.accumulator_bytes);
      cursor += p.plan.groups_per_block * p.accumulator_bytes;
      for (int t = grp.lane; t < grp.T; t += grp.G) {
        for (int s = 0; s < grp.T; ++s) acc[s * grp.T + t] = 0;
        acc[grp.T * grp.T + t] = 0;
        acc[grp.T * grp.T + grp.T + t] = 0;
      }
    }
  }
  return acc;
}

// Sentence first + group and its (L, T) slices of the emissions and rows, and the group's offsets.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ Sentence<scalar_t> sentence_at(const FbParams<scalar_t>& p, int64_t first, int group,
                                                          int64_t L, int T, int64_t slot) {
  Sentence<scalar_t> s = locate_sentence(p, first, group, L);
  s.emit = p.emissions + s.b_safe * L * T;
  s.rows = keeps_rows(kOut) ? p.rows + s.b_safe * L * T : nullptr;
  s.offsets = has_pairwise(kOut) ? p.offsets + slot * L : nullptr;
  return s;
}

// ---- forward --------------------------------------------------------------------------------

// The forward pass's state: alpha = alpha_hat + offset, alpha_hat of the last position done in
// the arena (max 0 over the group).
template <typename scalar_t>
struct Forward {
  scalar_t* cur;   // (T,) alpha_hat of the last position done
  scalar_t* next;  // (T,) the other alpha row
  double offset;   // the maxima taken out so far (-inf once every sequence is forbidden)
  bool bad;        // a NaN or +inf emission among the lane's tags
};

// Position 0: alpha_hat[t] = start[t] + emit_0[t] - m, offset = m (m: the group's max); the row
// to rows[0] and the offset to offsets[0] where the op keeps them.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ Forward<scalar_t> forward_first_row(const FbParams<scalar_t>& p, const Group& grp,
                                                               const Sentence<scalar_t>& s,
                                                               const Arena<scalar_t>& arena) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  Forward<scalar_t> f;
  f.bad = false;
  f.offset = 0;
  f.cur = arena.alpha_a;
  f.next = arena.alpha_b;
  scalar_t local = kNegInf;
  if (s.n > 0) {
    for (int t = grp.lane; t < grp.T; t += grp.G) {
      const scalar_t e = s.emit[t];
      f.bad |= is_nan_or_pos_inf(e);
      const scalar_t x = p.start[t] + e;
      f.cur[t] = x;
      local = max_(local, x);
    }
  }
  const scalar_t m = group_max(local, grp.G);
  if (s.n > 0) {
    f.offset = m == kNegInf ? -CUDART_INF : static_cast<double>(m);
    for (int t = grp.lane; t < grp.T; t += grp.G) {
      if (m != kNegInf) f.cur[t] -= m;
      if (keeps_rows(kOut)) s.rows[t] = f.cur[t];
    }
    if (has_pairwise(kOut) && grp.lane == 0) s.offsets[0] = f.offset;
  }
  return f;
}

// logsumexp_s(alpha_hat[s] + trans[s, t]) for column t, from pbuf = exp(alpha_hat) (T,):
// factored, col_max[t] + log(sum_s p[s] * E[s][t]), or exactly from alpha_hat (T,) where that
// sum is too small to trust; -inf for a forbidden column.
template <typename scalar_t>
__device__ __forceinline__ scalar_t alpha_column_lse(const FbParams<scalar_t>& p, const Group& grp,
                                                     const TransitionTables<scalar_t>& tab, const scalar_t* alpha_hat,
                                                     const scalar_t* pbuf, int t) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t c_max = tab.col_max[t];
  scalar_t x = kNegInf;
  if (c_max != kNegInf) {
    scalar_t sum = 0;
    for (int s = 0; s < grp.T; ++s) sum += pbuf[s] * tab.e_col[s * grp.T + t];
    x = sum >= trusted_sum_min<scalar_t>() ? c_max + log_(sum) : exact_column_lse(alpha_hat, p.transitions, grp.T, t);
  }
  return x;
}

// Position i (i < n for an active group): alpha_hat_i[t] = logsumexp_s(alpha_hat_{i-1}[s] +
// trans[s, t]) + emit_i[t] - m, offset += m; the row to rows[i], the offset to offsets[i].
// emit_ahead: the emission of the lane's first tag at i, replaced by that at i + 1.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ void forward_step(const FbParams<scalar_t>& p, const Group& grp,
                                             const Sentence<scalar_t>& s, const TransitionTables<scalar_t>& tab,
                                             const Arena<scalar_t>& arena, int64_t i, scalar_t& emit_ahead,
                                             Forward<scalar_t>& f) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = grp.T, G = grp.G, lane = grp.lane;
  const bool active = i < s.n;
  __syncwarp();  // cur complete; everyone done reading pbuf of the previous step
  if (active) {
    for (int t = lane; t < T; t += G) arena.pbuf[t] = exp_(f.cur[t]);
  }
  __syncwarp();  // pbuf complete
  scalar_t local = kNegInf;
  if (active) {
    const scalar_t* emit_i = s.emit + i * T;
    const scalar_t emit_first = emit_ahead;
    if (lane < T && i + 1 < s.n) emit_ahead = emit_i[T + lane];
    for (int t = lane; t < T; t += G) {
      const scalar_t e = t == lane ? emit_first : emit_i[t];
      f.bad |= is_nan_or_pos_inf(e);
      const scalar_t x = alpha_column_lse(p, grp, tab, f.cur, arena.pbuf, t) + e;
      f.next[t] = x;
      local = max_(local, x);
    }
  }
  const scalar_t m = group_max(local, G);
  if (active) {
    for (int t = lane; t < T; t += G) {
      if (m != kNegInf) f.next[t] -= m;
      if (keeps_rows(kOut)) s.rows[i * T + t] = f.next[t];
    }
    f.offset += static_cast<double>(m);  // -inf once every sequence is forbidden
    if (has_pairwise(kOut) && lane == 0) s.offsets[i] = f.offset;
    scalar_t* swap = f.cur;
    f.cur = f.next;
    f.next = swap;
  }
}

// Positions 1 .. n-1 (the loop runs to the warp's longest sentence). The emission of the lane's
// first tag is loaded one position ahead, so that its latency overlaps a whole step (the time
// loop is latency-bound); further tags (T > G) are read when used. Only positions within the
// sentence are ever read.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ void forward_rows(const FbParams<scalar_t>& p, const Group& grp, const Sentence<scalar_t>& s,
                                             const TransitionTables<scalar_t>& tab, const Arena<scalar_t>& arena,
                                             Forward<scalar_t>& f) {
  scalar_t emit_ahead = grp.lane < grp.T && s.n > 1 ? s.emit[grp.T + grp.lane] : scalar_t(0);
  for (int64_t i = 1; i < s.steps; ++i) forward_step<scalar_t, kOut>(p, grp, s, tab, arena, i, emit_ahead, f);
}

// log Z = offset + logsumexp_t(alpha_hat[t] + end[t]) from the last row (finish_forward: also
// writes it and reports bad emissions); returns whether the sentence had bad emissions.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ bool forward_log_z(const FbParams<scalar_t>& p, const Group& grp,
                                              const Sentence<scalar_t>& s, const Forward<scalar_t>& f,
                                              double& log_z) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  scalar_t local = kNegInf;
  if (s.n > 0) {
    for (int t = grp.lane; t < grp.T; t += grp.G) local = max_(local, f.cur[t] + p.end[t]);
  }
  const scalar_t m = group_max(local, grp.G);
  scalar_t sum = 0;
  if (s.n > 0 && m != kNegInf) {
    for (int t = grp.lane; t < grp.T; t += grp.G) sum += exp_(f.cur[t] + p.end[t] - m);
  }
  sum = group_sum(sum, grp.G);
  return finish_forward<scalar_t, kOut>(p, s.b_safe, s.has_sentence, s.n, f.offset, m, sum, f.bad, grp.G, grp.lane,
                                        log_z);
}

// ---- backward -------------------------------------------------------------------------------
// From the last position to the first: beta rows (normalised, offset in double), the marginals
// of each position (over row i of rows), the pairwise marginals of each position pair.

// A skipped sentence's rows hold alpha: zero them (its gradients are all zero).
template <typename scalar_t>
__device__ __forceinline__ void clear_rows(const Group& grp, const Sentence<scalar_t>& s) {
  for (int64_t i = 0; i < s.n; ++i) {
    for (int t = grp.lane; t < grp.T; t += grp.G) s.rows[i * grp.T + t] = 0;
  }
}

// beta_hat of the last position: end - max(end) (arena.beta); returns its offset, max(end) (0
// when skipped).
template <typename scalar_t>
__device__ __forceinline__ double beta_last_row(const FbParams<scalar_t>& p, const Group& grp,
                                                const Arena<scalar_t>& arena, bool skip) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  double beta_offset = 0;
  scalar_t local = kNegInf;
  if (!skip) {
    for (int t = grp.lane; t < grp.T; t += grp.G) {
      arena.beta[t] = p.end[t];
      local = max_(local, arena.beta[t]);
    }
  }
  const scalar_t m = group_max(local, grp.G);
  if (!skip) {
    if (m != kNegInf) {
      for (int t = grp.lane; t < grp.T; t += grp.G) arena.beta[t] -= m;
    }
    beta_offset = static_cast<double>(m);
  }
  return beta_offset;
}

// A: the marginals at position i, exp(alpha + beta) normalised over tags (see
// csrc/cpu/log_partition.cpp) and weighted by g, over row i of rows; the first and last
// positions' also to the start / end gradients (kBackward). Alpha of row i is in rows for the
// last position (first = the backward's first step), else in arena.alpha_prev, where the
// previous step put it (the lane's own entries). Uses arena.vbuf as scratch.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ void marginals_row(const Group& grp, const Sentence<scalar_t>& s,
                                              const Arena<scalar_t>& arena, scalar_t* acc, scalar_t g, int64_t i,
                                              bool first, bool active) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = grp.T, G = grp.G, lane = grp.lane;
  scalar_t local = kNegInf;
  if (active) {
    for (int t = lane; t < T; t += G) {
      const scalar_t u = (first ? s.rows[i * T + t] : arena.alpha_prev[t]) + arena.beta[t];
      arena.vbuf[t] = u;  // own entry, as scratch until backward_v
      local = max_(local, u);
    }
  }
  const scalar_t u_max = group_max(local, G);
  scalar_t part = 0;
  if (active && u_max != kNegInf) {
    for (int t = lane; t < T; t += G) {
      const scalar_t x = exp_(arena.vbuf[t] - u_max);
      arena.vbuf[t] = x;
      part += x;
    }
  }
  const scalar_t total = group_sum(part, G);
  if (active) {
    const scalar_t scale = g / total;
    for (int t = lane; t < T; t += G) {
      const scalar_t mu = u_max == kNegInf ? scalar_t(0) : arena.vbuf[t] * scale;
      s.rows[i * T + t] = mu;
      if (kOut == Output::kBackward) {
        if (i == s.n - 1) acc[T * T + T + t] += mu;  // end
        if (i == 0) acc[T * T + t] += mu;            // start
      }
    }
  }
}

// What the backward step for position i needs of positions i and i-1, loaded one step early
// (as in the forward) for the lane's first tag: the emission at i, alpha_hat of row i-1, and the
// forward offset at i-1 (the pairwise shift).
template <typename scalar_t>
struct Ahead {
  scalar_t emit;
  scalar_t alpha;
  double offset;
};

template <typename scalar_t, Output kOut>
__device__ __forceinline__ Ahead<scalar_t> first_ahead(const Group& grp, const Sentence<scalar_t>& s, bool skip) {
  const bool ahead = !skip && grp.lane < grp.T;
  Ahead<scalar_t> a;
  a.emit = ahead && s.n > 1 ? s.emit[(s.n - 1) * grp.T + grp.lane] : scalar_t(0);
  a.alpha = ahead && s.n > 1 ? s.rows[(s.n - 2) * grp.T + grp.lane] : scalar_t(0);
  a.offset = has_pairwise(kOut) && !skip && s.n > 1 ? s.offsets[s.n - 2] : 0.0;
  return a;
}

// C: v = emit_i + beta_i (arena.vbuf) for a step (positions i-1 -> i remain); returns the
// group's max of v. `now` receives what was loaded ahead for this step (the alpha and offset of
// row i-1, for D and E); `ahead` is then loaded for the next one.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ scalar_t backward_v(const Group& grp, const Sentence<scalar_t>& s,
                                               const Arena<scalar_t>& arena, int64_t i, bool step,
                                               Ahead<scalar_t>& ahead, Ahead<scalar_t>& now) {
  const int T = grp.T, G = grp.G, lane = grp.lane;
  scalar_t local = neg_inf<scalar_t>();
  now.alpha = 0;
  now.offset = 0;
  if (step) {
    const scalar_t* emit_i = s.emit + i * T;
    const scalar_t emit_first = ahead.emit;
    now.alpha = ahead.alpha;
    now.offset = ahead.offset;
    if (lane < T && i - 1 > 0) ahead.emit = emit_i[-T + lane];
    if (lane < T && i - 2 >= 0) ahead.alpha = s.rows[(i - 2) * T + lane];
    if (has_pairwise(kOut) && i - 2 >= 0) ahead.offset = s.offsets[i - 2];
    for (int t = lane; t < T; t += G) {
      const scalar_t x = (t == lane ? emit_first : emit_i[t]) + arena.beta[t];
      arena.vbuf[t] = x;
      local = max_(local, x);
    }
  }
  return group_max(local, G);
}

// D: q = exp(v - max v) (arena.qbuf); alpha_hat of row i-1 to arena.alpha_prev (for the next
// step's marginals) and its exponential to arena.pbuf (the pairwise terms). alpha_first: the
// lane's first tag's entry, loaded ahead.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ void backward_q_alpha(const Group& grp, const Sentence<scalar_t>& s,
                                                 const Arena<scalar_t>& arena, int64_t i, bool step, scalar_t v_max,
                                                 scalar_t alpha_first) {
  const int T = grp.T, lane = grp.lane;
  if (step) {
    for (int t = lane; t < T; t += grp.G) {
      arena.qbuf[t] = v_max == neg_inf<scalar_t>() ? scalar_t(0) : exp_(arena.vbuf[t] - v_max);
      const scalar_t a = t == lane ? alpha_first : s.rows[(i - 1) * T + t];
      arena.alpha_prev[t] = a;
      if (has_pairwise(kOut)) arena.pbuf[t] = exp_(a);
    }
  }
}

// E: the pairwise marginals of positions (i-1, i), normalised by their sum over all (s, t) and
// weighted by g, added to acc[s * T + t] (pairwise_column, the lane's columns). shift =
// offset[i-1] + beta_offset - log Z; needs C and D done by the whole group.
template <typename scalar_t>
__device__ __forceinline__ void pairwise_terms(const FbParams<scalar_t>& p, const Group& grp,
                                               const TransitionTables<scalar_t>& tab, const Arena<scalar_t>& arena,
                                               scalar_t* acc, scalar_t g, bool step, double offset_prev,
                                               double beta_offset, double log_z) {
  const int T = grp.T, G = grp.G, lane = grp.lane;
  const scalar_t shift = step ? static_cast<scalar_t>(offset_prev + beta_offset - log_z) : scalar_t(0);
  scalar_t pair_part = 0;
  if (step) {
    for (int t = lane; t < T; t += G) {
      pair_part += pairwise_column<scalar_t, false>(t, T, arena.vbuf[t], shift, arena.alpha_prev, arena.pbuf,
                                                    tab.e_col, tab.col_max, p.transitions, scalar_t(0), nullptr);
    }
  }
  const scalar_t pair_total = group_sum(pair_part, G);
  if (step && pair_total > 0) {
    const scalar_t scale = g / pair_total;
    for (int t = lane; t < T; t += G) {
      pairwise_column<scalar_t, true>(t, T, arena.vbuf[t], shift, arena.alpha_prev, arena.pbuf, tab.e_col,
                                      tab.col_max, p.transitions, scale, acc);
    }
  }
}

// logsumexp_t(trans[s, t] + v[t]) for row s: factored, max v + row_max[s] + log(sum_t q[t] *
// E_row[t][s]), or exactly from v where that sum is too small to trust; -inf for a forbidden row
// or when every v is -inf.
template <typename scalar_t>
__device__ __forceinline__ scalar_t beta_row_lse(const FbParams<scalar_t>& p, const Group& grp,
                                                 const TransitionTables<scalar_t>& tab, const Arena<scalar_t>& arena,
                                                 scalar_t v_max, int s) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t r_max = tab.row_max[s];
  scalar_t x = kNegInf;
  if (r_max != kNegInf && v_max != kNegInf) {
    scalar_t row_sum = 0;
    for (int t = 0; t < grp.T; ++t) row_sum += arena.qbuf[t] * tab.e_row_t[t * grp.T + s];
    x = row_sum >= trusted_sum_min<scalar_t>() ? v_max + r_max + log_(row_sum)
                                               : exact_row_lse(arena.vbuf, p.transitions, grp.T, s);
  }
  return x;
}

// F: beta_hat_{i-1}[s] = logsumexp_t(trans[s, t] + v[t]) - m, in place (beta is read by its
// owner only), beta_offset += m (m: the group's max).
template <typename scalar_t>
__device__ __forceinline__ void beta_step(const FbParams<scalar_t>& p, const Group& grp,
                                          const TransitionTables<scalar_t>& tab, const Arena<scalar_t>& arena,
                                          bool step, scalar_t v_max, double& beta_offset) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  scalar_t local = kNegInf;
  if (step) {
    for (int s = grp.lane; s < grp.T; s += grp.G) {
      const scalar_t x = beta_row_lse(p, grp, tab, arena, v_max, s);
      arena.beta[s] = x;
      local = max_(local, x);
    }
  }
  const scalar_t m = group_max(local, grp.G);
  if (step) {
    if (m != kNegInf) {
      for (int s = grp.lane; s < grp.T; s += grp.G) arena.beta[s] -= m;
    }
    beta_offset += static_cast<double>(m);
  }
}

// The backward pass of a sentence whose forward left the alpha rows in rows (and, with pairwise
// terms, the offsets): positions n-1 .. 0, one step A, C, D, E, F per position (the loop runs to
// the warp's longest sentence).
template <typename scalar_t, Output kOut>
__device__ __forceinline__ void backward_pass(const FbParams<scalar_t>& p, const Group& grp,
                                              const Sentence<scalar_t>& s, const TransitionTables<scalar_t>& tab,
                                              const Arena<scalar_t>& arena, scalar_t* acc, scalar_t g, bool skip,
                                              double log_z) {
  double beta_offset = beta_last_row(p, grp, arena, skip);
  Ahead<scalar_t> ahead = first_ahead<scalar_t, kOut>(grp, s, skip);
  for (int64_t j = 0; j < s.steps; ++j) {
    const bool active = !skip && j < s.n;
    const int64_t i = s.n - 1 - j;
    marginals_row<scalar_t, kOut>(grp, s, arena, acc, g, i, j == 0, active);
    const bool step = active && i > 0;  // positions i-1 -> i remain
    Ahead<scalar_t> now;
    const scalar_t v_max = backward_v<scalar_t, kOut>(grp, s, arena, i, step, ahead, now);
    backward_q_alpha<scalar_t, kOut>(grp, s, arena, i, step, v_max, now.alpha);
    __syncwarp();  // vbuf, qbuf, alpha_prev, pbuf complete
    if (has_pairwise(kOut)) pairwise_terms(p, grp, tab, arena, acc, g, step, now.offset, beta_offset, log_z);
    beta_step(p, grp, tab, arena, step, v_max, beta_offset);
    __syncwarp();  // everyone done reading vbuf, qbuf, pbuf, alpha_prev of this step
  }
}

// kWithMarginals with the accumulator in shared memory: the lane's columns to the sentence's
// counts (B, T, T), and back to zero for the next sentence.
template <typename scalar_t>
__device__ __forceinline__ void write_counts(const FbParams<scalar_t>& p, const Group& grp, int64_t b, scalar_t* acc) {
  const int T = grp.T;
  scalar_t* out = p.counts + b * T * T;
  for (int t = grp.lane; t < T; t += grp.G) {
    for (int s = 0; s < T; ++s) {
      out[s * T + t] = acc[s * T + t];
      acc[s * T + t] = 0;
    }
  }
}

// kBackward with the accumulator in shared memory: the lane's entries to the group's slice of
// partials (slots, T*T + 2T).
template <typename scalar_t>
__device__ __forceinline__ void write_partials(const FbParams<scalar_t>& p, const Group& grp, int64_t slot,
                                               int64_t accumulator_elements, const scalar_t* acc) {
  const int T = grp.T;
  scalar_t* out = p.partials + slot * accumulator_elements;
  for (int t = grp.lane; t < T; t += grp.G) {
    for (int s = 0; s < T; ++s) out[s * T + t] = acc[s * T + t];
    out[T * T + t] = acc[T * T + t];
    out[T * T + T + t] = acc[T * T + T + t];
  }
}

// ---- the kernel -----------------------------------------------------------------------------

template <typename scalar_t, Output kOut, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) forward_backward_kernel(const FbParams<scalar_t> p) {
  // kWithMarginals: the pairwise marginals go to each sentence's counts, and the start / end
  // gradients are left to the backward (the marginals' first and last rows).
  constexpr bool kCountsPerSentence = kOut == Output::kWithMarginals;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Group grp;
  grp.T = p.num_tags;
  grp.G = p.plan.lanes;
  const int groups_per_block = p.plan.groups_per_block;
  const int group = threadIdx.x / grp.G;
  grp.lane = threadIdx.x % grp.G;
  const int T = grp.T;
  const int64_t slot = (int64_t)blockIdx.x * groups_per_block + group;
  const int64_t L = p.max_len;

  // Shared memory in plan order: arenas, accumulators, tables.
  unsigned char* cursor = shared_raw;
  unsigned char* arena_bytes = group_arena<kAllShared>(cursor, p.plan, p.arena_bytes, p.arena_workspace, group, slot);
  const int64_t accumulator_elements = (int64_t)T * T + 2 * T;
  const bool acc_in_shared = kAllShared || p.plan.accumulator_in_shared;
  scalar_t* acc =
      group_accumulator<scalar_t, kOut>(p, grp, acc_in_shared, group, slot, accumulator_elements, cursor);
  const scalar_t* tables = stage_table<kAllShared>(cursor, p.plan.tables_in_shared, p.tables, table_elements(T));
  __syncthreads();  // the only block-wide barrier: tables are ready
  const TransitionTables<scalar_t> tab = transition_tables(tables, T);
  const Arena<scalar_t> arena = arena_at<scalar_t>(arena_bytes, T);

  const int64_t grid_groups = (int64_t)gridDim.x * groups_per_block;
  for (int64_t first = (int64_t)blockIdx.x * groups_per_block; first < p.batch; first += grid_groups) {
    __syncwarp();  // the previous sentence is finished by every lane before the arena is reused
    const Sentence<scalar_t> s = sentence_at<scalar_t, kOut>(p, first, group, L, T, slot);
    if (kCountsPerSentence && !acc_in_shared) acc = p.counts + s.b_safe * T * T;  // written by no one else

    // ---- forward: normalised alpha rows, running offset in double ----
    Forward<scalar_t> f = forward_first_row<scalar_t, kOut>(p, grp, s, arena);
    forward_rows<scalar_t, kOut>(p, grp, s, tab, arena, f);
    double log_z;
    const bool bad = forward_log_z<scalar_t, kOut>(p, grp, s, f, log_z);
    if (kOut == Output::kLogPartition) continue;

    // ---- backward: beta rows, marginals, pairwise marginals ----
    bool skip;
    const scalar_t g = gradient_weight<scalar_t, kOut>(p, s.b_safe, s.has_sentence, s.n, bad, log_z, skip);
    if (s.n > 0 && skip) clear_rows(grp, s);
    backward_pass<scalar_t, kOut>(p, grp, s, tab, arena, acc, g, skip, log_z);
    if (kCountsPerSentence && acc_in_shared && s.has_sentence) write_counts(p, grp, s.b, acc);
  }
  if (kOut == Output::kBackward && acc_in_shared) write_partials(p, grp, slot, accumulator_elements, acc);
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
