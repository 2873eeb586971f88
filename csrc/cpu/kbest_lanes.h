// Exact k-best Viterbi with several sentences per SIMD vector ("batch lanes"), as viterbi_lanes.h
// does for Viterbi: lane j of every vector belongs to sentence j of a group of
// Lanes<scalar_t>::kCount sentences (16 floats or 8 doubles), sorted longest first.
//
// Why: the per-sentence kernel (kbest_step in kbest.cpp) puts the tags in lanes, so at small T
// most lanes are idle (T = 9 fills 9 of 16), and each of its K merge rounds ends in a scalar
// loop over the tags. Here every lane is a sentence, so all lanes work at any T.
//
// The algorithm and the arithmetic are those of kbest_step / merge_top_k, lane by lane, so paths
// and scores are bit-identical (ties included). For each position i >= 1 and target tag t, the
// K best of the T sorted lists lists[s][0 .. K) (list s offset by trans[s, t]) are merged in K
// rounds; a round is an argmax over the lists' current heads
//     head[s] = lists[s][rank[s]] + trans[s, t]
// with strict `>` over s upward (the smaller predecessor wins a tie; within a list the earlier
// rank comes first), then
//     next[t][round] = best + emit[i, t],   backpointer = (s, rank[s]) of the head taken,
// and the list it came from advances: rank[s] += 1 and its new head is fetched. In lanes the
// taken list differs from lane to lane, so its new head is a gather from the lists, which are
// stored [s][r][lane] (one gather per round after the first, a large share of the time at small
// T: benchmarks/results/NOTES.md). Up to kNextAheadMaxTags tags the entry after each head is
// kept at hand, so that gather runs one round ahead, off the chain from one round's argmax to
// the next. The final choice over last tags is the same merge with offsets end[s] instead of
// trans[s, t].
//
// Layout details that keep the round branch-free and its gather in bounds:
// - Each list has K + 1 slots; slot K is a -inf sentinel, so a list that has given all K of its
//   entries yields -inf heads (as the per-sentence kernel's `rank + 1 < K ? ... : -inf`).
//   A merge advances one list per lane after each of its first K - 1 rounds, so no rank passes
//   K - 1 and a gather reads at most slot K of the list it advances, whatever the values (even
//   NaN in a lane being discarded): never outside the lists.
// - A head is tracked by its slot address in the lists, idx = (s * (K + 1) + rank) * kCount + j
//   (j the lane), so the argmax carries one integer per head, the gather reads lists at idx +
//   kCount, and the list taken in a lane is the s with idx[s] == the winning idx (addresses of
//   different lists never coincide). The backpointer is the slot code s * (K + 1) + rank =
//   idx / kCount, and the backtrace stores its backpointers with K + 1 slots per tag too, so a
//   code is directly the offset of the predecessor's backpointer.
// - When only -inf is left in a lane, the round still "takes" a list there (the first one); its
//   next heads are -inf as well (a list whose head is -inf is exhausted, or trans[s, t] = -inf),
//   so that lane only produces -inf entries, as the per-sentence kernel's early stop does. The
//   backpointers written for -inf entries are never followed.
// Lanes whose sentence has ended keep their lists (a blend on the active lanes), so the final
// merge runs once per group, after the longest sentence.
// From T = 9 to 16 (with T a template argument), most merges are pruned as the per-sentence
// kernel prunes them: only the lists that can still reach a tag's K best take part
// (merge_lanes_pruned: a two-way merge where, in every lane, at most two lists can).

#pragma once


#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../backpointers.h"
#include "isa.h"
#include "lanes.h"
#include "log_space.h"
#include "viterbi_lanes.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// v[j] = base[index[j]] for every lane j (index in elements of scalar_t). (The masked form with
// every lane on: GCC 12's unmasked one warns of an uninitialised source.)
template <typename scalar_t>
inline typename Lanes<scalar_t>::Vector gather_lanes(const scalar_t* base,
                                                      typename Lanes<scalar_t>::Mask index) {
  typename Lanes<scalar_t>::Vector v;
#if defined(__AVX512F__)
  __m512i i;
  std::memcpy(&i, &index, sizeof i);
  if constexpr (sizeof(scalar_t) == 4) {
    const __m512 g = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xFFFF, i, base, 4);
    std::memcpy(&v, &g, sizeof v);
  } else {
    const __m512d g = _mm512_mask_i64gather_pd(_mm512_setzero_pd(), 0xFF, i, base, 8);
    std::memcpy(&v, &g, sizeof v);
  }
#else
  for (int64_t j = 0; j < Lanes<scalar_t>::kCount; ++j) v[j] = base[index[j]];
