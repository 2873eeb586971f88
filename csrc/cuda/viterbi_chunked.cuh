// Parallel in time: Viterbi for long sentences at small batch, the max-plus counterpart of the
// chunked log Z (forward_backward_chunked.cuh).
//
// The sequential kernel (viterbi.cu) takes one dependent step per position. Here each sentence
// is cut into chunks of S positions (chunk c: positions [c S, min((c + 1) S, n))):
//
//   1. viterbi_chunk_transfer_kernel, every (sentence, chunk, row r) at once: the chunk's
//      max-plus transfer matrix M_c[r][t] = best score from tag r at position c S - 1 to tag t
//      at the chunk's last position (transitions and emissions of the chunk); for chunk 0 the
//      Viterbi forward vector from `start` (one row, computed exactly as the sequential kernel).
//      Checks the emissions (row 0 reads the whole chunk).
//   2. viterbi_chunk_scan_kernel, one group per sentence: delta at each chunk boundary,
//      delta(c S - 1)[t] = max_r delta(c S - S - 1)[r] + M_{c-1}[r][t]. Equal to the sequential
//      kernel's delta up to rounding (the additions are associated differently).
//   3. viterbi_chunk_decode_kernel, every (sentence, chunk) at once: the ordinary Viterbi
//      recursion inside the chunk from the boundary delta, step by step exactly as the
//      sequential kernel (max_s (delta[s] + trans[s][t]) in ascending s with a strict '>', then
//      + emit), with backpointers, and for each end tag t the tag at position c S - 1 its
//      backpointers lead to (carried along the recursion by shuffles): the chunk's map.
//   4. viterbi_chunk_finish_kernel, a block per sentence: the best last tag as the sequential
//      kernel chooses it, then each chunk's end tag through the maps, last chunk to first (one
//      thread); the backtrace inside each chunk (a thread per chunk); the path's score summed in
//      the sequential kernel's order, ((start + e_0) + trans) + e_1 ... + end, so that a path
//      equal to the sequential kernel's comes with the identical score (one thread).
//
// With exactly representable sums (small integer scores) every value of phase 3 is the
// sequential kernel's, so paths and ties come out identical; otherwise the boundary values
// differ by rounding and only near-ties within rounding can decode differently. -inf is handled
// as in the sequential kernel: a sentence whose every sequence is forbidden gets score -inf and
// path -1, an empty one score 0 and path -1, NaN / +inf emissions are reported and the sentence
// left unwritten. Only for the register kernels' tag counts (T <= 32 in float, 16 in double):
// lane t owns tag t and its column of the transitions in registers. Phases 1 and 2 run the
// loops of semiring.cuh, shared with the log semiring's scan (forward_backward_chunked.cuh).
#pragma once

#include "forward_backward_registers.cuh"
#include "forward_backward_chunked.cuh"  // set_chunk_arguments, chunk_group_blocks
#include "semiring.cuh"  // chunk_transfer_rows, scan_chunk_boundaries

