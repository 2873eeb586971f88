// Probability-space forward-backward on BATCH LANES: one SIMD vector holds kGroup sentences
// (lane j = sentence j of a group), every tag a vector of its own.
//
// Why: one sentence's scan is a chain of dependent steps (a T x T product, a max, a scale) on
// vectors that are mostly padding at small T (9 tags in 16 doubles), so a core spends most of a
// position waiting. With sentences in lanes a position is T^2 independent multiply-adds and
// T vector exponentials with no padding and no horizontal operation: the scan runs at the
// machine's arithmetic rate. Same maths as prob_space.h (read that first), one difference: a
// sentence that leaves the fast path's range, or has log Z = -inf, is not finished here: its
// lane is marked failed and the caller runs it through the per-sentence code.
// Lanes are independent (no operation mixes them), so a sentence's result does not depend on
// the other sentences of its group.
//
// Layouts. Groups are formed from the sentences sorted by length, longest first (so a group
// wastes few positions); lane vectors of a group's rows are [position][tag] of kGroup doubles:
// rows_a (n_max, T, kGroup) and rows_w (n_max, T, kGroup).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>  // _mm_prefetch
#endif

#include "fast_exp.h"
#include "isa.h"
#include "prob_space.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

constexpr int64_t kGroup = kLanes;  // sentences per lane vector (8 doubles with AVX-512, 4 with AVX2)
constexpr int64_t kMaxLaneTags = 64;  // above this the per-sentence kernel is as fast

// Asks for the n lane vectors at p (one cache line each) to be brought closer. The backward
// walks the saved rows from the last position to the first, two streams (a and w) far apart,
// and the hardware prefetcher does not keep up once the state is outside the caches. The T2
// hint (outer cache levels) measured best of none, T0 (which stalled on the L1 miss buffers)
// and T2; benchmarks/results/NOTES.md has the timings.
inline void prefetch_lane_vectors(const double* p, int64_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  for (int64_t k = 0; k < n; ++k) _mm_prefetch(reinterpret_cast<const char*>(p + k * kGroup), _MM_HINT_T2);
#else
  (void)p, (void)n;
#endif
}

// CRFKIT_LOG_PARTITION_LANES=1 forces the batch lanes for log_partition, marginals and their
// gradients wherever they can run (T <= kMaxLaneTags, any B: a partial group pads its empty
// lanes); =0 forces the per-sentence scans. Tests run both on the same inputs, so every build
// checks both paths whatever its default; benchmarks time both with one build. Unset or empty:
// use_lanes's default rule.
inline int forced_log_partition_lanes() { return forced_by_environment("CRFKIT_LOG_PARTITION_LANES"); }

// Whether the log-partition ops run on batch lanes for this shape: a group costs about what
// two or three single-sentence scans cost, so lanes pay from one full group on, on AVX-512 and
// on AVX2 (4 doubles per group) alike (measured on both: benchmarks/results/NOTES.md).
// Elsewhere (SSE, NEON: groups of 2) not measured, so the per-sentence scans stay the default
// there.
inline bool use_lanes(int64_t B, int64_t T) {
  if (T > kMaxLaneTags) return false;
  const int forced = forced_log_partition_lanes();
  if (forced >= 0) return forced == 1;
#if defined(__AVX512F__) || defined(__AVX2__)
  return B >= kGroup;
#else
  (void)B;
  return false;
#endif
}

// Sentence indices sorted by length, longest first (stable), padded with -1 to a whole number of
// groups: group g is order[g * kGroup .. (g + 1) * kGroup).
inline std::vector<int64_t> lane_order(const int64_t* lengths, int64_t B) {
  std::vector<int64_t> order = longest_first(lengths, B, 0);
  order.resize((B + kGroup - 1) / kGroup * kGroup, -1);
  return order;
}

// prob_space.h's inverse_power_of_two, per lane: for m > 0 normal, returns 2^-e with m * 2^-e
// in [1, 2), and adds e to `exponents`.
inline LaneVector inverse_power_of_two(LaneVector m, LaneVector& exponents) {
  const LaneMask biased = (std::bit_cast<LaneMask>(m) >> 52) & 0x7ff;
  exponents += __builtin_convertvector(biased - 1023, LaneVector);
  return std::bit_cast<LaneVector>((2046 - biased) << 52);
}

