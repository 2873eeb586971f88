// CPU kernel: exact k-best Viterbi (the K best distinct tag sequences per sentence), one
// sentence at a time with the tags in lanes, merging only the sorted K-lists that can still
// reach a tag's K best; compact backpointers and the backtrace in C++. Several sentences per
// vector: kbest_lanes.h; what Viterbi and k-best share: viterbi_common.h; k-best with
// log-probabilities: kbest_with_log_probs.cpp.
//
// Scores are accumulated exactly as crfkit.reference and sequence_score do it, left to right,
//     score_0 = start[y_0] + emit[0, y_0];  score_i = (score_{i-1} + trans[y_{i-1}, y_i]) + emit[i, y_i]
//     total   = score_{n-1} + end[y_{n-1}]
// so the three agree to the last bit and ties are seen identically.
//
// Tie rule (documented in crfkit/functional.py): among sequences of equal score, the one whose
// tags, read from the LAST position backwards, are lexicographically smaller comes first. It
// follows from two local choices: when merging candidates for (position i, tag t), a smaller
// predecessor tag wins a tie, and within one predecessor's list the earlier rank wins; the final
// choice over last tags prefers the smaller tag.


#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../tensor.h"
#include "../backpointers.h"
#include "../checks.h"
#include "isa.h"
#include "kbest_lanes.h"
#include "lanes.h"
#include "log_space.h"
#include "per_example.h"
#include "viterbi_common.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

// Select the K best of T sorted lists (the final choice over last tags): list s holds lists[s * K + r] (descending in r) and
// each of its entries is offset by offsets[s * offset_stride]. Writes the chosen values and
// codes (s * K + r); slots with nothing left get -inf. `heads` (T) and `head_values` (T) are
// scratch: head_values[s] is the next candidate of list s, so a round is one argmax over T
// values (branch-free, the first maximum wins) and one refill of the list it took from.
template <typename scalar_t, typename code_t>
void merge_top_k(const scalar_t* lists, const scalar_t* offsets, int64_t offset_stride, int64_t T,
                 int64_t K, scalar_t* values, code_t* codes, int64_t* heads, scalar_t* head_values) {
  for (int64_t s = 0; s < T; ++s) {
    heads[s] = 0;
    head_values[s] = lists[s * K] + offsets[s * offset_stride];
  }
  for (int64_t out = 0; out < K; ++out) {
    scalar_t best = head_values[0];
    int64_t best_s = 0;
    for (int64_t s = 1; s < T; ++s) {
      const bool better = head_values[s] > best;  // strict: smaller s wins a tie
      best = better ? head_values[s] : best;
      best_s = better ? s : best_s;
    }
    if (best == neg_inf<scalar_t>()) {  // only -inf left: these slots hold no sequence
      std::fill(values + out, values + K, neg_inf<scalar_t>());
      return;
    }
    values[out] = best;
    const int64_t rank = heads[best_s]++;
    codes[out] = static_cast<code_t>(best_s * K + rank);
    head_values[best_s] = rank + 1 < K ? lists[best_s * K + rank + 1] + offsets[best_s * offset_stride]
                                       : neg_inf<scalar_t>();
  }
}

// Scratch of kbest_step_pruned: list heads (T); per tag the best candidate, its predecessor, the
// bound theta and the number of surviving lists (stride); one tag's surviving predecessors and
// merge state (T).
template <typename scalar_t>
struct KBestPruneWork {
  std::vector<scalar_t> heads, best, theta, merge_heads;
  std::vector<typename Lanes<scalar_t>::Index> best_s, counts;
  std::vector<int32_t> survivors, merge_ranks;
  KBestPruneWork(int64_t T, int64_t stride)
      : heads(T), best(stride), theta(stride, std::numeric_limits<scalar_t>::infinity()),
        merge_heads(T), best_s(stride), counts(stride), survivors(T + 16), merge_ranks(T) {}
};