namespace crfkit {
namespace cuda {
namespace {

template <typename scalar_t>
struct ViterbiChunkParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  scalar_t* matrices;           // (B, C, T, T): phase 1's M_c (chunk 0: row 0 only)
  scalar_t* boundary;           // (B, C, T): delta at position c S - 1, for c >= 1
  scalar_t* last_delta;         // (B, T): delta at the sentence's last position (phase 3)
  uint8_t* backpointers;        // (B, L, T): best predecessor of t at i (chunk-internal recursion)
  uint8_t* maps;                // (B, C, T): tag at c S - 1 reached from end tag t of chunk c (c >= 1)
  int* end_tags;                // (B, C): each chunk's end tag on the best path, -1 where none
  int* bad;                     // (B,): NaN / +inf emissions within the length seen (phase 1)
  scalar_t* scores;             // (B,)
  int64_t* paths;               // (B, L), written whole by the path kernel (-1 where no tag)
  long long* status;
  InputChecks<scalar_t> checks;  // run first by the transfer kernel
  int64_t batch, max_len, chunk, chunks;  // chunk = S, chunks = C = ceil(L / S)
  int num_tags;
};

// One Viterbi step for the lane's tag t: max_s (v[s] + column[s]) over s < T, v[s] being lane
// s's value, in ascending s with a strict '>' (the smaller predecessor wins a tie), exactly as
// the sequential kernel. Every lane of the warp runs all kLanes shuffles.
template <typename scalar_t, int kLanes>
__device__ __forceinline__ scalar_t max_plus_step(scalar_t v, const scalar_t (&column)[kLanes], int T, int& arg) {
  scalar_t best = from_lane(v, 0, kLanes) + column[0];
  arg = 0;
#pragma unroll
  for (int s = 1; s < kLanes; ++s) {
    const scalar_t candidate = from_lane(v, s, kLanes) + column[s];
    if (s < T && candidate > best) {
      best = candidate;
      arg = s;
    }
  }
  return best;
}

// The max-plus semiring's phase 1 for chunk_transfer_rows (semiring.cuh): a row is the Viterbi
// recursion from the one-hot row r (chunk 0: from start + e_0, exactly as the sequential kernel),
// unnormalised (no offsets); phase 1 also runs the input checks.
template <typename scalar_t>
struct MaxPlusChunks {
  __device__ __forceinline__ static void prologue(const ViterbiChunkParams<scalar_t>& p) { check_inputs(p.checks); }

  template <int kLanes>
  __device__ __forceinline__ static ChunkRow<scalar_t> row(const ViterbiChunkParams<scalar_t>& p, const ChunkWork& w,
                                                           int64_t steps, int T, int lane, bool own) {
    const scalar_t kNegInf = neg_inf<scalar_t>();
    scalar_t column[kLanes];
#pragma unroll
    for (int s = 0; s < kLanes; ++s) column[s] = own && s < T ? p.transitions[s * T + lane] : scalar_t(0);
    const scalar_t* emit = p.emissions + ((w.has ? w.b : 0) * p.max_len + w.c * p.chunk) * T + (own ? lane : 0);
    // The first position: start + e (chunk 0) or trans[r][t] + e (from the one-hot row r).
    const scalar_t first = !own ? kNegInf : (w.c == 0 ? p.start[lane] : p.transitions[w.r * T + lane]);
    scalar_t v = kNegInf;
    bool bad = false;
    for (int64_t j = 0; j < steps; ++j) {
      int arg;
      const scalar_t best = max_plus_step(v, column, T, arg);
      if (own && j < w.len) {
        const scalar_t e = emit[j * T];
        bad |= is_nan_or_pos_inf(e);
        v = (j == 0 ? first : best) + e;
      }
    }
    return {v, 0, bad};
  }

  template <typename Report>
  __device__ __forceinline__ static void store(const ViterbiChunkParams<scalar_t>& p, const ChunkWork& w, int T,
                                               int lane, bool own, const ChunkRow<scalar_t>& a, bool bad,
                                               Report&& report) {
    if (own) p.matrices[((w.b * p.chunks + w.c) * T + w.r) * T + lane] = a.value;
    if (lane == 0 && bad && w.r == 0) report();
  }

  __device__ __forceinline__ static int* bad_count(const ViterbiChunkParams<scalar_t>& p) { return p.bad; }
};

// Phase 1: one group per (sentence b, chunk c, row r), r fastest (chunk_transfer_rows).
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    viterbi_chunk_transfer_kernel(const ViterbiChunkParams<scalar_t> p) {
  chunk_transfer_rows<MaxPlusChunks<scalar_t>, kLanes>(p);
}

// Phase 2: one group per sentence, lane t owning tag t: delta at each chunk boundary.
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) viterbi_chunk_scan_kernel(const ViterbiChunkParams<scalar_t> p) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const ScanGroup g = scan_group<kLanes>(p);
  const int T = g.T, lane = g.lane;
  const bool own = g.own;
  const scalar_t* matrices = p.matrices + g.bs * g.C * T * T;

