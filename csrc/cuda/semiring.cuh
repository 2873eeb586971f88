// The algorithms that the CUDA kernels run under more than one semiring, written once and
// templated on it (as torch-struct's semirings and pytorch_scatter's reducers do).
//
// A semiring here is the (plus, times) pair of a recursion over tag scores, times always being
// the addition of scores (log space):
//   log (sum-product):  plus = logsumexp    -> log Z, marginals (forward_backward_chunked.cuh)
//   max-plus:           plus = max, with the argmax kept (the smaller index wins a tie)
//                                           -> Viterbi (viterbi.cu, viterbi_chunked.cuh)
//   k-max-plus:         plus = the K largest of the merged sorted lists, with their codes
//                                           -> k-best Viterbi (kbest.cu)
// The policy type that a template takes supplies the semiring's arithmetic with its numerics
// (the log semiring's rows normalised to max 0 with offsets in double, its exact fallbacks;
// max-plus's strict '>' in ascending index), so each kernel keeps its own order of operations and
// its results bit for bit; the template supplies the loop structure, the indexing and the
// reporting that the semirings share.
//
// 1. Parallel in time (chunks of S positions, C = ceil(L / S) per sentence; B sentences, L
//    positions, T tags, lane t of a group of kLanes owning tag t):
//    chunk_transfer_rows  phase 1: row r of chunk c's transfer matrix M_c (B, C, T, T),
//                         M_c[r][t] = plus over the chunk's paths from tag r before the chunk to
//                         tag t at its last position of times(transitions, emissions); for
//                         chunk 0 the forward vector from `start` (row 0 only).
//    scan_chunk_boundaries  phase 2: v_c = v_{c-1} times M_c (v_c[t] = plus_r v_{c-1}[r] times
//                         M_c[r][t]), the vector at each chunk boundary (B, C, T).
//    Phase 1's policies: LogChunks (forward_backward_chunked.cuh), MaxPlusChunks
//    (viterbi_chunked.cuh); phase 2's steps are written in chunk_scan_kernel and
//    viterbi_chunk_scan_kernel.
//    The other phases differ by more than the semiring (marginals and the backward pass of log Z;
//    the chunk-internal decode with backpointers and maps) and stay with their kernels.
// 2. decode_sentences, the per-sentence decoders' driver: one group of G lanes per sentence of a
//    persistent grid, per position i and tag t one lane computes the rows of (i, t) from the rows
//    of i - 1 (T rows of K scores each, K = 1 for Viterbi) and writes backpointers (L, T, K),
//    then the final plus over last tags and the backtrace. The policies: ViterbiDecoder
//    (viterbi.cu, max-plus) and KbestDecoder (kbest.cu, k-max-plus).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace crfkit {
namespace cuda {

// ---- the per-sentence decoders (viterbi.cu, kbest.cu) ------------------------------------------
// Sentence index, length (0 when out of range: reported by check_inputs) and the
// warp's trip count, for the group's next sentence.
struct Sentence {
  int64_t b;
  bool exists;
  int64_t n;
  int64_t steps;
};

__device__ __forceinline__ Sentence next_sentence(int64_t first, int group, const int64_t* lengths, int64_t batch,
                                                  int64_t max_len) {
  Sentence s;
  s.b = first + group;
  s.exists = s.b < batch;
  s.n = s.exists ? lengths[s.b] : 0;
  if (s.n < 0 || s.n > max_len) s.n = 0;
  s.steps = warp_max(s.n);
  return s;
}

// A decoder group's sizes: T tags, G lanes (this one: lane), K scores per tag and position, L
// positions, and its slot in the persistent grid (its workspaces).
struct DecodeGroup {
  int T, G, lane;
  int64_t K, L, slot;
};

// The body of a per-sentence decoder kernel (p: DecodeParams, viterbi_common.cuh; shared_raw:
// the kernel's dynamic shared memory). Decoder, built on the group's arena once the transitions
// are staged, holds the two rows of scores (rows_a, rows_b) and supplies
//   list_length(p)                        K, the scores per tag and position
//   first(rows, t, value)                 position 0: tag t's row from start[t] + emit[0, t]
//   position(i)                           what the steps of position i share, computed once
//                                         before its tags' loop
//   step(cur, next, trans, at, t, emission)  tag t's row at i from the rows at i - 1 (at:
//                                         position(i)); emission() reads emit[i, t] (and
//                                         checks it) where the step's arithmetic needs it
//   finish(p, cur, sentence, bad, lane)   after the last position (every lane of the group; bad:
//                                         this lane saw bad emissions, reduced by finish):
//                                         the final plus over last tags, the outputs
template <typename Decoder, bool kAllShared, typename Params>
__device__ __forceinline__ void decode_sentences(const Params& p, unsigned char* shared_raw) {
  using scalar_t = typename Decoder::scalar_t;
  const int T = p.num_tags;
  const int G = p.plan.lanes;
  const int group = threadIdx.x / G;
  const int lane = threadIdx.x % G;
  const int64_t slot = (int64_t)blockIdx.x * p.plan.groups_per_block + group;
  const int64_t L = p.max_len;
  const int64_t K = Decoder::list_length(p);
  check_inputs(p.checks);

  unsigned char* cursor = shared_raw;
  unsigned char* const arena = group_arena<kAllShared>(cursor, p.plan, p.arena_bytes, p.arena_workspace, group, slot);
  const scalar_t* trans = stage_table<kAllShared>(cursor, p.plan.tables_in_shared, p.transitions, (int64_t)T * T);
  __syncthreads();  // the only block-wide barrier: the transitions are staged
  const Decoder decoder(p, arena, DecodeGroup{T, G, lane, K, L, slot});

  const int64_t grid_groups = (int64_t)gridDim.x * p.plan.groups_per_block;
  for (int64_t first = (int64_t)blockIdx.x * p.plan.groups_per_block; first < p.batch; first += grid_groups) {
    __syncwarp();  // the previous sentence (backtrace included) is finished by every lane
    const Sentence sentence = next_sentence(first, group, p.lengths, p.batch, L);
    const int64_t n = sentence.n;
    const scalar_t* emit = p.emissions + (sentence.exists ? sentence.b : 0) * L * T;
    bool bad = false;
    scalar_t* cur = decoder.rows_a;
    scalar_t* next = decoder.rows_b;
    if (n > 0) {
      for (int t = lane; t < T; t += G) {
        const scalar_t e = emit[t];
        bad |= is_nan_or_pos_inf(e);
        decoder.first(cur, t, p.start[t] + e);
      }
    }
    // The emission of the lane's first tag is loaded one position ahead (its latency then
    // overlaps a whole step); further tags are read when used; nothing beyond the sentence.
    scalar_t emit_ahead = lane < T && n > 1 ? emit[T + lane] : scalar_t(0);
    for (int64_t i = 1; i < sentence.steps; ++i) {
      __syncwarp();  // cur complete, and everyone is done reading next (the rows before cur)
      if (i < n) {
        const scalar_t* emit_i = emit + i * T;
        const scalar_t emit_first = emit_ahead;
        if (lane < T && i + 1 < n) emit_ahead = emit_i[T + lane];
        const auto at = decoder.position(i);
        for (int t = lane; t < T; t += G) {
          decoder.step(cur, next, trans, at, t, [&] {
            const scalar_t e = t == lane ? emit_first : emit_i[t];
            bad |= is_nan_or_pos_inf(e);
            return e;
          });
        }
        scalar_t* swap = cur;
        cur = next;
        next = swap;
      }
    }
    __syncwarp();  // the last rows and every backpointer are visible to the whole group
    decoder.finish(p, cur, sentence, bad, lane);
  }
}

namespace {

// ---- parallel in time (forward_backward_chunked.cuh, viterbi_chunked.cuh) ---------------------
// Positions of chunk c of a sentence of n positions: [c S, c S + chunk_length).
__device__ __forceinline__ int64_t chunk_length(int64_t n, int64_t c, int64_t S) {
  const int64_t rest = n - c * S;
  return rest <= 0 ? 0 : (rest < S ? rest : S);
}

// What one group of the chunk-parallel phases works on: sentence b (has: b < batch), chunk c,
// for phase 1 also row r (r fastest, then c); n = the sentence's length, len = the chunk's
// positions (0 for the rows r > 0 of chunk 0, which has one row). `id`: the group's index.
struct ChunkWork {
  int64_t b, c, r, n, len;
  bool has;
};

// The phase-1 group `id` (one per sentence, chunk and row) or, with rows = 1, the phase-3 group
// (one per sentence and chunk).
__device__ __forceinline__ ChunkWork chunk_work(int64_t id, int64_t rows, int64_t chunks, int64_t S, int64_t batch,
                                                const int64_t* lengths, int64_t max_len) {
  ChunkWork w;
  w.r = id % rows;
  w.c = id / rows % chunks;
  w.b = id / rows / chunks;
  w.has = w.b < batch;
  w.n = w.has ? safe_length(lengths, w.b, max_len) : 0;
  w.len = w.c == 0 && w.r > 0 ? 0 : chunk_length(w.n, w.c, S);
  return w;
}

// Phase 1's result for one lane.
template <typename scalar_t>
struct ChunkRow {
  scalar_t value;  // M_c[r][lane]
  double offset;   // the row's offset (log semiring: the row is stored normalised to max 0)
  bool bad;        // a NaN / +inf emission within the chunk
};

// Phase 1, one group per (sentence b, chunk c, row r), r fastest: row r of M_c into p.matrices
// (B, C, T, T), lane t its entry t. A warp's groups run the steps of its longest chunk. Chunks
// supplies
//   prologue(p)                            first thing of the kernel
//   row(p, w, steps, T, lane, own)         a ChunkRow: the entry of the lane's tag (the semiring's
//                                          forward recursion over the chunk from the one-hot row
//                                          r, or from start for chunk 0), its row's offset (log
//                                          semiring) and whether the lane saw bad emissions
//   store(p, w, T, lane, own, a, bad, report)  the lane's entry of row (b, c, r) into
//                                          p.matrices (the log semiring: the row's offset too);
//                                          report() on lane 0 of row 0 where the group saw bad
//                                          emissions (every row reads the whole chunk)
//   bad_count(p)                           (B,) int: incremented where bad emissions were seen
template <typename Chunks, int kLanes, typename Params>
__device__ __forceinline__ void chunk_transfer_rows(const Params& p) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  const int T = p.num_tags;
  const int lane = threadIdx.x % kLanes;
  const bool own = lane < T;
  Chunks::prologue(p);
  const ChunkWork w = chunk_work((int64_t)blockIdx.x * kGroupsPerBlock + threadIdx.x / kLanes, T, p.chunks, p.chunk,
                                 p.batch, p.lengths, p.max_len);
  const int64_t steps = warp_max(w.len);
  if (steps == 0) return;  // warp-uniform