#endif
  return v;
}

template <typename scalar_t>
inline constexpr int kLaneShift = std::countr_zero(static_cast<uint64_t>(Lanes<scalar_t>::kCount));  // log2(kCount)

// Up to this many tags (with T a template argument) merge_lanes keeps each list's next entry
// in registers beside its head (kNextAhead), which takes the gather out of the dependency chain
// from one round to the next at the cost of T more registers and T blends per round. Measured
// against the gather in the chain: it gains in float up to T = 10, nothing at T = 12, and the
// spills make it slower at T = 16 (benchmarks/results/NOTES.md).
inline constexpr int kNextAheadMaxTags = 10;

// The first maximum over s < kT of value[s] (strict `>`: the smaller s wins a tie), per lane, as
// a tree: combining [s, s + w) with [s + w, s + 2w) keeps the left one on a tie, so the result
// is that of the sequential scan, with a dependency chain of log2(kT) steps instead of kT - 1.
// Leaves the maximum in value[0] and, selected with it, address[0] and carried[0] (kCarried);
// the other entries are overwritten. (One level per instantiation, W = w, so that every loop
// has a constant trip count and unrolls: the state stays in registers.)
template <int kT, bool kCarried, int W = 1, typename Vector, typename Mask>
__attribute__((always_inline)) inline void first_max_tree(Vector* value, Mask* address,
                                                          Vector* carried) {
  if constexpr (W < kT) {
#pragma GCC unroll 16
    for (int64_t s = 0; s + W < kT; s += 2 * W) {
      const Mask better = value[s + W] > value[s];
      value[s] = better ? value[s + W] : value[s];
      address[s] = better ? address[s + W] : address[s];
      if constexpr (kCarried) carried[s] = better ? carried[s + W] : carried[s];
    }
    first_max_tree<kT, kCarried, 2 * W>(value, address, carried);
  }
}

// The address of list s's first slot in every lane: lane j's is s * list_stride + j (the slot
// addresses of the layout notes above; list_stride = (K + 1) * kCount scalars per list).
// (The lane numbers as a constant vector plus one broadcast: filling the lanes one by one from
// s * list_stride, which is not a constant, compiled to an insert per lane.)
template <typename scalar_t>
inline typename Lanes<scalar_t>::Mask first_slot_address(int64_t s,
                                                         typename Lanes<scalar_t>::Index list_stride) {
  using Index = typename Lanes<scalar_t>::Index;
  typename Lanes<scalar_t>::Mask lane_number;
  for (int64_t j = 0; j < Lanes<scalar_t>::kCount; ++j) lane_number[j] = static_cast<Index>(j);
  return lane_number + static_cast<Index>(s) * list_stride;
}

