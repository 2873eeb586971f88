// Viterbi with several sentences per SIMD vector ("batch lanes"): lane j of every vector belongs
// to sentence j of a group of Lanes<scalar_t>::kCount sentences (16 floats or 8 doubles).
//
// Why: the recursion delta_i = maxplus(delta_{i-1}, trans) + emit_i is sequential in i. With one
// sentence per call and the tags in lanes (viterbi_sentence in viterbi.cpp), each position is a
// chain of T dependent compare-and-select steps over only ceil(T / kCount) vectors, so at small T
// the kernel waits on latency and most lanes are idle (T = 9 fills 9 of 16). With sentences in
// lanes, a position is T * T independent max-plus updates, each on kCount sentences at once:
// every lane does useful work and the updates of several tags are interleaved in registers.
//
// The arithmetic is that of viterbi_sentence, lane by lane, so the results are bit-identical:
//     delta_0[t] = start[t] + emit[0, t]
//     delta_i[t] = max_s (delta_{i-1}[s] + trans[s, t]) + emit[i, t]   (first s wins a tie)
//     score      = max_t (delta_{n-1}[t] + end[t])                     (first t wins a tie)
// in scalar_t, with strict `>` while scanning s (and t) upward.
#pragma once

#include "../tensor.h"


#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "lanes.h"
#include "log_space.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// How many tags one register block updates at once: each tag needs two vector registers (running
// max and arg max) for the whole loop over predecessors. AVX-512 has 32 of them (one per
// Vector): blocks of 8, 12 and 14 measured the same (the loop is bound by vector throughput once
// 8 chains interleave), and 8 leaves registers to spare. AVX2 has 16 (one per Vector): blocks
// of 4 measured best of 3, 4 and 6 (6 runs out of registers). SSE / NEON: 1, sized when a
// Vector took 4 registers there, not re-measured. benchmarks/results/NOTES.md has the timings.
#if defined(__AVX512F__)
inline constexpr int kLaneTagBlock = 8;
#elif defined(__AVX__)
inline constexpr int kLaneTagBlock = 4;
#else
inline constexpr int kLaneTagBlock = 1;
#endif

template <typename scalar_t, typename bp_t>
struct LaneTypes {
  using Vector = typename Lanes<scalar_t>::Vector;  // kCount scalars, one per sentence
  using Mask = typename Lanes<scalar_t>::Mask;      // kCount int32 / int64: comparisons, indices
  using Index = typename Lanes<scalar_t>::Index;
  static constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  // kCount backpointers, one per sentence (16 or 8 bytes for uint8_t)
  typedef bp_t Backpointers __attribute__((vector_size(kCount * sizeof(bp_t))));
};

// The codes of a Mask (kCount lane values, each in the range of bp_t, never negative) as
// Backpointers. Without AVX-512, GCC 12 lowers __builtin_convertvector from 32- or 64-bit lanes
// to narrower ones lane by lane (an extract, a zero-extension, a shift and an or per lane: a
// hot spot of the k-best lane decoder in perf, benchmarks/results/NOTES.md); on AVX2 two or
// three packs do it (they saturate: exact for codes in range).
template <typename Backpointers, typename Mask>
inline Backpointers narrow_codes(Mask m) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  static_assert(sizeof(Mask) == 32, "AVX2 lanes are 32-byte vectors");
  constexpr size_t kCodes = sizeof(Mask) / sizeof(m[0]);
  constexpr size_t kCodeBytes = sizeof(Backpointers) / kCodes;
  if constexpr (kCodeBytes == 1 || kCodeBytes == 2) {
    __m256i v;
    std::memcpy(&v, &m, sizeof v);
    if constexpr (kCodes == 4) {  // int64 lanes: their low halves first (values fit 32 bits)
      v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    }
    __m128i narrow = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    if constexpr (kCodeBytes == 1) narrow = _mm_packus_epi16(narrow, narrow);
    Backpointers b;
    std::memcpy(&b, &narrow, sizeof b);
    return b;
  }
#endif
  return __builtin_convertvector(m, Backpointers);
}