  const auto a = Chunks::template row<kLanes>(p, w, steps, T, lane, own);
  const bool bad = group_max(static_cast<int>(a.bad), kLanes) != 0;
  if (w.len > 0) {
    Chunks::store(p, w, T, lane, own, a, bad, [&] {
      report(p.status, kBadEmissions, w.b);
      atomicAdd(Chunks::bad_count(p) + w.b, 1);
    });
  }
}

// The group of phase 2: one per sentence b, lane t owning tag t; its sentence's chunks
// (num_chunks of the C per sentence) and the warp's trip count over them (chunk_steps).
struct ScanGroup {
  int T, lane;
  bool own, has;
  int64_t b, n, C, num_chunks, chunk_steps, bs;  // bs: b, or 0 for groups beyond the batch
};

template <int kLanes, typename Params>
__device__ __forceinline__ ScanGroup scan_group(const Params& p) {
  constexpr int kGroupsPerBlock = kMaxThreadsPerBlock / kLanes;
  ScanGroup g;
  g.T = p.num_tags;
  g.lane = threadIdx.x % kLanes;
  g.own = g.lane < g.T;
  g.b = (int64_t)blockIdx.x * kGroupsPerBlock + threadIdx.x / kLanes;
  g.has = g.b < p.batch;
  g.n = g.has ? safe_length(p.lengths, g.b, p.max_len) : 0;
  g.C = p.chunks;
  g.num_chunks = (g.n + p.chunk - 1) / p.chunk;
  g.chunk_steps = warp_max(g.num_chunks);
  g.bs = g.has ? g.b : 0;
  return g;
}

// Phase 2's forward scan: v at chunk 0's end (the caller's state), then for c = 1 ..
// num_chunks - 1: v at chunk c - 1's last position into boundary() (B, C, T) (where kWrite),
// then step(c, active): v <- v times M_c, one vector-matrix product under the semiring (active:
// c < num_chunks, else it runs for the warp's shuffles only and keeps v). value() is the lane's
// entry of v. Callables over the kernel's own state, so that each kernel keeps its order of
// loads (SASS identical to the loop written out).
template <bool kWrite, typename Boundary, typename Value, typename Step>
__device__ __forceinline__ void scan_chunk_boundaries(const ScanGroup& g, Boundary&& boundary, Value&& value,
                                                      Step&& step) {
  for (int64_t c = 1; c < g.chunk_steps; ++c) {
    const bool active = c < g.num_chunks;
    if (kWrite && active && g.own) boundary()[(g.bs * g.C + c) * g.T + g.lane] = value();
    step(c, active);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