// M merges of the same T sorted lists into their K best, side by side, for all lanes: list s is
// lists[s * (K + 1) + r] (vectors, descending in r, slot K = -inf); in merge m it is offset by
// offset(m, s) (a scalar, the same in every lane). Calls out(m, r, best, code) for r = 0 .. K-1
// with merge m's r-th best value per lane and its slot code s * (K + 1) + rank per lane.
// Why M at once: a round's argmax, gather and update form one dependency chain (the next round
// needs the refilled head); the M merges' chains are independent, so the CPU overlaps them
// (see kMergeBlock for when that pays).
// kT > 0: T is known at compile time and the heads and their addresses are local arrays, mostly
// in registers; kT = 0: T = num_tags, and they live in head_memory / address_memory (M * T
// vectors each).
template <typename scalar_t, int kT, int M, typename Offset, typename Out>
inline void merge_lanes(const typename Lanes<scalar_t>::Vector* __restrict__ lists, int64_t num_tags,
                        int64_t K, Offset&& offset, typename Lanes<scalar_t>::Vector* head_memory,
                        typename Lanes<scalar_t>::Mask* address_memory, Out&& out) {
  using Vector = typename Lanes<scalar_t>::Vector;
  using Mask = typename Lanes<scalar_t>::Mask;
  using Index = typename Lanes<scalar_t>::Index;
  constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  const int64_t T = kT > 0 ? kT : num_tags;
  constexpr bool kNextAhead = kT > 0 && kT <= kNextAheadMaxTags;
  Vector head_registers[kT > 0 ? M * kT : 1];
  Vector next[kNextAhead ? M * kT : 1];  // [m * T + s]: the entry after the head (kNextAhead)
  Mask address_registers[kT > 0 ? M * kT : 1];
  Vector* head = kT > 0 ? head_registers : head_memory;  // [m * T + s]
  Mask* address = kT > 0 ? address_registers : address_memory;
  const scalar_t* list_scalars = reinterpret_cast<const scalar_t*>(lists);

  const Index list_stride = static_cast<Index>((K + 1) * kCount);  // scalars per list
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 16
    for (int64_t s = 0; s < T; ++s) {
      head[m * T + s] = lists[s * (K + 1)] + offset(m, s);
      if constexpr (kNextAhead) next[m * T + s] = lists[s * (K + 1) + 1];
      address[m * T + s] = first_slot_address<scalar_t>(s, list_stride);
    }
  }
  for (int64_t r = 0; r < K; ++r) {
    Vector best[M];
    Mask arg[M];
    for (int m = 0; m < M; ++m) {
      const Vector* h = head + m * T;
      const Mask* a = address + m * T;
      if constexpr (kT > 0) {
        Vector best_tree[kT];
        Mask arg_tree[kT];
#pragma GCC unroll 16
        for (int64_t s = 0; s < T; ++s) {
          best_tree[s] = h[s];
          arg_tree[s] = a[s];
        }
        first_max_tree<kT, false>(best_tree, arg_tree, static_cast<Vector*>(nullptr));
        best[m] = best_tree[0];
        arg[m] = arg_tree[0];
      } else {
        best[m] = h[0];
        arg[m] = a[0];
        for (int64_t s = 1; s < T; ++s) {
          const Mask better = h[s] > best[m];  // strict: the smaller s wins a tie
          best[m] = better ? h[s] : best[m];
          arg[m] = better ? a[s] : arg[m];
        }
      }
    }
    for (int m = 0; m < M; ++m) out(m, r, best[m], arg[m] >> kLaneShift<scalar_t>);
    if (r + 1 == K) break;
    // Advance the list taken in each lane: its head becomes its next entry (slot rank + 1; the
    // sentinel after the last) plus its offset.
    for (int m = 0; m < M; ++m) {
      Vector* h = head + m * T;
      Mask* a = address + m * T;
      if constexpr (kNextAhead) {
        // The next entry is at hand in `next`, and the one after it (slot rank + 2) is gathered
        // for the following advance: the next round's argmax does not wait for the gather.
        // Only the advances after rounds r <= K - 3 are followed by another one, so the
        // gathers read at most slot K - 1. (This loop is the `advance` below plus the refill
        // of `next`, written out: sharing that lambda, with the refill as a callback, measured
        // slower with GCC 12; benchmarks/results/NOTES.md.)
        Vector* nx = next + m * T;
        const bool refill = r + 2 < K;
        const Vector gathered = refill ? gather_lanes<scalar_t>(list_scalars, arg[m] + static_cast<Index>(2 * kCount))
                                       : Vector{};
#pragma GCC unroll 16
        for (int64_t s = 0; s < T; ++s) {
          const Mask taken = a[s] == arg[m];
          h[s] = taken ? nx[s] + offset(m, s) : h[s];
          if (refill) nx[s] = taken ? gathered : nx[s];
          a[s] = taken ? a[s] + static_cast<Index>(kCount) : a[s];
        }
      } else {
        // In round 0 every list is at rank 0, so the entry is slot 1 of each list, a plain
        // load; later rounds gather it per lane.
        auto advance = [&](auto&& next_entry) {
#pragma GCC unroll 16
          for (int64_t s = 0; s < T; ++s) {
            const Mask taken = a[s] == arg[m];
            h[s] = taken ? next_entry(s) + offset(m, s) : h[s];
            a[s] = taken ? a[s] + static_cast<Index>(kCount) : a[s];
          }
        };
        if (r == 0) {
          advance([&](int64_t s) { return lists[s * (K + 1) + 1]; });
        } else {
          const Vector gathered = gather_lanes<scalar_t>(list_scalars, arg[m] + static_cast<Index>(kCount));
          advance([&](int64_t) { return gathered; });
        }
      }
    }
  }
}

// From this many tags (with T a template argument) kbest_lane_group runs merge_lanes_pruned.
// Measured against merge_lanes alone: with AVX2's 8 lanes it gains from T = 9 on (at K = 5 only
// from T = 12; at T = 9 within the noise) and loses below; with AVX-512's 16 lanes (a group has
// twice as many lanes that must all hold for the pruned merge to stand) it neither gains nor
// loses, and is kept there too. benchmarks/results/NOTES.md has the timings.
inline constexpr int kPrunedMergeMinTags = 9;

