// Parallel in time: log Z, marginals and the backward of log Z for long sentences at small batch.
//
// The sequential kernels (forward_backward_registers.cuh) take one dependent step per position:
// a sentence of 512 positions is 512 steps forward and 512 back, whatever the batch, so a few
// long sentences leave the GPU idle. Here each sentence is cut into chunks of S positions and
// the time loop becomes three short ones (S + C + S steps for C = ceil(n / S) chunks):
//
//   1. chunk_transfer_kernel, every (sentence, chunk, row r) at once: the chunk's transfer
//      matrix M_c[r][t] = log sum over the chunk's tag paths from tag r at the position before
//      the chunk to tag t at its last position (emissions and transitions of the chunk); for
//      chunk 0 the forward vector from `start` instead (one row). Each row is the register
//      kernel's forward pass (register_forward_pass) from a one-hot start, so the numerics are
//      the sequential kernel's: factored log-space steps, exact fallback, rows normalised to max
//      0 with their offset in double.
//   2. chunk_scan_kernel, one group per sentence: alpha at the chunk boundaries (C steps of
//      alpha <- logsumexp_r(alpha[r] + M_c[r][.]), exact, offsets in double), log Z, and with
//      kBoundaries beta at each chunk's last position (beta <- logsumexp_t(M_c[.][t] + beta[t])).
//   3. chunk_marginals_kernel, every (sentence, chunk) at once: the chunk as a sentence of its
//      own, with start = the message into its first position and end = beta at its last
//      (register_forward_pass and register_backward_pass again). That sentence's distribution
//      over the chunk's tags is the full sentence's, so its marginals and pairwise marginals
//      are the full sentence's; the pair across the chunk's left boundary is
//      mu[p0][t] * exp(alpha[p0 - 1][s] + trans[s, t] - message[t]). Pairwise sums go to a
//      per-chunk slice and are added per sentence in chunk order (deterministic).
//
// Work is about T + 2 times the sequential forward-backward, in exchange for depth S + 2C + 2S
// instead of 2n: worth it while B * C * T groups still fit the GPU (chunked_launch_plan in
// log_partition.cu decides). Only for the register kernel's tag counts (T <= 32 in float, 16 in
// double). Results agree with the sequential kernels to rounding (another summation order).
// Phases 1 and 2 run the loops of semiring.cuh, shared with the max-plus scan (viterbi_chunked.cuh).
#pragma once

#include "forward_backward_registers.cuh"
#include "semiring.cuh"  // chunk_transfer_rows, scan_chunk_boundaries