// One k-best step, position i-1 -> i: for every tag t, the K best of lists[s][r] + trans[s, t]
// over all predecessors s and ranks r, plus emit[t]. These are T merges of the same T sorted
// lists, run side by side: a round is one column_argmax over the lists' current heads (all
// tags at once, in lanes) instead of one serial argmax chain per t.
// Scratch: head_values [s][t] (next candidate of list s for tag t; T x stride, its padding
// -inf), heads [s][t] (T x T), best and best_s (stride).
template <typename scalar_t, typename bp_t>
void kbest_step(const scalar_t* __restrict__ lists, const PaddedTransitions<scalar_t>& trans,
                const scalar_t* __restrict__ emit, int64_t K, scalar_t* __restrict__ next,
                bp_t* __restrict__ backpointers, scalar_t* __restrict__ head_values,
                int32_t* __restrict__ heads, scalar_t* __restrict__ best,
                typename Lanes<scalar_t>::Index* __restrict__ best_s) {
  const int64_t T = trans.T, stride = trans.stride;
  for (int64_t s = 0; s < T; ++s) {
    const scalar_t* trans_row = &trans.rows[s * stride];
    for (int64_t t = 0; t < T; ++t) {
      head_values[s * stride + t] = lists[s * K] + trans_row[t];
      heads[s * T + t] = 0;
    }
  }
  for (int64_t r = 0; r < K; ++r) {
    column_argmax<scalar_t, false>(nullptr, head_values, stride, T, best, best_s);
    for (int64_t t = 0; t < T; ++t) {
      next[t * K + r] = best[t] + emit[t];
      if (best[t] == neg_inf<scalar_t>()) continue;  // no sequence left for this slot
      const int64_t s = best_s[t];
      const int64_t rank = heads[s * T + t]++;
      backpointers[t * K + r] = static_cast<bp_t>(s * K + rank);
      head_values[s * stride + t] =
          rank + 1 < K ? lists[s * K + rank + 1] + trans.rows[s * stride + t] : neg_inf<scalar_t>();
    }
  }
}

// counts[t] = the number of predecessors s with offsets[s] + rows[s * stride + t] >= bound[t],
// for t < stride (all tags at once, in lanes, as column_argmax; branch-free).
template <typename scalar_t, int kVectors>
void column_count_at_least_in_registers(const scalar_t* offsets, const scalar_t* rows,
                                        int64_t stride, int64_t T, const scalar_t* bound,
                                        typename Lanes<scalar_t>::Index* counts_out) {
  using Vector = typename Lanes<scalar_t>::Vector;
  using Mask = typename Lanes<scalar_t>::Mask;
  constexpr int64_t n = Lanes<scalar_t>::kCount;
  Vector bounds[kVectors];
  Mask counts[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    bounds[v] = load_lanes(bound + v * n);
    counts[v] = Mask{};
  }
  for (int64_t s = 0; s < T; ++s) {
    const scalar_t* row = rows + s * stride;
    for (int v = 0; v < kVectors; ++v) {
      counts[v] -= (offsets[s] + load_lanes(row + v * n)) >= bounds[v];  // a true lane is -1
    }
  }
  std::memcpy(counts_out, counts, sizeof counts);
}

template <typename scalar_t>
void column_count_at_least(const scalar_t* offsets, const scalar_t* rows, int64_t stride, int64_t T,
                           const scalar_t* bound, typename Lanes<scalar_t>::Index* counts) {
  for_each_register_block<scalar_t>(stride, [&](auto vectors, int64_t t0) {
    constexpr int kVectors = decltype(vectors)::value;
    column_count_at_least_in_registers<scalar_t, kVectors>(offsets, rows + t0, stride, T, bound + t0,
                                                           counts + t0);
  });
}