// One merge of merge_lanes (kT > 0, one target tag) with the lists that cannot contribute left
// out, kbest_step_pruned's idea (kbest.cpp) in lanes. Per lane, let s1 be the list of the
// best head (the first maximum, as merge_lanes' round 0) and theta = lists[s1][K - 1] +
// offset(s1), its K-th candidate: every other list whose head is below theta loses to each of
// s1's K candidates, so only the lists with head >= theta take part. Where, in every active
// lane, at most one list besides s1 does, the K best are a two-way merge of s1 and that list
// (in lanes with none, the second list is a -inf stand-in that is never taken, s1's candidates
// being >= theta > -inf), in merge_lanes' order: larger value first, then the smaller
// predecessor, then the earlier rank. The candidates are the same sums (list entry + offset),
// taken in the same order, so values and codes are those of merge_lanes, bit for bit, for
// every finite entry; entries of -inf may carry other codes, and no finite entry points to one.
// Always calls out for r = 0 .. K-1, and returns whether that result holds: false where some
// active lane has two or more other lists at or above theta (ties at theta, or theta = -inf
// because list s1 holds fewer than K finite entries, as at the first positions); the caller
// then runs merge_lanes for this tag, which overwrites it. (No branch on the data in here, so
// that the CPU can overlap consecutive tags' dependency chains, even for the tags where s1
// alone takes part in every lane.) On random scores the merge holds for most tags
// (benchmarks/results/NOTES.md).
template <typename scalar_t, int kT, typename Offset, typename Out>
__attribute__((always_inline)) inline bool merge_lanes_pruned(
    const typename Lanes<scalar_t>::Vector* __restrict__ lists, int64_t K,
    typename Lanes<scalar_t>::Mask active, Offset&& offset, Out&& out) {
  static_assert(kT > 0, "the pruned merge keeps its state in registers");
  using Vector = typename Lanes<scalar_t>::Vector;
  using Mask = typename Lanes<scalar_t>::Mask;
  using Index = typename Lanes<scalar_t>::Index;
  constexpr int64_t kCount = Lanes<scalar_t>::kCount;
  const scalar_t* list_scalars = reinterpret_cast<const scalar_t*>(lists);
  const Index list_stride = static_cast<Index>((K + 1) * kCount);  // scalars per list
  const Index slot = static_cast<Index>(kCount);                   // scalars per rank

  Vector head[kT], offsets[kT], tree_value[kT], tree_offset[kT];
  Mask address[kT], tree_address[kT];
#pragma GCC unroll 16
  for (int64_t s = 0; s < kT; ++s) {
    offsets[s] = Vector{} + offset(s);
    head[s] = lists[s * (K + 1)] + offset(s);
    address[s] = first_slot_address<scalar_t>(s, list_stride);
    tree_value[s] = head[s];
    tree_offset[s] = offsets[s];
    tree_address[s] = address[s];
  }
  first_max_tree<kT, true>(tree_value, tree_address, tree_offset);
  const Vector best = tree_value[0], best_offset = tree_offset[0];
  const Mask best_address = tree_address[0];
  const Vector theta =
      gather_lanes<scalar_t>(list_scalars, best_address + static_cast<Index>((K - 1) * kCount)) + best_offset;

  // The other lists with head >= theta: minus their number per lane, and the last one's state.
  Mask minus_others = {};
  Vector second = Vector{} + neg_inf<scalar_t>(), second_offset = {};
  Mask second_address = best_address;
#pragma GCC unroll 16
  for (int64_t s = 0; s < kT; ++s) {
    const Mask other = (head[s] >= theta) & (address[s] != best_address);
    minus_others += other;
    second = other ? head[s] : second;
    second_offset = other ? offsets[s] : second_offset;
    second_address = other ? address[s] : second_address;
  }
  // Merged in every lane, and kept where no active lane has two other lists at or above theta.
  const bool pruned = !any_lane(active & (minus_others < Index{-1}));

  // Two-way merge of list a = s1 and list b = the other one. The entry after each head is kept
  // at hand (as merge_lanes' kNextAhead), so a round's head update needs no gather; the gather
  // that refills it follows the round's choice and has until the next round's update.
  // (benchmarks/results/NOTES.md has this loop's perf profile.)
  const Mask b_wins_ties = second_address < best_address;  // the smaller predecessor
  Vector head_a = best, head_b = second;
  Mask address_a = best_address, address_b = second_address;
  Vector next_a = gather_lanes<scalar_t>(list_scalars, address_a + slot);
  Vector next_b = gather_lanes<scalar_t>(list_scalars, address_b + slot);
  for (int64_t r = 0; r < K; ++r) {
    const Mask take_b = (head_b > head_a) | ((head_b == head_a) & b_wins_ties);
    out(r, take_b ? head_b : head_a, (take_b ? address_b : address_a) >> kLaneShift<scalar_t>);
    if (r + 1 == K) break;
    // Advance the list taken in each lane. Each list advances at most K - 1 times, and the
    // entry after the new head is gathered only when another round follows (r + 2 < K), so
    // the gathers read at most slot K - 1 (slot K, the -inf sentinel, is never needed here:
    // a list of K entries cannot run out within K rounds).
    head_a = take_b ? head_a : next_a + best_offset;
    head_b = take_b ? next_b + second_offset : head_b;
    address_a = take_b ? address_a : address_a + slot;
    address_b = take_b ? address_b + slot : address_b;
    if (r + 2 < K) {
      const Vector gathered =
          gather_lanes<scalar_t>(list_scalars, (take_b ? address_b : address_a) + slot);
      next_a = take_b ? next_a : gathered;
      next_b = take_b ? gathered : next_b;
    }
  }
  return pruned;
}