namespace crfkit {
namespace cuda {
namespace {

template <typename scalar_t>
struct ChunkParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  const scalar_t* tables;       // transition_tables_kernel's
  scalar_t* matrices;           // (B, C, T, T): phase 1's transfer matrices, rows normalised to max 0;
                                // phase 3 reuses it for the per-chunk pairwise sums
  double* row_offsets;          // (B, C, T): the matrices' row offsets (-inf: the row is forbidden)
  scalar_t* alpha_in;           // (B, C, T): alpha at the position before chunk c (c >= 1), max 0
  scalar_t* beta_out;           // (B, C, T): beta at chunk c's last position, max 0
  int* skip;                    // (B,): bad emissions seen (phase 1), then "no gradients" (phase 2)
  scalar_t* log_z;              // (B,) or null
  scalar_t* rows;               // (B, L, T): alpha rows, then the marginals (phase 3)
  double* offsets;              // (B * C, S): phase 3's forward offsets per chunk
  long long* status;
  int64_t batch, max_len, chunk, chunks;  // chunk = S, chunks = C = ceil(L / S)
  int num_tags;
};

// ---- launch (host) -----------------------------------------------------------------------------
// The parameters every chunked launch shares, forward-backward (ChunkParams) and Viterbi
// (ViterbiChunkParams, viterbi_chunked.cuh): the CRF arguments, phase 1's matrices (B, C, T, T),
// the status words and the sizes, for chunks of S positions, C = ceil(L / S) per sentence.
template <typename scalar_t, typename Params>
void set_chunk_arguments(Params& p, const CrfArgs& a, int64_t S, int64_t C, const Tensor& matrices,
                         Status& status) {
  set_crf_arguments<scalar_t>(p, a, status);
  p.matrices = matrices.mutable_data_ptr<scalar_t>();
  p.chunk = S;
  p.chunks = C;
}

// Blocks of kMaxThreadsPerBlock threads for `groups` groups of kLanes lanes (one group per
// sentence, chunk or row, by phase).
template <int kLanes>
unsigned chunk_group_blocks(int64_t groups) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  return (unsigned)((groups + kGroupsPerBlock - 1) / kGroupsPerBlock);
}

// ---- device -------------------------------------------------------------------------------------
// logsumexp_s(terms[s]) over the first T of kLanes values, exactly; -inf when all are -inf.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t lse_of(const scalar_t (&terms)[kLanes], int T) {
  scalar_t top = neg_inf<scalar_t>();
#pragma unroll
  for (int s = 0; s < kLanes; ++s) top = s < T ? max_(top, terms[s]) : top;
  scalar_t total = 0;
#pragma unroll
  for (int s = 0; s < kLanes; ++s) total += s < T && top != neg_inf<scalar_t>() ? exp_(terms[s] - top) : scalar_t(0);
  return top == neg_inf<scalar_t>() ? top : top + log_(total);
}

// The log semiring's phase 1 for chunk_transfer_rows (semiring.cuh): a row is the register
// kernel's forward pass from the one-hot row r (chunk 0: from start), normalised to max 0, its
// offset in double.
template <typename scalar_t>
struct LogChunks {
  __device__ __forceinline__ static void prologue(const ChunkParams<scalar_t>&) {}

  template <int kLanes>
  __device__ __forceinline__ static ChunkRow<scalar_t> row(const ChunkParams<scalar_t>& p, const ChunkWork& w,
                                                           int64_t steps, int T, int lane, bool own) {
    scalar_t e_col[kLanes];
#pragma unroll
    for (int s = 0; s < kLanes; ++s) e_col[s] = own && s < T ? p.tables[s * T + lane] : scalar_t(0);
    const scalar_t col_max = own ? p.tables[T * T + lane] : neg_inf<scalar_t>();
    const scalar_t* own_transitions = p.transitions + (own ? lane : 0);
    const scalar_t first = !own ? neg_inf<scalar_t>() : (w.c == 0 ? p.start[lane] : p.transitions[w.r * T + lane]);
    const scalar_t* emit = p.emissions + ((w.has ? w.b : 0) * p.max_len + w.c * p.chunk) * T + lane;

    double offset = 0;
    bool bad = false;
    const scalar_t a = register_forward_pass<scalar_t, false, kLanes>(emit, nullptr, nullptr, w.len, steps, T, lane,
                                                                     own, first, col_max, e_col, own_transitions,
                                                                     offset, bad);
    return {a, offset, bad};
  }

  template <typename Report>
  __device__ __forceinline__ static void store(const ChunkParams<scalar_t>& p, const ChunkWork& w, int T, int lane,
                                               bool own, const ChunkRow<scalar_t>& a, bool bad, Report&& report) {
    const int64_t row = (w.b * p.chunks + w.c) * T + w.r;
    if (own) p.matrices[row * T + lane] = a.value;
    if (lane == 0) {
      p.row_offsets[row] = a.offset;
      if (bad && w.r == 0) report();
    }
  }

  __device__ __forceinline__ static int* bad_count(const ChunkParams<scalar_t>& p) { return p.skip; }
};

// Phase 1: one group per (sentence b, chunk c, row r), r fastest (chunk_transfer_rows).
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) chunk_transfer_kernel(const ChunkParams<scalar_t> p) {
  chunk_transfer_rows<LogChunks<scalar_t>, kLanes>(p);
}