#if defined(__AVX512F__)
// The 16 int32 lane indices 0 .. 15 (k-best's 16-float vectors of list entries and tags).
inline __m512i lane_indices() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The first min(n, 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// Stores the lanes of `codes` in `mask` as backpointers (1, 2 or 4 bytes each).
template <typename bp_t>
inline void store_codes(bp_t* backpointers, __mmask16 mask, __m512i codes) {
  if constexpr (sizeof(bp_t) == 1) {
    _mm512_mask_cvtepi32_storeu_epi8(backpointers, mask, codes);
  } else if constexpr (sizeof(bp_t) == 2) {
    _mm512_mask_cvtepi32_storeu_epi16(backpointers, mask, codes);
  } else {
    _mm512_mask_storeu_epi32(backpointers, mask, codes);
  }
}
#endif

// The predecessors s < T with heads[s] + column[s] >= bound, in increasing order, into
// survivors (which has room for T + 16); returns how many. In AVX-512 builds 16 at a time: a
// compare and a compress of the indices that pass (the compress into a register and a full
// store; the compress to memory is microcoded on some CPUs).
template <typename scalar_t>
inline int64_t lists_at_least(const scalar_t* heads, const scalar_t* column, int64_t T,
                              scalar_t bound, int32_t* survivors) {
#if defined(__AVX512F__)
  if constexpr (sizeof(scalar_t) == 4) {
    const __m512 bounds = _mm512_set1_ps(bound);
    const __m512i iota = lane_indices();
    int64_t found = 0;
    for (int64_t s = 0; s < T; s += 16) {
      const __mmask16 m = first_lanes(T - s);
      const __m512 values =
          _mm512_add_ps(_mm512_maskz_loadu_ps(m, heads + s), _mm512_maskz_loadu_ps(m, column + s));
      const __mmask16 pass = _mm512_mask_cmp_ps_mask(m, values, bounds, _CMP_GE_OQ);
      const __m512i indices = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(s)));
      _mm512_storeu_si512(survivors + found, _mm512_maskz_compress_epi32(pass, indices));
      found += __builtin_popcount(pass);
    }
    return found;
  }
#endif
  int64_t found = 0;
  for (int64_t s = 0; s < T; ++s) {  // branch-free: store always, advance when s passes
    survivors[found] = static_cast<int32_t>(s);
    found += heads[s] + column[s] >= bound;
  }
  return found;
}

// A list taken whole and in order, the usual case of kbest_step_pruned:
//     next[r] = (list[r] + offset) + emit,   backpointers[r] = first_code + r   for r < K.
// In AVX-512 builds 16 floats at a time with a mask for the tail (K is often 2 - 15), the same
// arithmetic in the same order as the scalar loop.
template <typename scalar_t, typename bp_t>
inline void copy_list_shifted(const scalar_t* __restrict__ list, scalar_t offset, scalar_t emit,
                              int64_t first_code, int64_t K, scalar_t* __restrict__ next,
                              bp_t* __restrict__ backpointers) {
#if defined(__AVX512F__)
  if constexpr (sizeof(scalar_t) == 4) {
    const __m512 offsets = _mm512_set1_ps(offset), emits = _mm512_set1_ps(emit);
    const __m512i iota = lane_indices();
    for (int64_t r = 0; r < K; r += 16) {
      const __mmask16 m = first_lanes(K - r);
      const __m512 values =
          _mm512_add_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(m, list + r), offsets), emits);
      _mm512_mask_storeu_ps(next + r, m, values);
      const __m512i first = _mm512_set1_epi32(static_cast<int32_t>(first_code + r));
      store_codes(backpointers + r, m, _mm512_add_epi32(first, iota));
    }
    return;
  }
#endif
  for (int64_t r = 0; r < K; ++r) {
    next[r] = (list[r] + offset) + emit;
    backpointers[r] = static_cast<bp_t>(first_code + r);
  }
}

#if defined(__AVX512F__)
// A list of up to 16 float entries in one vector, best first, with their backpointer codes.
struct ListInVector {
  __m512 values;
  __m512i codes;
};

inline ListInVector list_in_vector(const float* list, float offset, int64_t code, __mmask16 first_k) {
  return {_mm512_add_ps(_mm512_maskz_loadu_ps(first_k, list), _mm512_set1_ps(offset)),
          _mm512_add_epi32(lane_indices(), _mm512_set1_epi32(static_cast<int32_t>(code)))};
}