// How many merges merge_lanes runs side by side (the targets t of one position, in blocks of at
// most this many). With T a template argument the merge state is in registers: one merge at a
// time (2 spill, and measured slower). With T at run time the state is in memory and the argmax
// a chain of T - 1 steps: 4 merges interleave those chains (measured faster than 1, and the
// same as 3; benchmarks/results/NOTES.md).
inline constexpr int kMemoryMergeBlock = 4;
template <int kT>
inline constexpr int kMergeBlock = kT > 0 ? 1 : kMemoryMergeBlock;

// f(std::integral_constant<int, size>{}) for 1 <= size <= R.
template <int R, typename F>
inline void merge_block_of_size(int size, F&& f) {
  if constexpr (R >= 1) {
    if (size == R) {
      f(std::integral_constant<int, R>{});
    } else {
      merge_block_of_size<R - 1>(size, f);
    }
  }
}

// The per-thread buffers of the k-best lane decoder, for sentences of up to max_length
// positions.
template <typename scalar_t, typename bp_t>
struct KBestLaneWork {
  using Vector = typename LaneTypes<scalar_t, bp_t>::Vector;
  using Mask = typename LaneTypes<scalar_t, bp_t>::Mask;
  using Backpointers = typename LaneTypes<scalar_t, bp_t>::Backpointers;
  std::unique_ptr<Vector[]> emit;                // (max_length, T) vectors (+ padding to a block)
  std::unique_ptr<Vector[]> lists, lists_next;   // (T, K + 1) vectors, slot K = -inf
  std::unique_ptr<Backpointers[]> backpointers;  // (max_length, T, K + 1) vectors of kCount codes
  std::unique_ptr<Vector[]> head;                // (kMemoryMergeBlock, T): merge state when T is
  std::unique_ptr<Mask[]> address;               //   not a template argument (merge_lanes)
  std::unique_ptr<Vector[]> final_values;        // (K,) the final merge's values
  std::unique_ptr<Mask[]> final_codes;           // (K,) and slot codes
  KBestLaneWork(int64_t max_length, int64_t T, int64_t K)
      : emit(new Vector[padded_to_lanes<scalar_t>(max_length * T)]),
        lists(new Vector[T * (K + 1)]), lists_next(new Vector[T * (K + 1)]),
        backpointers(new Backpointers[max_length * T * (K + 1)]), head(new Vector[kMemoryMergeBlock * T]),
        address(new Mask[kMemoryMergeBlock * T]), final_values(new Vector[K]), final_codes(new Mask[K]) {
    const Vector minus_inf = Vector{} + neg_inf<scalar_t>();
    for (int64_t s = 0; s < T; ++s) {  // the sentinels, never written again
      lists[s * (K + 1) + K] = minus_inf;
      lists_next[s * (K + 1) + K] = minus_inf;
    }
  }
};

// Whether the lane decoder runs with T as a template argument (merge state in registers):
// T <= 16 with one-byte codes (T * (K + 1) <= 256). See dispatch_tag_count.
inline bool kbest_lanes_in_registers(int64_t T, int64_t K) { return T <= 16 && T * (K + 1) <= 256; }