// Phase 2: one group per sentence, lane t owning tag t. Writes log Z (where p.log_z is set) and
// with kBoundaries alpha_in, beta_out and skip[b].
template <typename scalar_t, int kLanes, bool kBoundaries>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) chunk_scan_kernel(const ChunkParams<scalar_t> p) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const ScanGroup g = scan_group<kLanes>(p);
  const int T = g.T, lane = g.lane;
  const bool own = g.own;
  const int64_t b = g.b, bs = g.bs, n = g.n, C = g.C, num_chunks = g.num_chunks, chunk_steps = g.chunk_steps;
  const bool has = g.has;
  const scalar_t* matrices = p.matrices + bs * C * T * T;
  const double* row_offsets = p.row_offsets + bs * C * T;

  // ---- forward: alpha (max 0) and its offset after chunk 0, then across each chunk ----
  scalar_t alpha = own && num_chunks > 0 ? matrices[lane] : kNegInf;  // chunk 0's one row
  double offset = num_chunks > 0 ? row_offsets[0] : 0;
  // Chunk c's column of M (the lane's tag) and the lane's row offset, loaded a chunk ahead:
  // they do not depend on the scan, so their latency overlaps the previous step.
  scalar_t column[kLanes];
  double row_offset = -CUDART_INF;
  auto load_column = [&](int64_t c) {
    const bool active = c < num_chunks;
    const scalar_t* from = matrices + (active ? c : 0) * T * T + (own ? lane : 0);
#pragma unroll
    for (int r = 0; r < kLanes; ++r) column[r] = active && own && r < T ? from[r * T] : kNegInf;
    row_offset = active && own ? row_offsets[c * T + lane] : -CUDART_INF;
  };
  load_column(1);
  // alpha <- logsumexp_r(alpha[r] + M_c[r][.]), exact, the offsets in double
  auto step = [&](int64_t c, bool active) {
    scalar_t terms[kLanes];
#pragma unroll
    for (int r = 0; r < kLanes; ++r) terms[r] = column[r];
    const double w_row = row_offset;
    load_column(c + 1);
    // lane r's weight alpha[r] + offset of row r, shifted by the group's max (in double: the
    // offsets are large, their differences small)
    const double w = alpha == kNegInf || w_row == -CUDART_INF ? -CUDART_INF : alpha + w_row;
    const double w_max = group_max(w, kLanes);
    const scalar_t q = w == -CUDART_INF ? kNegInf : static_cast<scalar_t>(w - w_max);
#pragma unroll
    for (int r = 0; r < kLanes; ++r) terms[r] += from_lane(q, r, kLanes);  // -inf beyond T / off own
    const scalar_t x = lse_of(terms, T);
    const scalar_t m = group_max(x, kLanes);
    if (active) {
      alpha = m == kNegInf ? x : x - m;
      offset = w_max == -CUDART_INF || m == kNegInf ? -CUDART_INF : offset + w_max + static_cast<double>(m);
    }
  };
  scan_chunk_boundaries<kBoundaries>(g, [&] { return p.alpha_in; }, [&] { return alpha; }, step);
  // log Z = offset + logsumexp_t(alpha[t] + end[t]), as finish_forward
  const scalar_t last = own && num_chunks > 0 ? alpha + p.end[lane] : kNegInf;
  const scalar_t m = group_max(last, kLanes);
  const scalar_t sum = group_sum(last == kNegInf ? scalar_t(0) : exp_(last - m), kLanes);
  double log_z = 0;
  if (num_chunks > 0) {
    log_z = offset == -CUDART_INF || m == kNegInf ? -CUDART_INF : offset + static_cast<double>(m + log_(sum));
  }
  if (has && lane == 0) {
    if (p.log_z != nullptr) p.log_z[b] = static_cast<scalar_t>(log_z);
    if (kBoundaries) p.skip[b] = n == 0 || p.skip[b] != 0 || log_z == -CUDART_INF;
  }
  if (!kBoundaries) return;

  // ---- backward: beta (max 0) at each chunk's last position, from the last chunk down ----
  scalar_t beta = own && num_chunks > 0 ? p.end[lane] : kNegInf;
  const scalar_t beta_max = group_max(beta, kLanes);
  if (beta_max != kNegInf) beta -= beta_max;
  if (num_chunks > 0 && own) p.beta_out[(bs * C + num_chunks - 1) * T + lane] = beta;
  // Chunk c's row of M (the lane's tag) and its offset, loaded a chunk ahead.
  scalar_t row[kLanes];
  auto load_row = [&](int64_t c) {
    const bool active = c >= 1;
    const scalar_t* from = matrices + (active ? c : 0) * T * T + (own ? lane : 0) * T;
#pragma unroll
    for (int t = 0; t < kLanes; ++t) row[t] = active && own && t < T ? from[t] : kNegInf;
    row_offset = active && own ? row_offsets[c * T + lane] : -CUDART_INF;
  };
  load_row(num_chunks - 1);
  for (int64_t j = 1; j < chunk_steps; ++j) {
    const int64_t c = num_chunks - j;  // beta at chunk c - 1's last position from chunk c's
    const bool active = c >= 1;
    scalar_t terms[kLanes];
#pragma unroll
    for (int t = 0; t < kLanes; ++t) terms[t] = row[t];
    const double v_row = row_offset;
    load_row(c - 1);
#pragma unroll
    for (int t = 0; t < kLanes; ++t) terms[t] += from_lane(beta, t, kLanes);  // -inf beyond T / off own
    const scalar_t y = lse_of(terms, T);
    const double v = v_row == -CUDART_INF || y == kNegInf ? -CUDART_INF : v_row + y;
    const double v_max = group_max(v, kLanes);
    if (active) {
      beta = v == -CUDART_INF || v_max == -CUDART_INF ? kNegInf : static_cast<scalar_t>(v - v_max);
      if (own) p.beta_out[(bs * C + c - 1) * T + lane] = beta;
    }
  }
}