// The K (<= 16) best of a list in a vector and a list b (K entries from memory, plus offset_b,
// codes code_b + j), in order, a winning ties (strict >). An entry's place in the merged order
// is its index plus the number of the other list's entries that go before it, so a's places
// take one compare per entry of b; the places of a among the first K form a mask, and two
// expands lay both lists' leading entries into their places, in order. No branch on the data:
// the scalar two-way merge branches on the data, and its lines were a hot spot of the
// per-sentence k-best in perf (benchmarks/results/NOTES.md).
inline ListInVector merge_top_k_in_vectors(const ListInVector& a, const float* b, float offset_b,
                                           int64_t code_b, int64_t K) {
  const __mmask16 first_k = first_lanes(K);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i place_a = lane_indices();
  for (int64_t j = 0; j < K; ++j) {
    const __mmask16 before = _mm512_cmp_ps_mask(_mm512_set1_ps(b[j] + offset_b), a.values, _CMP_GT_OQ);
    place_a = _mm512_mask_add_epi32(place_a, before, place_a, one);
  }
  // bit p set: place p is a's. Places are below 2K <= 32; bits >= K are dropped. (A scalar loop:
  // GCC 12's horizontal-reduction intrinsics warn of uninitialised values, its bug 105593.)
  alignas(64) int32_t places[16];
  _mm512_store_si512(places, place_a);
  uint32_t bits = 0;
  for (int64_t i = 0; i < K; ++i) bits |= 1u << places[i];
  const __mmask16 from_a = __mmask16(bits) & first_k;
  const ListInVector list_b = list_in_vector(b, offset_b, code_b, first_k);
  return {_mm512_mask_expand_ps(_mm512_maskz_expand_ps(~from_a, list_b.values), from_a, a.values),
          _mm512_mask_expand_epi32(_mm512_maskz_expand_epi32(~from_a, list_b.codes), from_a, a.codes)};
}
#endif

// The K best of the sorted lists `survivors` (count >= 2; K entries each, descending), shifted:
//     next[r], backpointers[r] = the r-th best of (lists[s][i] + trans[s, t], s * K + i) over
//                                the survivors s, plus emit,
// ties to the smaller s, then the earlier rank (kbest_step's rule). Where
// kbest_merges_in_vectors (AVX-512, float, K <= 16): merges in vectors, one list after another
// (each merge keeps the earlier lists' entries first on ties, which is that rule); otherwise a
// two-way merge for two lists, one argmax over the heads per entry for more. Same arithmetic
// (entry + trans, then + emit), same results. The vector merges measured faster than the scalar
// ones, the more so at larger K (benchmarks/results/NOTES.md).
template <typename scalar_t, typename bp_t>
inline void merge_surviving_lists(const scalar_t* __restrict__ lists, const scalar_t* rows, int64_t stride,
                                  int64_t t, const int32_t* survivors, int64_t count, scalar_t emit,
                                  int64_t K, scalar_t* __restrict__ next, bp_t* __restrict__ backpointers,
                                  KBestPruneWork<scalar_t>& w) {
#if defined(__AVX512F__)
  if constexpr (sizeof(scalar_t) == 4) {
    if (kbest_merges_in_vectors<scalar_t>(K)) {
      const __mmask16 first_k = first_lanes(K);
      const int64_t s0 = survivors[0];
      ListInVector merged = list_in_vector(lists + s0 * K, rows[s0 * stride + t], s0 * K, first_k);
      for (int64_t j = 1; j < count; ++j) {
        const int64_t s = survivors[j];
        merged = merge_top_k_in_vectors(merged, lists + s * K, rows[s * stride + t], s * K, K);
      }
      _mm512_mask_storeu_ps(next, first_k, _mm512_add_ps(merged.values, _mm512_set1_ps(emit)));
      store_codes(backpointers, first_k, merged.codes);
      return;
    }
  }
#endif
  if (count == 2) {  // one comparison per entry
    const int64_t s_a = survivors[0], s_b = survivors[1];
    const scalar_t trans_a = rows[s_a * stride + t], trans_b = rows[s_b * stride + t];
    int64_t rank_a = 0, rank_b = 0;
    scalar_t head_a = lists[s_a * K] + trans_a, head_b = lists[s_b * K] + trans_b;
    for (int64_t r = 0; r < K; ++r) {
      if (head_b > head_a) {  // strict: list a (the smaller predecessor) wins a tie
        next[r] = head_b + emit;
        backpointers[r] = static_cast<bp_t>(s_b * K + rank_b);
        ++rank_b;
        head_b = rank_b < K ? lists[s_b * K + rank_b] + trans_b : neg_inf<scalar_t>();
      } else {
        next[r] = head_a + emit;
        backpointers[r] = static_cast<bp_t>(s_a * K + rank_a);
        ++rank_a;
        head_a = rank_a < K ? lists[s_a * K + rank_a] + trans_a : neg_inf<scalar_t>();
      }
    }
    return;
  }
  // merge_top_k's merge, over the survivors only. Not a call of it: a branch-free argmax like
  // merge_top_k's (running best and index both selected) in this merge measured faster at K = 5
  // but slower at K = 15 (benchmarks/results/NOTES.md).
  for (int64_t j = 0; j < count; ++j) {
    w.merge_ranks[j] = 0;
    w.merge_heads[j] = lists[survivors[j] * K] + rows[survivors[j] * stride + t];
  }
  for (int64_t r = 0; r < K; ++r) {
    int64_t taken = 0;
    for (int64_t j = 1; j < count; ++j) {
      taken = w.merge_heads[j] > w.merge_heads[taken] ? j : taken;
    }
    const int64_t s = survivors[taken], rank = w.merge_ranks[taken]++;
    next[r] = w.merge_heads[taken] + emit;
    backpointers[r] = static_cast<bp_t>(s * K + rank);
    w.merge_heads[taken] =
        rank + 1 < K ? lists[s * K + rank + 1] + rows[s * stride + t] : neg_inf<scalar_t>();
  }
}