// out[t] = sum_s x[s] * m[s * stride + t] for t < T: lanes are sentences, m is shared (its
// entries broadcast). Outputs in blocks of up to 8 accumulators kept in registers.
template <int kBlock>
inline void lanes_matvec_block(const double* __restrict__ m, int64_t stride,
                               const LaneVector* __restrict__ x, int64_t T, int64_t t0,
                               LaneVector* __restrict__ out) {
  LaneVector acc[kBlock] = {};
  for (int64_t s = 0; s < T; ++s) {
    const LaneVector xs = x[s];
    const double* row = m + s * stride + t0;
    for (int r = 0; r < kBlock; ++r) acc[r] += xs * row[r];
  }
  for (int r = 0; r < kBlock; ++r) out[t0 + r] = acc[r];
}

inline void lanes_matvec(const double* m, int64_t stride, const LaneVector* x, int64_t T,
                         LaneVector* out) {
  int64_t t0 = 0;
  for (; t0 + 8 <= T; t0 += 8) lanes_matvec_block<8>(m, stride, x, T, t0, out);
  switch (T - t0) {
    case 1: return lanes_matvec_block<1>(m, stride, x, T, t0, out);
    case 2: return lanes_matvec_block<2>(m, stride, x, T, t0, out);
    case 3: return lanes_matvec_block<3>(m, stride, x, T, t0, out);
    case 4: return lanes_matvec_block<4>(m, stride, x, T, t0, out);
    case 5: return lanes_matvec_block<5>(m, stride, x, T, t0, out);
    case 6: return lanes_matvec_block<6>(m, stride, x, T, t0, out);
    case 7: return lanes_matvec_block<7>(m, stride, x, T, t0, out);
    default: return;
  }
}

// acc[s * T + t] += sum_p left[p * T + s] * right[p * T + t] over p < count (count rank-one
// updates at once), on a tile of kRows x kCols accumulators kept in registers: per position p
// it loads kRows + kCols vectors for kRows * kCols multiply-adds. The loops over the tile must
// stay unrolled: without unrolled loops GCC keeps the accumulators in memory (as it did for a
// row of 8 accumulators, which ran at half the matvec's rate: benchmarks/results/NOTES.md).
// Each accumulator adds its terms in p order, as a plain sum over p does: same results.
// With `fresh` the accumulators start from 0 instead of acc (the first update: no fill of acc
// first); with `scale` (not null) each is stored times scale[s * stride + t] (the last update:
// no separate pass for that).
struct RankUpdateEnds {
  bool fresh = false;
  const double* scale = nullptr;
  int64_t stride = 0;
};

template <int kRows, int kCols>
inline void lanes_rank_update_tile(const LaneVector* __restrict__ left, const LaneVector* __restrict__ right,
                                   int64_t count, int64_t T, int64_t s0, int64_t t0,
                                   LaneVector* __restrict__ acc, RankUpdateEnds ends) {
  LaneVector sum[kRows][kCols];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) sum[r][c] = ends.fresh ? LaneVector{} : acc[(s0 + r) * T + t0 + c];
  }
  for (int64_t p = 0; p < count; ++p) {
    LaneVector l[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) l[r] = left[p * T + s0 + r];
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const LaneVector x = right[p * T + t0 + c];
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) sum[r][c] += l[r] * x;
    }
  }
  if (ends.scale != nullptr) {
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) sum[r][c] *= ends.scale[(s0 + r) * ends.stride + t0 + c];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) acc[(s0 + r) * T + t0 + c] = sum[r][c];
  }
}

constexpr int kTileRows = 4, kTileCols = 4;  // 16 accumulators + 5 operands: 21 of 32 registers

// lanes_rank_update_tile<rows, cols> for rows, cols at most kTileRows, kTileCols.
template <int kRows>
inline void lanes_rank_update_tile_of(int cols, const LaneVector* left, const LaneVector* right, int64_t count,
                                      int64_t T, int64_t s0, int64_t t0, LaneVector* acc, RankUpdateEnds ends) {
  switch (cols) {
    case 1: return lanes_rank_update_tile<kRows, 1>(left, right, count, T, s0, t0, acc, ends);
    case 2: return lanes_rank_update_tile<kRows, 2>(left, right, count, T, s0, t0, acc, ends);
    case 3: return lanes_rank_update_tile<kRows, 3>(left, right, count, T, s0, t0, acc, ends);
    default: return lanes_rank_update_tile<kRows, kTileCols>(left, right, count, T, s0, t0, acc, ends);
  }
}