  scalar_t v = own && g.num_chunks > 0 ? matrices[lane] : kNegInf;  // chunk 0's one row: delta(S - 1)
  // delta <- max_r delta[r] + M_c[r][.]
  auto step = [&](int64_t c, bool active) {
    scalar_t column[kLanes];  // M_c[.][t]
#pragma unroll
    for (int r = 0; r < kLanes; ++r) column[r] = active && own && r < T ? matrices[(c * T + r) * T + lane] : kNegInf;
    int arg;
    const scalar_t best = max_plus_step(v, column, T, arg);
    if (active) v = best;
  };
  scan_chunk_boundaries<true>(g, [&] { return p.boundary; }, [&] { return v; }, step);
}

// Phase 3: one group per (sentence b, chunk c), c fastest: the recursion inside the chunk with
// backpointers, the chunk's map (c >= 1) and, for the sentence's last chunk, its last delta.
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    viterbi_chunk_decode_kernel(const ViterbiChunkParams<scalar_t> p) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const int T = p.num_tags;
  const int lane = threadIdx.x % kLanes;
  const bool own = lane < T;
  const int64_t id = (int64_t)blockIdx.x * kGroupsPerBlock + threadIdx.x / kLanes;
  const ChunkWork w = chunk_work(id, 1, p.chunks, p.chunk, p.batch, p.lengths, p.max_len);
  const int64_t c = w.c, b = w.b, n = w.n, len = w.len;
  const bool has = w.has;
  const int64_t steps = warp_max(len);
  if (steps == 0) return;  // warp-uniform

  scalar_t column[kLanes];
#pragma unroll
  for (int s = 0; s < kLanes; ++s) column[s] = own && s < T ? p.transitions[s * T + lane] : scalar_t(0);
  const int64_t bs = has ? b : 0;
  const int64_t first_position = c * p.chunk;
  const scalar_t* emit = p.emissions + (bs * p.max_len + first_position) * T + (own ? lane : 0);
  uint8_t* backpointers = p.backpointers + (bs * p.max_len + first_position) * T + (own ? lane : 0);
  // delta at c S - 1 (c >= 1); chunk 0 starts from start + e_0 at its first step
  scalar_t v = own && c > 0 && len > 0 ? p.boundary[(bs * p.chunks + c) * T + lane] : kNegInf;
  int origin = 0;  // the tag at c S - 1 that the lane's tag's best partial path comes from
  for (int64_t j = 0; j < steps; ++j) {
    int arg;
    const scalar_t best = max_plus_step(v, column, T, arg);
    const int carried = from_lane(origin, arg, kLanes);
    if (own && j < len) {
      const scalar_t e = emit[j * T];
      if (c == 0 && j == 0) {
        v = p.start[lane] + e;
      } else {
        v = best + e;
        backpointers[j * T] = static_cast<uint8_t>(arg);
        origin = j == 0 ? arg : carried;
      }
    }
  }
  if (len == 0 || !own) return;
  if (c > 0) p.maps[(b * p.chunks + c) * T + lane] = static_cast<uint8_t>(origin);
  if (first_position + len == n) p.last_delta[b * T + lane] = v;
}

// Phase 4, first step (one thread of sentence b's block): the best last tag (the sequential
// kernel's choice: the first maximum of delta + end in ascending t), the score of the empty and
// the impossible sentences, and each chunk's end tag on the best path, through the maps from the
// last chunk to the first (all C entries of the sentence's end_tags are written: -1 where none).
template <typename scalar_t>
__device__ void chain_chunk_end_tags(const ViterbiChunkParams<scalar_t>& p, int64_t b) {
  int* end_tags = p.end_tags + b * p.chunks;
  for (int64_t c = 0; c < p.chunks; ++c) end_tags[c] = -1;
  if (p.bad[b] != 0) return;  // bad emissions: reported, score left unwritten
  const int T = p.num_tags;
  const int64_t n = safe_length(p.lengths, b, p.max_len);
  if (n == 0) {
    p.scores[b] = 0;  // the empty sequence; its path is all -1
    return;
  }
  const scalar_t* delta = p.last_delta + b * T;
  scalar_t best = delta[0] + p.end[0];
  int tag = 0;
  for (int t = 1; t < T; ++t) {
    const scalar_t v = delta[t] + p.end[t];
    if (v > best) {
      best = v;
      tag = t;
    }
  }
  if (best == neg_inf<scalar_t>()) {  // every sequence forbidden: path stays -1
    p.scores[b] = best;
    return;
  }
  const int64_t num_chunks = (n + p.chunk - 1) / p.chunk;
  end_tags[num_chunks - 1] = tag;
  for (int64_t c = num_chunks - 1; c >= 1; --c) {
    const int code = p.maps[(b * p.chunks + c) * T + tag];
    if (code >= T) return;  // cannot happen with valid data; never read out of range
    tag = code;
    end_tags[c - 1] = tag;
  }
}