// Calls f(std::integral_constant<int, kT>{}) with kT = T where the merge state fits in
// registers and codes in uint8_t (the common case: T <= 16, small K), kT = 0 otherwise. (Only
// one code type, so as not to compile 16 more group decoders per type for rare cases.)
template <typename bp_t, typename F>
void dispatch_tag_count(int64_t T, int64_t K, F&& f) {
  if constexpr (std::is_same_v<bp_t, uint8_t>) {
    if (kbest_lanes_in_registers(T, K)) {
      switch (T) {
#define CRFKIT_TAG_COUNT_CASE(N) \
    case N: return f(std::integral_constant<int, N>{});
        CRFKIT_TAG_COUNT_CASE(1) CRFKIT_TAG_COUNT_CASE(2) CRFKIT_TAG_COUNT_CASE(3)
        CRFKIT_TAG_COUNT_CASE(4) CRFKIT_TAG_COUNT_CASE(5) CRFKIT_TAG_COUNT_CASE(6)
        CRFKIT_TAG_COUNT_CASE(7) CRFKIT_TAG_COUNT_CASE(8) CRFKIT_TAG_COUNT_CASE(9)
        CRFKIT_TAG_COUNT_CASE(10) CRFKIT_TAG_COUNT_CASE(11) CRFKIT_TAG_COUNT_CASE(12)
        CRFKIT_TAG_COUNT_CASE(13) CRFKIT_TAG_COUNT_CASE(14) CRFKIT_TAG_COUNT_CASE(15)
        CRFKIT_TAG_COUNT_CASE(16)
#undef CRFKIT_TAG_COUNT_CASE
        default: break;
      }
    }
  }
  f(std::integral_constant<int, 0>{});
}