inline void lanes_rank_update(const LaneVector* left, const LaneVector* right, int64_t count,
                              int64_t T, LaneVector* acc, RankUpdateEnds ends) {
  static_assert(kTileRows == 4 && kTileCols == 4, "the switches below list the tile sizes");
  for (int64_t s0 = 0; s0 < T; s0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, T - s0));
    for (int64_t t0 = 0; t0 < T; t0 += kTileCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kTileCols, T - t0));
      switch (rows) {
        case 1: lanes_rank_update_tile_of<1>(cols, left, right, count, T, s0, t0, acc, ends); break;
        case 2: lanes_rank_update_tile_of<2>(cols, left, right, count, T, s0, t0, acc, ends); break;
        case 3: lanes_rank_update_tile_of<3>(cols, left, right, count, T, s0, t0, acc, ends); break;
        default: lanes_rank_update_tile_of<kTileRows>(cols, left, right, count, T, s0, t0, acc, ends); break;
      }
    }
  }
}

// sum_t rows[t] * v[t] per lane, for T lane vectors rows (t * kGroup) and v: four partial sums,
// so that the chain of dependent multiply-adds is T / 4 long instead of T (single-chain sums
// showed up in perf: benchmarks/results/NOTES.md).
inline LaneVector lanes_dot(const double* rows, const LaneVector* v, int64_t T) {
  LaneVector part[4] = {};
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) part[k] += load_lanes(rows + (t + k) * kGroup) * v[t + k];
  }
  for (; t < T; ++t) part[0] += load_lanes(rows + t * kGroup) * v[t];
  return (part[0] + part[1]) + (part[2] + part[3]);
}

// One group of sentences. `sentence[j]` is the batch index of lane j (-1: empty lane),
// `length` its length (0 for empty lanes).
struct LaneGroup {
  int64_t sentence[kGroup];
  LaneVector length;  // as doubles, for comparisons with the position
  int64_t n_max = 0;

  LaneGroup(const int64_t* order, const int64_t* lengths) {
    for (int64_t j = 0; j < kGroup; ++j) {
      sentence[j] = order[j];
      length[j] = order[j] < 0 ? 0.0 : static_cast<double>(lengths[order[j]]);
      n_max = std::max<int64_t>(n_max, static_cast<int64_t>(length[j]));
    }
  }
};

// Per-thread work space of the lane scans (T lane vectors each).
// Positions per batch of rank-one updates (pair_acc): each batch loads and stores all T^2
// accumulators once. 16 measured faster than 8 and as fast as 32 (benchmarks/results/NOTES.md).
constexpr int64_t kPairBatch = 16;
constexpr int64_t kTransposeChunk = 16;  // positions transposed at once (scores in, marginals out)

struct ProbLaneWork {
  std::vector<LaneVector> a, d, b, gw, pair_acc;
  std::vector<LaneVector> pair_left, pair_right;  // (kPairBatch, T): the pending rank-one terms
  // kTransposeChunk * T lane vectors (rounded up to a whole 8 x 8 block): the forward's scores,
  // the backward's marginals
  std::vector<LaneVector> transposed;
  ProbLaneWork(int64_t T, bool pairwise)
      : a(T), d(T), b(T), gw(T), pair_acc(pairwise ? padded_to_lanes<double>(T * T) : 0),
        pair_left(pairwise ? kPairBatch * T : 0), pair_right(pairwise ? kPairBatch * T : 0),
        transposed(padded_to_lanes<double>(kTransposeChunk * T)) {}
};