// Second step (a thread per chunk c): the path inside the chunk, from its end tag back through
// the chunk's backpointers. The chunks' output ranges [c S, c S + S) tile the row, and each is
// written whole: -1 beyond the sentence and where no path exists.
template <typename scalar_t>
__device__ void write_chunk_path(const ViterbiChunkParams<scalar_t>& p, int64_t b, int64_t c) {
  const int T = p.num_tags;
  int tag = p.end_tags[b * p.chunks + c];  // -1: no path (or no such chunk)
  const int64_t n = safe_length(p.lengths, b, p.max_len);
  const int64_t first = c * p.chunk, len = chunk_length(n, c, p.chunk);
  const int64_t last = first + p.chunk < p.max_len ? first + p.chunk : p.max_len;
  int64_t* path = p.paths + b * p.max_len;
  const uint8_t* backpointers = p.backpointers + b * p.max_len * T;
  int64_t unwritten_from = first;  // path[unwritten_from, last) gets -1
  if (tag >= 0) {
    unwritten_from = first + len;
    for (int64_t i = first + len - 1; i >= first; --i) {
      path[i] = tag;
      if (i == first) break;
      const int code = backpointers[i * T + tag];
      if (code >= T) {  // cannot happen with valid data
        for (int64_t j = first; j < i; ++j) path[j] = -1;
        break;
      }
      tag = code;
    }
  }
  for (int64_t i = unwritten_from; i < last; ++i) path[i] = -1;
}

// Third step (one thread): the path's score, summed along it in the sequential kernel's order
// (delta_0 = start + e_0; delta_i = (delta_{i-1} + trans) + e_i; + end), hence bit for bit the
// sequential kernel's score for the same path.
template <typename scalar_t>
__device__ void score_chunked_path(const ViterbiChunkParams<scalar_t>& p, int64_t b) {
  if (p.end_tags[b * p.chunks] < 0) return;  // scored by the first step
  const int T = p.num_tags;
  const int64_t n = safe_length(p.lengths, b, p.max_len);
  const int64_t* path = p.paths + b * p.max_len;
  const scalar_t* emit = p.emissions + b * p.max_len * T;
  int64_t previous = path[0];
  if (previous < 0 || previous >= T) return;  // cannot happen with valid data
  scalar_t score = p.start[previous] + emit[previous];
  for (int64_t i = 1; i < n; ++i) {
    const int64_t tag = path[i];
    if (tag < 0 || tag >= T) return;  // cannot happen with valid data
    score = (score + p.transitions[previous * T + tag]) + emit[i * T + tag];
    previous = tag;
  }
  p.scores[b] = score + p.end[previous];
}

// Phase 4: a block per sentence b, its three steps in turn (one launch instead of three: at
// small batch the host's time per launch is most of a call's).
template <typename scalar_t>
__global__ void viterbi_chunk_finish_kernel(const ViterbiChunkParams<scalar_t> p) {
  const int64_t b = blockIdx.x;
  if (threadIdx.x == 0) chain_chunk_end_tags(p, b);
  __syncthreads();  // end_tags written
  for (int64_t c = threadIdx.x; c < p.chunks; c += blockDim.x) write_chunk_path(p, b, c);
  __syncthreads();  // the path written
  if (threadIdx.x == 0) score_chunked_path(p, b);
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