// Phase 3: one group per (sentence b, chunk c), c fastest. Marginals into p.rows; with
// kPairwise the chunk's pairwise sums (s -> t, row-major) into p.matrices[(b C + c) T T ...].
template <typename scalar_t, int kLanes, bool kPairwise>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) chunk_marginals_kernel(const ChunkParams<scalar_t> p) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = p.num_tags;
  const int lane = threadIdx.x % kLanes;
  const bool own = lane < T;
  const int64_t id = (int64_t)blockIdx.x * kGroupsPerBlock + threadIdx.x / kLanes;
  const ChunkWork w = chunk_work(id, 1, p.chunks, p.chunk, p.batch, p.lengths, p.max_len);
  const int64_t c = w.c, b = w.b, len = w.len;
  const bool has = w.has;
  const int64_t steps = warp_max(len);
  if (has && own) {  // the chunk's positions beyond the sentence: 0 (the host does not clear the rows)
    scalar_t* chunk_rows = p.rows + (b * p.max_len + c * p.chunk) * T + lane;
    const int64_t positions = p.max_len - c * p.chunk < p.chunk ? p.max_len - c * p.chunk : p.chunk;
    for (int64_t i = len; i < positions; ++i) chunk_rows[i * T] = 0;
  }
  if (steps == 0) return;  // warp-uniform

  scalar_t e_col[kLanes], e_row[kLanes], col_max, row_max;
  load_lane_tables<scalar_t, kLanes, true>(p.tables, T, lane, own, e_col, e_row, col_max, row_max);
  const scalar_t* own_transitions = p.transitions + (own ? lane : 0);  // column `lane`: [s * T]
  const scalar_t* own_row = p.transitions + (own ? lane : 0) * T;      // row `lane`: [t]

  const int64_t bs = has ? b : 0;
  const int64_t boundary = (bs * p.chunks + c) * T + lane;
  const scalar_t* emit = p.emissions + (bs * p.max_len + c * p.chunk) * T + lane;
  scalar_t* rows = p.rows + (bs * p.max_len + c * p.chunk) * T + lane;
  double* offsets = p.offsets + id * p.chunk;
  const bool skip = len == 0 || p.skip[bs] != 0;

  // The chunk's start: `start` for chunk 0, else the message into its first position,
  // incoming[t] = logsumexp_s(alpha_prev[s] + trans[s, t]).
  const scalar_t alpha_prev = own && c > 0 && len > 0 ? p.alpha_in[boundary] : kNegInf;
  const scalar_t incoming = group_exact_lse<scalar_t, kLanes>(alpha_prev, own_transitions, T, T);
  const scalar_t first = !own ? kNegInf : (c == 0 ? p.start[lane] : incoming);
  const scalar_t end = own && len > 0 ? p.beta_out[boundary] : kNegInf;

  double offset = 0;
  bool bad = false;  // reported by phase 1
  const scalar_t a = register_forward_pass<scalar_t, true, kLanes>(emit, rows, offsets, len, steps, T, lane, own,
                                                                  first, col_max, e_col, own_transitions, offset, bad);
  // log Z of the chunk as a sentence (the full sentence's, up to the boundary vectors' shifts)
  const scalar_t last = len > 0 ? a + end : kNegInf;
  const scalar_t m = group_max(last, kLanes);
  const scalar_t sum = group_sum(last == kNegInf ? scalar_t(0) : exp_(last - m), kLanes);
  const double log_z = offset == -CUDART_INF || m == kNegInf ? -CUDART_INF : offset + static_cast<double>(m + log_(sum));
  const bool chunk_skip = skip || log_z == -CUDART_INF;

  scalar_t acc[kLanes];