// One position's update of the tags [t0, t0 + R) for all sentences of a group:
//     delta_next[t] = max_s (delta[s] + trans[s, t]) + emit[t]
//     backpointers[t] = the first s that reaches the max
// delta, emit, delta_next: T vectors; trans: (T, T) row-major; backpointers: T vectors.
// The R running maxima and arg maxima stay in registers for the whole loop over s; each s loads
// one delta vector and broadcasts R scalars of trans row s.
template <typename scalar_t, typename bp_t, int R>
inline void lane_step_block(const typename LaneTypes<scalar_t, bp_t>::Vector* __restrict__ delta,
                            const scalar_t* __restrict__ trans, int64_t T, int64_t t0,
                            const typename LaneTypes<scalar_t, bp_t>::Vector* __restrict__ emit,
                            typename LaneTypes<scalar_t, bp_t>::Vector* __restrict__ delta_next,
                            typename LaneTypes<scalar_t, bp_t>::Backpointers* __restrict__ backpointers) {
  using Types = LaneTypes<scalar_t, bp_t>;
  using Vector = typename Types::Vector;
  using Mask = typename Types::Mask;
  Vector best[R];
  Mask arg[R];
  const scalar_t* trans_row = trans + t0;  // trans[s, t0 ..]
  for (int r = 0; r < R; ++r) {
    best[r] = delta[0] + trans_row[r];
    arg[r] = Mask{};
  }
  Mask s_lanes = Mask{};  // s in every lane, kept in a vector register (a broadcast from a
                         // general register per update would compete for the vector ports)
  for (int64_t s = 1; s < T; ++s) {
    trans_row += T;
    const Vector delta_s = delta[s];
    s_lanes += 1;
    for (int r = 0; r < R; ++r) {
      const Vector cand = delta_s + trans_row[r];
      const Mask better = cand > best[r];  // strict: the smaller predecessor wins a tie
      best[r] = better ? cand : best[r];
      arg[r] = better ? s_lanes : arg[r];
    }
  }
  for (int r = 0; r < R; ++r) {
    delta_next[t0 + r] = best[r] + emit[t0 + r];
    backpointers[t0 + r] = narrow_codes<typename Types::Backpointers>(arg[r]);
  }
}

// lane_step_block with R = size chosen at run time (1 <= size <= kLaneTagBlock).
template <typename scalar_t, typename bp_t, int R = kLaneTagBlock>
inline void lane_step_block_of_size(int size, const typename LaneTypes<scalar_t, bp_t>::Vector* delta,
                                    const scalar_t* trans, int64_t T, int64_t t0,
                                    const typename LaneTypes<scalar_t, bp_t>::Vector* emit,
                                    typename LaneTypes<scalar_t, bp_t>::Vector* delta_next,
                                    typename LaneTypes<scalar_t, bp_t>::Backpointers* backpointers) {
  if constexpr (R >= 1) {
    if (size == R) {
      lane_step_block<scalar_t, bp_t, R>(delta, trans, T, t0, emit, delta_next, backpointers);
    } else {
      lane_step_block_of_size<scalar_t, bp_t, R - 1>(size, delta, trans, T, t0, emit, delta_next,
                                                     backpointers);
    }
  }
}

// The tags cut into blocks of at most max_size (kLaneTagBlock), as even as possible (37 -> 8, 8, 7, 7, 7), so
// no block is left with too few independent chains to hide the compare-and-select latency.
struct TagBlock {
  int64_t first;
  int size;
};

inline std::vector<TagBlock> lane_tag_blocks(int64_t T, int64_t max_size = kLaneTagBlock) {
  const int64_t count = (T + max_size - 1) / max_size;
  std::vector<TagBlock> blocks;
  for (int64_t k = 0, first = 0; k < count; ++k) {
    const int size = static_cast<int>(T / count + (k < T % count ? 1 : 0));
    blocks.push_back({first, size});
    first += size;
  }
  return blocks;
}

// A group's emissions in lane layout, emit[i * T + t][j] = emissions[sentence[j], i, t] for
// i < length[j], and 0 past a lane's length (and in idle lanes), so the padding never makes NaN
// or +inf; and n[j] (kCount entries), the positions lane j decodes: length[j], or 0 for an idle
// lane and for a sentence whose real positions hold NaN or +inf (flagged in bad_sentence, left
// idle). Returns the longest n[j]. Both lane decoders (Viterbi, k-best) start with this.
template <typename scalar_t>
int64_t group_emissions_to_lanes(const scalar_t* emissions, int64_t L, int64_t T, const int64_t* sentence,
                                 const int64_t* length, int64_t count, typename Lanes<scalar_t>::Vector* emit,
                                 int64_t* n, std::vector<char>& bad_sentence) {
  constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  const scalar_t* source[kCount] = {};
  int64_t limit[kCount] = {};
  for (int64_t j = 0; j < count; ++j) {
    source[j] = emissions + sentence[j] * L * T;
    limit[j] = length[j] * T;
  }
  const typename Lanes<scalar_t>::Mask bad = emissions_to_lanes<scalar_t>(source, limit, emit);
  std::fill(n, n + kCount, int64_t{0});
  for (int64_t j = 0; j < count; ++j) {
    if (bad[j]) {
      bad_sentence[sentence[j]] = 1;
    } else {
      n[j] = length[j];
    }
  }
  return *std::max_element(n, n + kCount);
}