// k-best for one group of up to kCount sentences: lane j is sentence sentence[j], of length
// length[j] (1 <= length[j] <= L, non-increasing in j); lanes j >= count are idle. Writes
// scores[b * k + r] and paths[(b * k + r) * L + i] for each sentence b of the group and each of
// its existing sequences r < K, as kbest_sentence does; rows with no sequence are left as they
// are (-1 / -inf). A sentence whose real positions hold NaN or +inf is flagged in bad_sentence
// and left idle. bp_t must hold the slot codes, T * (K + 1) - 1; kT = T or 0 (see
// dispatch_tag_count). (All in one function: with the position loop in a function of its own, or
// the backtrace, GCC 12's code measured slower, although it compiled faster;
// benchmarks/results/NOTES.md.)
template <typename scalar_t, typename bp_t, int kT>
void kbest_lane_group(const scalar_t* emissions, const scalar_t* trans, const scalar_t* start,
                      const scalar_t* end, int64_t L, int64_t T, int64_t K, int64_t k,
                      const int64_t* sentence, const int64_t* length, int64_t count,
                      KBestLaneWork<scalar_t, bp_t>& work, int64_t* paths, scalar_t* scores,
                      std::vector<char>& bad_sentence) {
  using Types = LaneTypes<scalar_t, bp_t>;
  using Vector = typename Types::Vector;
  using Mask = typename Types::Mask;
  using Index = typename Types::Index;
  using Backpointers = typename Types::Backpointers;
  constexpr int64_t kCount = Types::kCount;
  if constexpr (kT > 0) T = kT;

  // Emissions in lane layout and the NaN / +inf check (viterbi_lanes.h).
  Vector* emit = work.emit.get();  // [i * T + t]
  int64_t n[kCount];  // positions decoded per lane (0: idle lane or bad sentence)
  const int64_t n_max = group_emissions_to_lanes<scalar_t>(emissions, L, T, sentence, length, count, emit,
                                                           n, bad_sentence);
  if (n_max == 0) return;
  Mask lane_length;
  for (int64_t j = 0; j < kCount; ++j) lane_length[j] = static_cast<Index>(n[j]);

  const int64_t slots = K + 1;  // per list
  const std::vector<TagBlock> blocks = lane_tag_blocks(T, kMergeBlock<kT>);
  Vector* lists = work.lists.get();            // [s * slots + r]: the lists at position i - 1
  Vector* lists_next = work.lists_next.get();  // at position i
  Backpointers* backpointers = work.backpointers.get();  // [(i * T + t) * slots + r]
  // Position 0: one sequence per tag, in rank 0 of its list.
  const Vector minus_inf = Vector{} + neg_inf<scalar_t>();
  for (int64_t t = 0; t < T; ++t) {
    lists[t * slots] = start[t] + emit[t];
    for (int64_t r = 1; r < K; ++r) lists[t * slots + r] = minus_inf;
  }
  for (int64_t i = 1; i < n_max; ++i) {
    // Lanes past their length keep their lists: they are final.
    const Mask active = lane_length > static_cast<Index>(i);
    const Vector* emit_i = emit + i * T;
    Backpointers* bp_i = backpointers + i * T * slots;
    // Entry r of tag t's list at position i, from a merge's r-th best.
    auto store = [&](int64_t t, int64_t r, Vector best, Mask code) {
      lists_next[t * slots + r] = active ? best + emit_i[t] : lists[t * slots + r];
      bp_i[t * slots + r] = narrow_codes<Backpointers>(code);
    };
    if constexpr (kT >= kPrunedMergeMinTags) {  // one tag at a time (kMergeBlock<kT> is 1)
      // Every tag's pruned merge first, with no branch on the data between them (so that the
      // CPU overlaps the tags' dependency chains), then the full merge where it did not hold.
      uint32_t unpruned = 0;  // bit t: tag t needs the full merge (kT <= 16)
      for (int64_t t = 0; t < T; ++t) {
        const bool held = merge_lanes_pruned<scalar_t, kT>(
            lists, K, active, [&](int64_t s) { return trans[s * T + t]; },
            [&](int64_t r, Vector best, Mask code) { store(t, r, best, code); });
        unpruned |= static_cast<uint32_t>(!held) << t;
      }
      for (; unpruned != 0; unpruned &= unpruned - 1) {
        const int64_t t = std::countr_zero(unpruned);
        merge_lanes<scalar_t, kT, 1>(
            lists, T, K, [&](int, int64_t s) { return trans[s * T + t]; }, work.head.get(),
            work.address.get(), [&](int, int64_t r, Vector best, Mask code) { store(t, r, best, code); });
      }
    } else {
      for (const TagBlock& block : blocks) {
        merge_block_of_size<kMergeBlock<kT>>(block.size, [&](auto size) {
          constexpr int M = decltype(size)::value;
          const int64_t t0 = block.first;
          merge_lanes<scalar_t, kT, M>(
              lists, T, K, [&](int m, int64_t s) { return trans[s * T + t0 + m]; }, work.head.get(),
              work.address.get(),
              [&](int m, int64_t r, Vector best, Mask code) { store(t0 + m, r, best, code); });
        });
      }
    }
    std::swap(lists, lists_next);
  }
  Vector* final_values = work.final_values.get();
  Mask* final_codes = work.final_codes.get();
  merge_lanes<scalar_t, kT, 1>(
      lists, T, K, [&](int, int64_t s) { return end[s]; }, work.head.get(), work.address.get(),
      [&](int, int64_t r, Vector best, Mask code) {
        final_values[r] = best;
        final_codes[r] = code;
      });

  // Backtrace, all lanes and ranks side by side (independent chains of dependent loads, which
  // the CPU overlaps). code = s * slots + rank is the offset of the predecessor's backpointers
  // within a position; its tag is code / slots (a table: no division in the chain).
  std::vector<int64_t> tag_of(T * slots);
  for (int64_t c = 0; c < T * slots; ++c) tag_of[c] = c / slots;
  int64_t rows[kCount] = {};  // sequences found per lane (fewer than K when fewer exist)
  for (int64_t j = 0; j < count; ++j) {
    if (n[j] == 0) continue;
    const int64_t b = sentence[j];
    while (rows[j] < K && final_values[rows[j]][j] != neg_inf<scalar_t>()) {
      scores[b * k + rows[j]] = final_values[rows[j]][j];
      ++rows[j];
    }
  }
  std::vector<int64_t> code(kCount * K);  // [j * K + r]: the slot code at position i
  for (int64_t j = 0; j < kCount; ++j) {
    for (int64_t r = 0; r < K; ++r) code[j * K + r] = final_codes[r][j];
  }
  for (int64_t i = n_max - 1; i >= 0; --i) {
    const Backpointers* bp_i = backpointers + i * T * slots;
    for (int64_t j = 0; j < count; ++j) {
      if (i >= n[j]) continue;
      int64_t* path_row = paths + sentence[j] * k * L + i;
      int64_t* code_j = &code[j * K];
      for (int64_t r = 0; r < rows[j]; ++r) {
        path_row[r * L] = tag_of[code_j[r]];
        if (i > 0) code_j[r] = bp_i[code_j[r]][j];
      }
    }
  }
}

// ---- the batch -----------------------------------------------------------------------------------
// Whether the per-sentence kernel merges surviving K-lists in vectors (kbest.cpp,
// merge_surviving_lists): float, K <= 16 (a list in one 512-bit vector), AVX-512 builds.
template <typename scalar_t>
constexpr bool kbest_merges_in_vectors(int64_t K) {
#if defined(__AVX512F__)
  return sizeof(scalar_t) == 4 && K <= 16;
#else
  (void)K;
  return false;
#endif
}