// The same k-best step as kbest_step, with the lists that cannot contribute left out. For tag t
// let s1 be the predecessor of its best candidate (a Viterbi step). The K entries of list s1
// are K candidates of value at least
//     theta[t] = lists[s1][K - 1] + trans[s1, t],
// so a candidate below theta[t] is beaten K times and is not among the K best, and neither is
// any entry of a list whose head (+ trans) is below theta[t], the list being sorted. The
// surviving lists (head + trans >= theta[t]) are merged in increasing s with kbest_step's rule
// (strict >: the smaller predecessor first, then the earlier rank): same values, same choices,
// bit for bit. On random scores few lists survive per tag, and most tags keep only s1, whose K
// entries are then the K best in order; so a step is a Viterbi step, one counting pass of the
// same shape and a copy of K entries per tag (more lists: merge_surviving_lists), where
// kbest_step runs K argmax rounds over all T heads (benchmarks/results/NOTES.md has the counts
// and timings).
// Returns false, having written nothing, where pruning does not apply or does not pay: a list
// s1 with fewer than K finite entries (the first positions) or more than 3 T surviving lists in
// all (many ties); the caller then runs kbest_step. `trans` must be built with_columns.
template <typename scalar_t, typename bp_t>
bool kbest_step_pruned(const scalar_t* __restrict__ lists, const PaddedTransitions<scalar_t>& trans,
                       const scalar_t* __restrict__ emit, int64_t K, scalar_t* __restrict__ next,
                       bp_t* __restrict__ backpointers, KBestPruneWork<scalar_t>& w) {
  const int64_t T = trans.T, stride = trans.stride;
  const scalar_t* rows = trans.rows.data();
  for (int64_t s = 0; s < T; ++s) w.heads[s] = lists[s * K];
  column_argmax<scalar_t, true>(w.heads.data(), rows, stride, T, w.best.data(), w.best_s.data());
  for (int64_t t = 0; t < T; ++t) {
    if (w.best[t] == neg_inf<scalar_t>()) {
      w.theta[t] = std::numeric_limits<scalar_t>::infinity();  // no sequence ends in t: no survivor
      continue;
    }
    const int64_t s1 = w.best_s[t];
    w.theta[t] = lists[s1 * K + K - 1] + rows[s1 * stride + t];
    if (w.theta[t] == neg_inf<scalar_t>()) return false;  // list s1 holds fewer than K entries
  }
  column_count_at_least(w.heads.data(), rows, stride, T, w.theta.data(), w.counts.data());
  int64_t total = 0;
  for (int64_t t = 0; t < T; ++t) total += w.counts[t];
  if (total > 3 * T) return false;  // many lists survive (ties): the full merge rounds are cheaper
  for (int64_t t = 0; t < T; ++t) {
    scalar_t* next_t = next + t * K;
    bp_t* bp_t_out = backpointers + t * K;
    const int64_t count = w.counts[t];
    if (count == 0) {  // no sequence ends in t (theta was +inf)
      for (int64_t r = 0; r < K; ++r) next_t[r] = neg_inf<scalar_t>() + emit[t];
      continue;
    }
    if (count == 1) {  // only s1 survives: its K entries, in order
      const int64_t s = w.best_s[t];
      copy_list_shifted(lists + s * K, rows[s * stride + t], emit[t], s * K, K, next_t, bp_t_out);
      continue;
    }
    int32_t* survivors_t = w.survivors.data();
    const int64_t found =
        lists_at_least(w.heads.data(), &trans.columns[t * T], T, w.theta[t], survivors_t);
    // Merge the surviving lists; they hold at least K finite entries (those of s1).
    merge_surviving_lists(lists, rows, stride, t, survivors_t, found, emit[t], K, next_t, bp_t_out, w);
  }
  return true;
}