// The per-thread buffers of the lane decoder, for sentences of up to max_length positions (left
// uninitialised: every element is written before it is read).
template <typename scalar_t, typename bp_t>
struct LaneWork {
  using Vector = typename LaneTypes<scalar_t, bp_t>::Vector;
  using Backpointers = typename LaneTypes<scalar_t, bp_t>::Backpointers;
  std::unique_ptr<Vector[]> emit;                // (max_length, T) vectors (+ padding to a block)
  std::unique_ptr<Vector[]> delta, delta_next;   // (T,) vectors
  std::unique_ptr<Vector[]> final_delta;         // (T,) delta at each lane's last position
  std::unique_ptr<Backpointers[]> backpointers;  // (max_length, T) vectors of kCount bp_t
  LaneWork(int64_t max_length, int64_t T)
      : emit(new Vector[padded_to_lanes<scalar_t>(max_length * T)]), delta(new Vector[T]),
        delta_next(new Vector[T]), final_delta(new Vector[T]),
        backpointers(new Backpointers[max_length * T]) {}
};

// Viterbi for one group of up to kCount sentences: lane j is sentence sentence[j], of length
// length[j] (1 <= length[j] <= L, non-increasing in j); lanes j >= count are idle. Writes
// score[b] and path[b * L + i] for each sentence b of the group, as viterbi_sentence does. A
// sentence whose real positions hold NaN or +inf is flagged in bad_sentence and left idle.
template <typename scalar_t, typename bp_t>
void viterbi_lane_group(const scalar_t* emissions, const scalar_t* trans, const scalar_t* start,
                        const scalar_t* end, int64_t L, int64_t T, const int64_t* sentence,
                        const int64_t* length, int64_t count, const std::vector<TagBlock>& blocks,
                        LaneWork<scalar_t, bp_t>& work, int64_t* path, scalar_t* score,
                        std::vector<char>& bad_sentence) {
  using Types = LaneTypes<scalar_t, bp_t>;
  using Vector = typename Types::Vector;
  using Mask = typename Types::Mask;
  using Index = typename Types::Index;
  constexpr int64_t kCount = Types::kCount;

  Vector* emit = work.emit.get();  // (length[0], T) vectors
  int64_t n[kCount];
  const int64_t n_max = group_emissions_to_lanes<scalar_t>(emissions, L, T, sentence, length, count, emit,
                                                           n, bad_sentence);
  if (n_max == 0) return;

  // last[j] = n[j] - 1: the position whose delta is lane j's final one (-1 in idle lanes).
  Mask last;
  for (int64_t j = 0; j < kCount; ++j) last[j] = static_cast<Index>(n[j] - 1);

  Vector* delta = work.delta.get();            // (T,) vectors: delta at position i - 1
  Vector* delta_next = work.delta_next.get();  // (T,) vectors: delta at position i
  Vector* final_delta = work.final_delta.get();
  typename Types::Backpointers* backpointers = work.backpointers.get();  // [i * T + t]
  for (int64_t t = 0; t < T; ++t) {
    delta[t] = start[t] + emit[t];
    final_delta[t] = delta[t];  // final for lanes of length 1; the others overwrite it below
  }
  for (int64_t i = 1; i < n_max; ++i) {
    for (const TagBlock& block : blocks) {
      lane_step_block_of_size<scalar_t, bp_t>(block.size, delta, trans, T, block.first,
                                              emit + i * T, delta_next, backpointers + i * T);
    }
    std::swap(delta, delta_next);
    const Mask ends_here = last == static_cast<Index>(i);
    for (int64_t t = 0; t < T; ++t) final_delta[t] = ends_here ? delta[t] : final_delta[t];
  }

  // Best last tag per lane: the first t with the largest final_delta[t] + end[t].
  Vector best = final_delta[0] + end[0];
  Mask best_tag = Mask{};
  for (int64_t t = 1; t < T; ++t) {
    const Vector cand = final_delta[t] + end[t];
    const Mask better = cand > best;
    best = better ? cand : best;
    best_tag = better ? (Mask{} + static_cast<Index>(t)) : best_tag;
  }

  // Backtrace, all lanes of the group side by side (independent chains of dependent loads, so
  // the CPU overlaps them). A lane joins at its last position; a lane whose best score is -inf
  // (every sequence forbidden) keeps its path at -1.
  int64_t tag[kCount];
  bool traced[kCount];
  for (int64_t j = 0; j < count; ++j) {
    traced[j] = n[j] > 0 && best[j] != neg_inf<scalar_t>();
    tag[j] = best_tag[j];
    if (n[j] > 0) score[sentence[j]] = best[j];
  }
  for (int64_t i = n_max - 1; i >= 0; --i) {
    for (int64_t j = 0; j < count; ++j) {
      if (!traced[j] || i >= n[j]) continue;
      path[sentence[j] * L + i] = tag[j];
      if (i > 0) tag[j] = backpointers[i * T + tag[j]][j];
    }
  }
}