// The cost of one position of a lane group, in positions of one sentence of the per-sentence
// kernel (kbest_sentence, with its pruned merge), fitted to measurements on 2-core AVX-512 and
// AVX2-only VMs (benchmarks/results/NOTES.md has the tables and how they were taken). A group
// decodes kCount (16 / 8) sentences, so lanes pay off where the cost is below that. Modelled as
// 1.3 + 0.27 T with the merge state in registers and 1.3 + 0.45 T in memory, times a factor for
// the list length: 0.84 (K / 2)^0.63 where the per-sentence kernel merges in vectors, else
// 0.65 + K / 10 up to 1.6; and 6 at T = 1 (where the per-sentence kernel's merges are trivial).
// AVX2 builds use the same model (kCount is 8 floats / 4 doubles there, and the per-sentence
// kernel merges without vectors), except that the pruned cases (T = 9 - 16 in registers) cost
// 0.65 of it: the model, fitted before the pruned merge (merge_lanes_pruned) and the packed
// backpointer codes (narrow_codes), overestimated those lane times. The AVX-512 fit is left as
// it was: the pruned merge has not been measured there.
template <typename scalar_t>
double kbest_lane_group_cost(int64_t T, int64_t K) {
  if (T == 1) return 6.0;
  const double per_tag = kbest_lanes_in_registers(T, K) ? 0.27 : 0.45;
  const double list_factor = kbest_merges_in_vectors<scalar_t>(K)
                                 ? 0.84 * std::pow(static_cast<double>(K) / 2.0, 0.63)
                                 : std::min(1.6, 0.65 + static_cast<double>(K) / 10.0);
  double cost = (1.3 + per_tag * static_cast<double>(T)) * list_factor;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (kbest_lanes_in_registers(T, K) && T >= kPrunedMergeMinTags) cost *= 0.65;  // see above
#endif
  return cost;
}

// Bytes per slot code of the lane decoder's backpointers (the narrowest type that holds the
// T * (K + 1) codes, as dispatch_backpointer_type chooses it).
inline int64_t kbest_lane_code_bytes(int64_t T, int64_t K) {
  int64_t bytes = 0;
  dispatch_backpointer_type(T * (K + 1), [&](auto code) { bytes = sizeof code; });
  return bytes;
}

// Which sentences go together, and whether the lane decoder beats the per-sentence kernel here,
// for lists of K entries (k capped by the number of sequences). The per-thread buffers
// (KBestLaneWork) take, per position of the longest sentence, T emission vectors and T * (K + 1)
// vectors of codes.
template <typename scalar_t>
LanePlan plan_kbest_lanes(const int64_t* lengths, int64_t B, int64_t L, int64_t T, int64_t K) {
  const int64_t bytes_per_position =
      T * (static_cast<int64_t>(sizeof(scalar_t)) + (K + 1) * kbest_lane_code_bytes(T, K)) *
      Lanes<scalar_t>::kCount;
  return plan_lanes<scalar_t>(lengths, B, L, bytes_per_position, kbest_lane_group_cost<scalar_t>(T, K));
}

// k-best for the batch with the lane decoder, as planned: scores (B, k) pre-filled with -inf,
// paths (B, k, L) with -1; lists of K <= k entries. Sentences whose real positions hold NaN or
// +inf emissions are flagged in bad_sentence (the caller raises); length-0 sentences get score 0
// in row 0 (the empty sequence).
template <typename scalar_t>
void kbest_lanes(const LanePlan& plan, const scalar_t* emissions, const scalar_t* trans,
                 const int64_t* lengths, const scalar_t* start, const scalar_t* end, int64_t B,
                 int64_t L, int64_t T, int64_t K, int64_t k, int64_t* paths, scalar_t* scores,
                 std::vector<char>& bad_sentence) {
  for (int64_t b = 0; b < B; ++b) {
    if (lengths[b] == 0) scores[b * k] = 0;
  }
  dispatch_backpointer_type(T * (K + 1), [&](auto code) {
    using bp_t = decltype(code);
    dispatch_tag_count<bp_t>(T, K, [&](auto tag_count) {
      constexpr int kT = decltype(tag_count)::value;
      for_each_lane_group<scalar_t>(
          plan, [&] { return KBestLaneWork<scalar_t, bp_t>(plan.lengths[0], T, K); },
          [&](KBestLaneWork<scalar_t, bp_t>& work, int64_t first, int64_t count) {
            kbest_lane_group<scalar_t, bp_t, kT>(emissions, trans, start, end, L, T, K, k,
                                                 &plan.order[first], &plan.lengths[first], count,
                                                 work, paths, scores, bad_sentence);
          });
    });
  });
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