// Forward scan of a group. Lanes with length 0 are inactive. With rows_a / rows_w (not null)
// the scaled a and w rows of every position are kept, (n_max, T, kGroup) each. Returns the lanes
// that failed (left the range, or log Z = -inf); writes log Z of the others.
template <typename scalar_t>
LaneMask lanes_forward(const scalar_t* emit, int64_t L, const scalar_t* start,
                       const ProbTables& tab, const LaneGroup& group, ProbLaneWork& work,
                       double* rows_a, double* rows_w, LaneVector& log_z) {
  const int64_t T = tab.T, stride = tab.stride;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const LaneVector zero = {}, min_scaled = zero + kMinScaled, v_neg_inf = zero + neg_inf;
  LaneVector* a = work.a.data();
  LaneVector* d = work.d.data();
  auto max_over_tags = [&](const LaneVector* v) {
    LaneVector m = v[0];
    for (int64_t t = 1; t < T; ++t) m = lane_max(m, v[t]);
    return m;
  };
  LaneMask failed = {}, lost = {};
  // The exponentiated scores of position i in lanes: T vectors w[t] = exp(score[t] - shift[i])
  // (scores 0 past a lane's length; position 0's include the start scores), shift = the
  // position's largest score (0 for lanes past their length or with every tag forbidden, which
  // fail). Chunks of kTransposeChunk positions are transposed at once, 8 x 8 blocks in
  // registers (emissions_to_lanes in lanes.h; a scalar transpose showed up in perf), and
  // exponentiated at once: the exponentials do not depend on the scan, and a chunk's are many
  // independent chains (each a chain of 16 dependent multiply-adds), where inside the scan only
  // one position's T were in flight. Measured a little faster than the exponentials inside the
  // scan (benchmarks/results/NOTES.md).
  LaneVector shifts[kTransposeChunk];
  auto load_position = [&](int64_t i) {
    LaneVector* chunk = work.transposed.data();
    const int64_t first = i % kTransposeChunk;
    if (first == 0) {
      const int64_t count = std::min(kTransposeChunk, group.n_max - i);
      const scalar_t* source[kGroup];
      int64_t limit[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t n = static_cast<int64_t>(group.length[j]);
        source[j] = n > i ? emit + (group.sentence[j] * L + i) * T : nullptr;
        limit[j] = std::clamp<int64_t>(n - i, 0, count) * T;
      }
      emissions_to_lanes<double>(source, limit, chunk);
      // rows that no lane reaches (emissions_to_lanes writes whole vectors of rows up to the
      // longest limit; a lane group may be shorter than n_max when its longest sentence was
      // left out for NaN)
      const int64_t written = padded_to_lanes<double>(*std::max_element(limit, limit + kGroup));
      if (written < count * T) std::fill(chunk + written, chunk + count * T, LaneVector{});
      if (i == 0) {
        for (int64_t t = 0; t < T; ++t) chunk[t] += static_cast<double>(start[t]);
      }
      for (int64_t p = 0; p < count; ++p) {
        LaneVector* x = chunk + p * T;
        const LaneMask active = (zero + static_cast<double>(i + p)) < group.length;
        const LaneVector score_max = max_over_tags(x);
        failed |= active & (score_max == v_neg_inf);  // every tag forbidden here
        const LaneVector shift = active & (score_max != v_neg_inf) ? score_max : zero;
        shifts[p] = shift;
        for (int64_t t = 0; t < T; ++t) {
          const LaneVector score = x[t];
          x[t] = exp_nonpositive_generic<LaneVector, LaneMask>(score - shift);
          lost |= (x[t] < min_scaled) & (score != v_neg_inf);
        }
      }
    }
    return chunk + first * T;
  };

  LaneMask is_active = zero < group.length;
  const LaneVector* w0 = load_position(0);
  LaneVector log_scale = shifts[0];
  for (int64_t t = 0; t < T; ++t) a[t] = w0[t];
  if (rows_a != nullptr) {
    for (int64_t t = 0; t < T; ++t) {
      store_lanes(rows_a + t * kGroup, a[t]);
      store_lanes(rows_w + t * kGroup, zero + 1.0);  // unused at position 0
    }
  }
  LaneVector exponents = zero;
  for (int64_t i = 1; i < group.n_max; ++i) {
    is_active = (zero + static_cast<double>(i)) < group.length;
    const LaneVector* w = load_position(i);
    const LaneVector shift = shifts[i % kTransposeChunk];
    lanes_matvec(tab.by_row.data(), stride, a, T, d);  // d[t] = sum_s a[s] E[s, t]
    LaneVector m = zero;
    for (int64_t t = 0; t < T; ++t) m = lane_max(m, d[t] * w[t]);
    // m = 0: no state reachable (log Z = -inf, for the per-sentence code to report). Checks
    // keep every reachable value far above the subnormal range, so a valid m is normal.
    const LaneMask m_ok = m >= zero + kMinNormalScale;
    failed |= is_active & ~m_ok;
    const LaneMask step = is_active & m_ok;
    const LaneVector scale = inverse_power_of_two(step ? m : zero + 1.0, exponents);
    for (int64_t t = 0; t < T; ++t) {
      const LaneVector next = d[t] * w[t] * scale;
      // A reachable state (d > 0, allowed emission) must keep a representable probability.
      lost |= step & (d[t] > zero) & (w[t] > zero) & (next < min_scaled);
      a[t] = step ? next : a[t];  // ended lanes keep their last row for the end scores
    }
    log_scale += step ? shift + tab.trans_max : zero;  // step: shift is the scores' maximum
    if (rows_a != nullptr) {
      for (int64_t t = 0; t < T; ++t) {
        store_lanes(rows_a + (i * T + t) * kGroup, a[t]);
        store_lanes(rows_w + (i * T + t) * kGroup, w[t]);
      }
    }
  }
  // exponents: the powers of two taken out at the positions each lane was active.
  LaneVector z = zero;
  for (int64_t t = 0; t < T; ++t) z += a[t] * tab.end_w[t];
  is_active = zero < group.length;
  failed |= is_active & ~(z > zero);
  for (int64_t j = 0; j < kGroup; ++j) {
    log_z[j] = log_scale[j] + exponents[j] * kLn2 + tab.end_max + std::log(z[j]);
  }
  return (failed | lost) & is_active;
}