// ---- the batch -----------------------------------------------------------------------------------
// Which sentences go together, and whether the lane decoder beats the per-sentence kernel here.
struct LanePlan {
  std::vector<int64_t> order;    // the sentences of length >= 1, longest first (stable)
  std::vector<int64_t> lengths;  // their lengths, in that order
  int64_t num_groups = 0;        // groups of kCount consecutive sentences of `order`
  bool use_lanes = false;
};

// The cost of one position of a lane group, in positions of one sentence of the per-sentence
// kernel (viterbi_sentence), fitted to measurements (benchmarks/results/NOTES.md has the
// tables). With AVX-512: about 1 + T / 8 while the per-sentence kernel holds its tags in
// registers (up to 8 vectors: 128 floats, 64 doubles), 3 past that. (The values past 8 vectors
// were measured while the per-sentence kernel looped over memory there; it has since kept
// blocks of 8 vectors in registers at any T, viterbi_common.h for_each_register_block, and they were
// not re-measured, so there lanes may now be chosen where they lose.) (A lane group does T * T
// max-plus updates of kCount sentences per position; the per-sentence kernel T * ceil(T /
// kCount) of one sentence, but as chains of dependent steps.)
template <typename scalar_t>
double lane_group_cost(int64_t T) {
#if defined(__AVX512F__)
  constexpr int64_t kPerSentenceMaxTags = 8 * Lanes<scalar_t>::kCount;
  return T <= kPerSentenceMaxTags ? 1.0 + T / 8.0 : 3.0;
#else
  // AVX2 (8 floats, 4 doubles per vector): a group measured at less than its kCount sentences
  // at every T, without a trend in T that stands out of the noise (benchmarks/results/NOTES.md):
  // modelled as 3/4 of them, so that lanes are chosen where groups are mostly full and the
  // threads stay busy. (Measured with tag blocks of 3; kLaneTagBlock's 4 made the lanes faster
  // still, so the model is conservative.)
  (void)T;
  return 0.75 * static_cast<double>(Lanes<scalar_t>::kCount);
#endif
}

// The cost models hold for AVX-512 and AVX2 builds (measured on both). Elsewhere (SSE, NEON)
// the lane decoders have not been measured with register-sized vectors (lanes.h), so the
// per-sentence kernel stays the default there (benchmarks/results/NOTES.md).
#if defined(__AVX512F__) || defined(__AVX2__)
inline constexpr bool kLaneCostModelHolds = true;
#else
inline constexpr bool kLaneCostModelHolds = false;
#endif

// The lane buffers of one thread are limited to this (they are kCount times the per-sentence
// kernel's backpointers, plus a copy of a group's emissions); beyond it, the per-sentence kernel.
inline constexpr int64_t kLaneMaxBufferBytes = int64_t{256} << 20;

// CRFKIT_VITERBI_LANES=1 forces the lane decoders of both Viterbi (this file) and k-best Viterbi
// (kbest_lanes.h), where they can run (see plan_lanes); =0 forces the per-sentence kernels of
// both. Tests compare the two on the same inputs, benchmarks time both with one build. Unset or
// empty: the cost models decide.
inline int forced_viterbi_lanes() { return forced_by_environment("CRFKIT_VITERBI_LANES"); }