#pragma unroll
  for (int s = 0; s < kLanes; ++s) acc[s] = 0;
  scalar_t unused_start = 0, unused_end = 0;
  constexpr Output kPasses = kPairwise ? Output::kWithMarginals : Output::kMarginals;
  register_backward_pass<scalar_t, kPasses, kLanes>(emit, rows, offsets, len, steps, T, own, scalar_t(1), chunk_skip,
                                                    log_z, end, col_max, row_max, e_col, e_row, own_transitions,
                                                    own_row, acc, unused_start, unused_end);
  if (!kPairwise) return;
  // The pair (p0 - 1, p0) across the chunk's left boundary: P(s, t) = mu[p0][t] * P(s | t), where
  // P(s | t) = exp(alpha_prev[s] + trans[s, t] - incoming[t]) (incoming is their logsumexp).
  const bool across = c > 0 && !chunk_skip && own && incoming != kNegInf;
  const scalar_t mu_first = across ? rows[0] : scalar_t(0);  // this lane's own write
#pragma unroll
  for (int s = 0; s < kLanes; ++s) {
    const scalar_t alpha_s = from_lane(alpha_prev, s, kLanes);
    if (across && s < T && mu_first > 0) acc[s] += mu_first * exp_(alpha_s + own_transitions[s * T] - incoming);
  }
  if (has) move_counts_column(p.matrices + (b * p.chunks + c) * T * T, acc, T, lane, own);
}

// Phase 4 (kPairwise): counts[b] = the sum of sentence b's chunk slices, in chunk order.
template <typename scalar_t>
__global__ void sum_chunk_counts_kernel(const scalar_t* chunk_counts, const int64_t* lengths, scalar_t* counts,
                                        int64_t batch, int64_t max_len, int64_t S, int64_t C, int64_t T) {
  const int64_t count = batch * T * T;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = k / (T * T), entry = k % (T * T);
    const int64_t num_chunks = (safe_length(lengths, b, max_len) + S - 1) / S;
    scalar_t sum = 0;
    for (int64_t c = 0; c < num_chunks; ++c) sum += chunk_counts[(b * C + c) * T * T + entry];
    counts[k] = sum;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