// Backward scan of a group after lanes_forward(rows): the marginals times g (per lane; 0 for
// lanes to skip) into grad_emit (B, L, T); with kPairwise also the per-sentence transition
// gradients (B, T, T; each sentence's block overwritten, not added to), and start and end
// (B, T) ones where those are not null. Lanes in `skip` (and g = 0) are left alone.
// Returns the lanes that failed: their outputs are partial and must be redone by the caller
// (the transition gradient of a failed lane is never written).
// Not inlined: once per group, and inlined into forward_backward_batch's lambda GCC 12's SLP
// vectoriser crashed (internal compiler error) on it when the prefetches were added.
template <typename scalar_t, bool kPairwise>
__attribute__((noinline)) LaneMask lanes_backward(const ProbTables& tab, const LaneGroup& group, ProbLaneWork& work,
                        const double* rows_a, const double* rows_w, LaneVector g, LaneMask skip,
                        int64_t L, scalar_t* grad_emit, scalar_t* grad_trans,
                        scalar_t* grad_start, scalar_t* grad_end) {
  const int64_t T = tab.T, stride = tab.stride;
  const LaneVector zero = {}, min_scaled = zero + kMinScaled;
  LaneVector* b = work.b.data();
  LaneVector* gw = work.gw.data();
  LaneVector* b_prev = work.d.data();
  LaneVector* pair_acc = work.pair_acc.data();  // [s][t]: sum_i left_i[s] gw_i[t]
  int64_t pending = 0;  // rank-one terms in work.pair_left / pair_right not yet in pair_acc
  bool pair_started = false;  // whether pair_acc holds this group's sums (it is not zeroed first)
  // Lanes wait with beta = 0 until their last position (no NaN from an earlier group's values).
  std::fill(work.b.begin(), work.b.end(), zero);
  const LaneMask used = (zero < group.length) & ~skip & (g != zero);
  LaneMask failed = {};
  // Writes v[t] (t < T) of the lanes in `mask` to out + sentence * sentence_stride.
  auto scatter = [&](const LaneVector* v, LaneMask mask, scalar_t* out, int64_t sentence_stride) {
    for (int64_t j = 0; j < kGroup; ++j) {
      if (!mask[j]) continue;
      scalar_t* dst = out + group.sentence[j] * sentence_stride;
      for (int64_t t = 0; t < T; ++t) dst[t] = static_cast<scalar_t>(v[t][j]);
    }
  };
  // The marginals of kTransposeChunk positions are kept, mu of position i at
  // chunk[(i % kTransposeChunk) * T ..], and written to grad_emit when the chunk's first
  // position is done, 8 x 8 blocks transposed in registers (lanes_to_rows, lanes.h) instead of a
  // scalar store per score (which showed up in perf: benchmarks/results/NOTES.md).
  LaneVector* chunk = work.transposed.data();
  auto write_chunk = [&](int64_t first) {
    const int64_t count = std::min(kTransposeChunk, group.n_max - first);
    scalar_t* dest[kGroup];
    int64_t limit[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) {
      const int64_t n = static_cast<int64_t>(group.length[j]);
      const bool writes = used[j] && n > first;
      dest[j] = writes ? grad_emit + (group.sentence[j] * L + first) * T : nullptr;
      limit[j] = writes ? std::min(n - first, count) * T : 0;
    }
    lanes_to_rows<double>(chunk, limit, dest);
  };
  for (int64_t i = group.n_max - 1; i >= 0; --i) {
    const LaneVector position = zero + static_cast<double>(i);
    const LaneMask active = used & (position < group.length);
    const LaneMask last = active & (position == group.length - 1.0);
    // The rows the next position reads first: w_{i-1} and a_{i-2} (a_{i-1} is read here).
    if (i >= 1) prefetch_lane_vectors(rows_w + (i - 1) * T * kGroup, T);
    if (i >= 2) prefetch_lane_vectors(rows_a + (i - 2) * T * kGroup, T);
    for (int64_t t = 0; t < T; ++t) b[t] = last ? zero + tab.end_w[t] : b[t];  // beta_{n-1}
    const double* a = rows_a + i * T * kGroup;
    const LaneVector total = lanes_dot(a, b, T);
    failed |= active & ~(total > zero);
    const LaneVector scale = active & (total > zero) ? g / total : zero;
    LaneVector* mu = chunk + (i % kTransposeChunk) * T;
    for (int64_t t = 0; t < T; ++t) mu[t] = load_lanes(a + t * kGroup) * b[t] * scale;
    if (i % kTransposeChunk == 0) write_chunk(i);
    if (grad_end != nullptr) scatter(mu, last, grad_end, T);
    if (grad_start != nullptr && i == 0) scatter(mu, active, grad_start, T);
    if (i == 0) break;

    const double* w = rows_w + i * T * kGroup;
    LaneVector gw_max = zero;
    for (int64_t t = 0; t < T; ++t) {
      gw[t] = load_lanes(w + t * kGroup) * b[t];
      gw_max = lane_max(gw_max, gw[t]);
    }
    const LaneMask gw_ok = gw_max >= zero + kMinNormalScale;
    failed |= active & ~gw_ok;
    LaneVector unused_exponents = zero;
    const LaneVector gw_scale = inverse_power_of_two(gw_ok ? gw_max : zero + 1.0, unused_exponents);
    for (int64_t t = 0; t < T; ++t) gw[t] *= gw_scale;
    lanes_matvec(tab.by_col.data(), stride, gw, T, b_prev);  // b_prev[s] = sum_t E[s, t] gw[t]
    const double* a_prev = rows_a + (i - 1) * T * kGroup;
    if (kPairwise) {
      // xi[s, t] = a_{i-1}[s] E[s, t] gw[t] / sum_s a_{i-1}[s] b_prev[s]; E is applied once at
      // the end (it is the same at every position).
      const LaneVector pair_total = lanes_dot(a_prev, b_prev, T);
      failed |= active & ~(pair_total > zero);
      const LaneVector pair_scale = active & (pair_total > zero) ? g / pair_total : zero;
      LaneVector* left = work.pair_left.data() + pending * T;
      for (int64_t s = 0; s < T; ++s) left[s] = load_lanes(a_prev + s * kGroup) * pair_scale;
      std::copy(gw, gw + T, work.pair_right.data() + pending * T);
      if (++pending == kPairBatch || i == 1) {
        // The last batch (i = 1) also applies E: pair_acc ends as the gradients.
        const RankUpdateEnds ends = {!pair_started, i == 1 ? tab.by_row.data() : nullptr, stride};
        lanes_rank_update(work.pair_left.data(), work.pair_right.data(), pending, T, pair_acc, ends);
        pair_started = true;
        pending = 0;
      }
    }
    LaneVector b_max = zero;
    for (int64_t s = 0; s < T; ++s) b_max = lane_max(b_max, b_prev[s]);
    const LaneMask b_ok = b_max >= zero + kMinNormalScale;
    failed |= active & ~b_ok;
    const LaneVector b_scale = inverse_power_of_two(b_ok ? b_max : zero + 1.0, unused_exponents);
    for (int64_t s = 0; s < T; ++s) {
      const LaneVector next = b_prev[s] * b_scale;
      // A state on some path (reachable: a > 0) must keep a representable beta.
      failed |= active & (load_lanes(a_prev + s * kGroup) > zero) & (next > zero) & (next < min_scaled);
      b[s] = next;
    }
  }
  failed &= used;
  // Without a transition (every lane of length 1) the gradients are the caller's zeros.
  if (kPairwise && pair_started) {
    // Each lane's T x T block written out whole, kGroup x kGroup blocks transposed in registers
    // (lanes_to_rows, which reads pair_acc in whole blocks: hence its padded size): reading
    // lane j of every pair_acc vector in turn, a scalar at a time, was slow for short sentences
    // (benchmarks/results/NOTES.md).
    scalar_t* dest[kGroup];
    int64_t limit[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) {
      const bool writes = used[j] && !failed[j];
      // Written, not added: no other path has touched these rows (the caller's are zero).
      dest[j] = writes ? grad_trans + group.sentence[j] * T * T : nullptr;
      limit[j] = writes ? T * T : 0;
    }
    lanes_to_rows<double>(pair_acc, limit, dest);
  }
  return failed;
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