// k-best for one sentence of length n >= 1 with K lists per tag. Writes paths (K, L) rows and
// scores (K,) for the valid results; rows with no sequence are left as they are (-1 / -inf).
// `work` holds the scratch of kbest_step(_pruned) and merge_top_k.
template <typename scalar_t, typename bp_t>
struct KBestWork {
  std::vector<scalar_t> lists, lists_next, head_values, best, final_values;
  std::vector<int32_t> heads;
  std::vector<typename Lanes<scalar_t>::Index> best_s;
  std::vector<int64_t> final_heads;
  std::vector<bp_t> backpointers, final_codes;
  std::vector<int32_t> tag_of;  // [code]: the tag of code = tag * K + rank (no division per step)
  KBestPruneWork<scalar_t> prune;
  KBestWork(int64_t L, int64_t T, int64_t stride, int64_t K)
      : lists(T * K), lists_next(T * K), head_values(T * stride, neg_inf<scalar_t>()),
        best(stride), final_values(K), heads(T * T), best_s(stride), final_heads(T),
        backpointers(std::max<int64_t>(L, 1) * T * K), final_codes(K), tag_of(T * K),
        prune(T, stride) {
    for (int64_t code = 0; code < T * K; ++code) tag_of[code] = static_cast<int32_t>(code / K);
  }
};