// Sorts the sentences by length and decides, for a lane decoder whose per-thread buffers take
// buffer_bytes_per_position bytes per position of the longest sentence, and one position of a
// lane group costs group_cost positions of one sentence in the per-sentence kernel. The
// estimated times, in sentence-positions, with P threads: the per-sentence kernel
// max(sum of lengths / P, longest); the lane decoder
// group_cost * max(sum over groups of the group's longest / P, longest), since a group runs to
// its longest sentence and the groups are shared out longest first.
template <typename scalar_t>
LanePlan plan_lanes(const int64_t* lengths, int64_t B, int64_t L, int64_t buffer_bytes_per_position,
                    double group_cost) {
  constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  LanePlan plan;
  plan.order = longest_first(lengths, B, 1);
  for (const int64_t b : plan.order) plan.lengths.push_back(lengths[b]);
  const int64_t num_sentences = static_cast<int64_t>(plan.order.size());
  plan.num_groups = (num_sentences + kCount - 1) / kCount;

  const int64_t longest = num_sentences > 0 ? plan.lengths[0] : 0;
  if (L > std::numeric_limits<int32_t>::max() ||
      longest > kLaneMaxBufferBytes / std::max<int64_t>(buffer_bytes_per_position, 1)) {
    return plan;  // lengths are compared in int32 lanes (float); the buffers would be too large
  }
  const int forced = forced_viterbi_lanes();
  if (forced >= 0) {
    plan.use_lanes = forced == 1;
    return plan;
  }
  if constexpr (!kLaneCostModelHolds) return plan;
  const double threads = in_parallel_region() ? 1.0 : static_cast<double>(num_threads());
  double sentence_positions = 0, group_positions = 0;
  for (int64_t k = 0; k < num_sentences; ++k) {
    sentence_positions += static_cast<double>(plan.lengths[k]);
    if (k % kCount == 0) group_positions += static_cast<double>(plan.lengths[k]);
  }
  const double per_sentence_time = std::max(sentence_positions / threads, double(longest));
  const double lanes_time = group_cost * std::max(group_positions / threads, double(longest));
  plan.use_lanes = lanes_time < per_sentence_time;
  return plan;
}

template <typename scalar_t, typename bp_t>
LanePlan plan_viterbi_lanes(const int64_t* lengths, int64_t B, int64_t L, int64_t T) {
  const int64_t bytes_per_position =
      T * (static_cast<int64_t>(sizeof(scalar_t)) + static_cast<int64_t>(sizeof(bp_t))) * Lanes<scalar_t>::kCount;
  return plan_lanes<scalar_t>(lengths, B, L, bytes_per_position, lane_group_cost<scalar_t>(T));
}

// Runs decode_group(work, first, count) for every group of the plan (the sentences
// plan.order[first .. first + count)), from the work queue of for_each_group (lanes.h), each
// thread with its own work space make_work().
template <typename scalar_t, typename MakeWork, typename DecodeGroup>
void for_each_lane_group(const LanePlan& plan, MakeWork&& make_work, DecodeGroup&& decode_group) {
  constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  const int64_t num_sentences = static_cast<int64_t>(plan.order.size());
  for_each_group(plan.num_groups, make_work, [&](auto& work, int64_t g) {
    const int64_t first = g * kCount;
    decode_group(work, first, std::min(kCount, num_sentences - first));
  });
}

// Viterbi for the batch with the lane decoder, as planned: scores (B,), paths (B, L) pre-filled
// with -1. Sentences whose real positions hold NaN or +inf emissions are flagged in bad_sentence
// (the caller raises); length-0 sentences score 0.
template <typename scalar_t, typename bp_t>
void viterbi_lanes(const LanePlan& plan, const scalar_t* emissions, const scalar_t* trans,
                   const int64_t* lengths, const scalar_t* start, const scalar_t* end, int64_t B,
                   int64_t L, int64_t T, int64_t* path, scalar_t* score,
                   std::vector<char>& bad_sentence) {
  for (int64_t b = 0; b < B; ++b) {
    if (lengths[b] == 0) score[b] = 0;  // the empty sequence
  }
  const std::vector<TagBlock> blocks = lane_tag_blocks(T);
  for_each_lane_group<scalar_t>(
      plan, [&] { return LaneWork<scalar_t, bp_t>(plan.lengths[0], T); },
      [&](LaneWork<scalar_t, bp_t>& work, int64_t first, int64_t count) {
        viterbi_lane_group<scalar_t, bp_t>(emissions, trans, start, end, L, T, &plan.order[first],
                                           &plan.lengths[first], count, blocks, work, path, score,
                                           bad_sentence);
      });
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