template <typename scalar_t, typename bp_t>
void kbest_sentence(const scalar_t* emit, const PaddedTransitions<scalar_t>& trans, const scalar_t* start,
                    const scalar_t* end, int64_t n, int64_t T, int64_t K, int64_t L,
                    KBestWork<scalar_t, bp_t>& w, int64_t* paths, scalar_t* scores) {
  scalar_t* lists = w.lists.data();
  scalar_t* lists_next = w.lists_next.data();
  // Position 0: one sequence per tag, in rank 0 of its list.
  for (int64_t t = 0; t < T; ++t) {
    lists[t * K] = start[t] + emit[t];
    std::fill(lists + t * K + 1, lists + (t + 1) * K, neg_inf<scalar_t>());
  }
  for (int64_t i = 1; i < n; ++i) {
    bp_t* backpointers_i = w.backpointers.data() + i * T * K;
    if (!kbest_step_pruned(lists, trans, emit + i * T, K, lists_next, backpointers_i, w.prune)) {
      kbest_step(lists, trans, emit + i * T, K, lists_next, backpointers_i, w.head_values.data(),
                 w.heads.data(), w.best.data(), w.best_s.data());
    }
    std::swap(lists, lists_next);
  }
  merge_top_k(lists, end, 1, T, K, w.final_values.data(), w.final_codes.data(),
              w.final_heads.data(), w.best.data());
  for (int64_t k = 0; k < K; ++k) {
    if (w.final_values[k] == neg_inf<scalar_t>()) break;  // fewer than K sequences exist
    scores[k] = w.final_values[k];
    // The backpointer of (position i, tag, rank) is at (i * T + tag) * K + rank = i * T * K + code.
    int64_t code = w.final_codes[k];
    for (int64_t i = n - 1; i >= 0; --i) {
      paths[k * L + i] = w.tag_of[code];
      if (i > 0) code = w.backpointers[i * T * K + code];
    }
  }
}

}  // namespace

// scores (B, K), paths (B, K, L) int64: the K best distinct sequences per sentence, descending;
// rows beyond the number of allowed sequences hold -1 / -inf.
std::tuple<Tensor, Tensor> kbest_viterbi_cpu(const Tensor& emissions_in,
                                                     const Tensor& transitions_in, int64_t k,
                                                     const Tensor& lengths_in, const Tensor& start_in,
                                                     const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return kbest_viterbi_per_example(emissions_in, transitions_in, k, lengths_in, start_in, end_in);
  }
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  CRFKIT_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule: use the cheaper kernel
    auto [best_scores, best_paths] = viterbi_cpu(emissions, transitions, lengths, start, end);
    return {torch::stable::unsqueeze(best_scores, 1), torch::stable::unsqueeze(best_paths, 1)};
  }
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  auto paths = full({B, k, L}, -1, options_of(lengths));
  auto scores = full({B, k}, -std::numeric_limits<double>::infinity(), options_of(emissions));
  // No sentence has more than T^L sequences, so lists longer than that only hold -inf.
  const int64_t K = num_sequences_capped(T, L, k);
  std::vector<char> bad(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_kbest_viterbi", [&] {
    const scalar_t* emit = emissions.mutable_data_ptr<scalar_t>();
    const scalar_t* trans = transitions.mutable_data_ptr<scalar_t>();
    const scalar_t* st = start.mutable_data_ptr<scalar_t>();
    const scalar_t* en = end.mutable_data_ptr<scalar_t>();
    const int64_t* len = lengths.mutable_data_ptr<int64_t>();
    int64_t* path = paths.mutable_data_ptr<int64_t>();
    scalar_t* score = scores.mutable_data_ptr<scalar_t>();
    // Several sentences per vector (kbest_lanes.h) where that is faster: same results, bit for
    // bit. Otherwise one sentence at a time, tags in lanes.
    const LanePlan plan = plan_kbest_lanes<scalar_t>(len, B, L, T, K);
    if (plan.use_lanes) {
      kbest_lanes<scalar_t>(plan, emit, trans, len, st, en, B, L, T, K, k, path, score, bad);
      return;
    }
    dispatch_backpointer_type(T * K, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      const PaddedTransitions<scalar_t> padded_trans(trans, T, /*with_columns=*/true);
      parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
        KBestWork<scalar_t, bp_t> work(L, T, padded_trans.stride, K);
        for (int64_t b = b_begin; b < b_end; ++b) {
          const int64_t n = len[b];
          const scalar_t* emit_b = emit + b * L * T;
          if (has_nan_or_posinf(emit_b, n * T)) {
            bad[b] = 1;
            continue;
          }
          if (n == 0) {  // exactly one sequence, the empty one, of score 0
            score[b * k] = 0;
            continue;
          }
          kbest_sentence(emit_b, padded_trans, st, en, n, T, K, L, work, path + b * k * L, score + b * k);
        }
      });
    });
  });
  raise_if_bad_emissions(bad);
  return {scores, paths};
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
