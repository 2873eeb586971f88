// CUDA kernels: Viterbi and exact k-best Viterbi, the whole time loop and the backtrace in
// one launch, with results identical to the CPU kernels (csrc/cpu/viterbi.cpp) bit for bit.
//
// Identical because the arithmetic is: scores are only ever added, in the same order as the
// CPU kernels and crfkit.reference (score_i = (score_{i-1} + trans[s, t]) + emit[i, t]), and
// IEEE additions and comparisons are exact operations (no multiply, so no FMA contraction),
// and the candidates are compared in the same order with the same strict '>', which is the
// tie rule: among equal scores the smaller predecessor tag wins, within one predecessor's
// list the earlier rank wins, and the final choice over last tags prefers the smaller tag
// (sequences of equal score come out ordered by their tags read from the last position
// backwards, smaller first).
//
// Layout: one group of G lanes per sentence (common.cuh), lane l owns tags l, l + G, ...
// Viterbi: the group's arena holds delta (two rows of T); per position and tag one lane scans
// the T predecessors. k-best: the arena holds the K-lists of every tag (two rows of T x K,
// sorted descending) and, per lane, the merge state of the tag it is working on (the next
// candidate of each predecessor's list and how far that list was taken, T entries each); per
// position and tag one lane merges the T sorted lists into the K best, exactly as the CPU
// kbest_step. Backpointers (predecessor tag, or code = predecessor tag * K + rank) go to a
// per-group (L, T[, K]) workspace in the smallest unsigned type that holds them; the final
// merge over end tags runs on the group's first lane, then the lanes backtrace the K rows
// in parallel (one row per lane). The transitions are staged in shared memory when they fit.
#include <torch/library.h>

#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

// Per-group k-best workspace for scores of type scalar_t, T tags, lists of K, G lanes.
struct KbestArena {
  size_t lists_a, lists_b;  // (T, K) scalars each: the lists of the previous / current position
  size_t head_values;       // (T, G) scalars: [s][lane] next candidate of list s for the lane's tag
  size_t heads;             // (T, G) int32: [s][lane] entries of list s already taken
  size_t final_values;      // (K,) scalars: the K best totals (after end scores)
  size_t final_codes;       // (K,) int32: their codes s * K + rank
  size_t bytes;
};

template <typename scalar_t>
__host__ __device__ inline KbestArena kbest_arena(int64_t T, int64_t K, int64_t G) {
  KbestArena a{};
  size_t at = 0;
  a.lists_a = at;
  at = align_up(at + T * K * sizeof(scalar_t));
  a.lists_b = at;
  at = align_up(at + T * K * sizeof(scalar_t));
  a.head_values = at;
  at = align_up(at + T * G * sizeof(scalar_t));
  a.heads = at;
  at = align_up(at + T * G * sizeof(int32_t));
  a.final_values = at;
  at = align_up(at + K * sizeof(scalar_t));
  a.final_codes = at;
  at = align_up(at + K * sizeof(int32_t));
  a.bytes = at;
  return a;
}

template <typename scalar_t, typename bp_t>
struct DecodeParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  scalar_t* scores;             // (B, rows)
  int64_t* paths;               // (B, rows, L), filled with -1 by the host
  bp_t* backpointers;           // (slots, L, T, K)
  unsigned char* arena_workspace;  // (slots, arena_bytes) when the arenas are not in shared memory
  long long* status;
  int64_t batch, max_len;
  int64_t rows;      // k requested (rows of the output), >= K
  int64_t list_len;  // K = min(k, T^L): longer lists would only hold -inf
  int num_tags;
  SharedPlan plan;
  size_t arena_bytes;
};

// Sentence index, length (0 when out of range: reported by validate_inputs_kernel) and the
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

template <typename scalar_t, typename bp_t, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) viterbi_kernel(const DecodeParams<scalar_t, bp_t> p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int T = p.num_tags;
  const int G = p.plan.lanes;
  const int group = threadIdx.x / G;
  const int lane = threadIdx.x % G;
  const int64_t slot = (int64_t)blockIdx.x * p.plan.groups_per_block + group;
  const int64_t L = p.max_len;
  const scalar_t kNegInf = neg_inf<scalar_t>();

  unsigned char* cursor = shared_raw;
  scalar_t* const arena =
      reinterpret_cast<scalar_t*>(group_arena<kAllShared>(cursor, p.plan, p.arena_bytes, p.arena_workspace, group, slot));
  const scalar_t* trans = stage_table<kAllShared>(cursor, p.plan.tables_in_shared, p.transitions, (int64_t)T * T);
  __syncthreads();  // the only block-wide barrier: the transitions are staged
  scalar_t* const delta_a = arena;
  scalar_t* const delta_b = arena + T;
  bp_t* const backpointers = p.backpointers + slot * L * T;  // [i * T + t]: best predecessor of t at i

  const int64_t grid_groups = (int64_t)gridDim.x * p.plan.groups_per_block;
  for (int64_t first = (int64_t)blockIdx.x * p.plan.groups_per_block; first < p.batch; first += grid_groups) {
    __syncwarp();  // the previous sentence (backtrace included) is finished by every lane
    const Sentence sentence = next_sentence(first, group, p.lengths, p.batch, L);
    const int64_t n = sentence.n;
    const scalar_t* emit = p.emissions + (sentence.exists ? sentence.b : 0) * L * T;
    bool bad = false;
    scalar_t* cur = delta_a;
    scalar_t* next = delta_b;
    if (n > 0) {
      for (int t = lane; t < T; t += G) {
        const scalar_t e = emit[t];
        bad |= is_nan_or_pos_inf(e);
        cur[t] = p.start[t] + e;
      }
    }
    // The emission of the lane's first tag is loaded one position ahead (its latency then
    // overlaps a whole step); further tags are read when used; nothing beyond the sentence.
    scalar_t emit_ahead = lane < T && n > 1 ? emit[T + lane] : scalar_t(0);
    for (int64_t i = 1; i < sentence.steps; ++i) {
      __syncwarp();  // cur complete, and everyone is done reading next (the row before cur)
      if (i < n) {
        const scalar_t* emit_i = emit + i * T;
        const scalar_t emit_first = emit_ahead;
        if (lane < T && i + 1 < n) emit_ahead = emit_i[T + lane];
        bp_t* bp_i = backpointers + i * T;
        for (int t = lane; t < T; t += G) {
          scalar_t best = cur[0] + trans[t];
          int arg = 0;
          for (int s = 1; s < T; ++s) {
            const scalar_t candidate = cur[s] + trans[s * T + t];
            if (candidate > best) {  // strict: the smaller predecessor wins a tie
              best = candidate;
              arg = s;
            }
          }
          const scalar_t e = t == lane ? emit_first : emit_i[t];
          bad |= is_nan_or_pos_inf(e);
          next[t] = best + e;
          bp_i[t] = static_cast<bp_t>(arg);
        }
        scalar_t* swap = cur;
        cur = next;
        next = swap;
      }
    }
    __syncwarp();  // the last row and every backpointer are visible to the whole group
    // Best last tag: ascending scan per lane (first maximum), then the group's smallest index.
    scalar_t best = kNegInf;
    int best_tag = T;  // "none" for lanes without tags: loses every tie against a real tag
    if (n > 0) {
      for (int t = lane; t < T; t += G) {
        const scalar_t v = cur[t] + p.end[t];
        if (best_tag == T || v > best) {
          best = v;
          best_tag = t;
        }
      }
    }
    group_argmax(best, best_tag, G);
    bad = group_max(static_cast<int>(bad), G) != 0;
    if (lane != 0 || !sentence.exists) continue;
    if (bad) {
      report(p.status, kBadEmissions, sentence.b);
    } else if (n == 0) {
      p.scores[sentence.b] = 0;  // the empty sequence; its path is all -1
    } else {
      p.scores[sentence.b] = best;
      if (best != kNegInf && best_tag < T) {  // -inf: every sequence forbidden, path stays -1
        int64_t* path = p.paths + sentence.b * L;
        int tag = best_tag;
        for (int64_t i = n - 1; i >= 0; --i) {
          path[i] = tag;
          if (i == 0) break;
          const uint32_t code = backpointers[i * T + tag];
          if (code >= (uint32_t)T) break;  // cannot happen with valid data; never read out of range
          tag = (int)code;
        }
      }
    }
  }
}

template <typename scalar_t, typename bp_t, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) kbest_kernel(const DecodeParams<scalar_t, bp_t> p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int T = p.num_tags;
  const int G = p.plan.lanes;
  const int group = threadIdx.x / G;
  const int lane = threadIdx.x % G;
  const int64_t slot = (int64_t)blockIdx.x * p.plan.groups_per_block + group;
  const int64_t L = p.max_len;
  const int64_t K = p.list_len;
  const scalar_t kNegInf = neg_inf<scalar_t>();

  unsigned char* cursor = shared_raw;
  unsigned char* const arena = group_arena<kAllShared>(cursor, p.plan, p.arena_bytes, p.arena_workspace, group, slot);
  const scalar_t* trans = stage_table<kAllShared>(cursor, p.plan.tables_in_shared, p.transitions, (int64_t)T * T);
  __syncthreads();  // the only block-wide barrier: the transitions are staged
  const KbestArena layout = kbest_arena<scalar_t>(T, K, G);
  scalar_t* const lists_a = reinterpret_cast<scalar_t*>(arena + layout.lists_a);  // [t * K + r]
  scalar_t* const lists_b = reinterpret_cast<scalar_t*>(arena + layout.lists_b);
  // This lane's column of the merge state: entry s at [s * G].
  scalar_t* const head_values = reinterpret_cast<scalar_t*>(arena + layout.head_values) + lane;
  int32_t* const heads = reinterpret_cast<int32_t*>(arena + layout.heads) + lane;
  scalar_t* const final_values = reinterpret_cast<scalar_t*>(arena + layout.final_values);
  int32_t* const final_codes = reinterpret_cast<int32_t*>(arena + layout.final_codes);
  bp_t* const backpointers = p.backpointers + slot * L * T * K;  // [(i * T + t) * K + r]

  const int64_t grid_groups = (int64_t)gridDim.x * p.plan.groups_per_block;
  for (int64_t first = (int64_t)blockIdx.x * p.plan.groups_per_block; first < p.batch; first += grid_groups) {
    __syncwarp();  // the previous sentence (backtrace included) is finished by every lane
    const Sentence sentence = next_sentence(first, group, p.lengths, p.batch, L);
    const int64_t n = sentence.n;
    const scalar_t* emit = p.emissions + (sentence.exists ? sentence.b : 0) * L * T;
    bool bad = false;
    scalar_t* cur = lists_a;
    scalar_t* next = lists_b;
    if (n > 0) {  // position 0: one sequence per tag, in rank 0 of its list
      for (int t = lane; t < T; t += G) {
        const scalar_t e = emit[t];
        bad |= is_nan_or_pos_inf(e);
        cur[t * K] = p.start[t] + e;
        for (int64_t r = 1; r < K; ++r) cur[t * K + r] = kNegInf;
      }
    }
    scalar_t emit_ahead = lane < T && n > 1 ? emit[T + lane] : scalar_t(0);  // as in viterbi_kernel
    for (int64_t i = 1; i < sentence.steps; ++i) {
      __syncwarp();  // cur complete, and everyone is done reading next (the lists before cur)
      if (i < n) {
        const scalar_t* emit_i = emit + i * T;
        const scalar_t emit_first = emit_ahead;
        if (lane < T && i + 1 < n) emit_ahead = emit_i[T + lane];
        for (int t = lane; t < T; t += G) {
          const scalar_t e = t == lane ? emit_first : emit_i[t];
          bad |= is_nan_or_pos_inf(e);
          // The K best of cur[s][r] + trans[s, t] over all s, r (the CPU kbest_step for one t).
          for (int s = 0; s < T; ++s) {
            head_values[s * G] = cur[s * K] + trans[s * T + t];
            heads[s * G] = 0;
          }
          scalar_t* out = next + t * K;
          bp_t* bp = backpointers + (i * T + t) * K;
          int64_t r = 0;
          for (; r < K; ++r) {
            scalar_t best = head_values[0];
            int best_s = 0;
            for (int s = 1; s < T; ++s) {
              const scalar_t v = head_values[s * G];
              if (v > best) {  // strict: the smaller predecessor wins a tie
                best = v;
                best_s = s;
              }
            }
            if (best == kNegInf) break;  // no sequence left for this slot or any later one
            out[r] = best + e;
            const int32_t rank = heads[best_s * G];
            heads[best_s * G] = rank + 1;
            bp[r] = static_cast<bp_t>(best_s * K + rank);
            head_values[best_s * G] = rank + 1 < K ? cur[best_s * K + rank + 1] + trans[best_s * T + t] : kNegInf;
          }
          for (; r < K; ++r) out[r] = kNegInf;
        }
        scalar_t* swap = cur;
        cur = next;
        next = swap;
      }
    }
    __syncwarp();  // the last lists and every backpointer are visible to the whole group
    bad = group_max(static_cast<int>(bad), G) != 0;
    // The K best over last tags (the CPU merge_top_k with the end scores), on the first lane.
    if (lane == 0 && n > 0 && !bad) {
      for (int s = 0; s < T; ++s) {
        head_values[s * G] = cur[s * K] + p.end[s];
        heads[s * G] = 0;
      }
      for (int64_t out = 0; out < K; ++out) {
        scalar_t best = head_values[0];
        int best_s = 0;
        for (int s = 1; s < T; ++s) {
          const scalar_t v = head_values[s * G];
          if (v > best) {  // strict: the smaller last tag wins a tie
            best = v;
            best_s = s;
          }
        }
        if (best == kNegInf) {  // only -inf left: these rows hold no sequence
          for (; out < K; ++out) final_values[out] = kNegInf;
          break;
        }
        final_values[out] = best;
        const int32_t rank = heads[best_s * G];
        heads[best_s * G] = rank + 1;
        final_codes[out] = static_cast<int32_t>(best_s * K + rank);
        head_values[best_s * G] = rank + 1 < K ? cur[best_s * K + rank + 1] + p.end[best_s] : kNegInf;
      }
    }
    __syncwarp();  // final_values / final_codes visible to the group
    if (!sentence.exists) continue;
    const int64_t b = sentence.b;
    if (bad) {
      if (lane == 0) report(p.status, kBadEmissions, b);
      continue;
    }
    if (n == 0) {  // exactly one sequence, the empty one, of score 0 (row 0; its path is all -1)
      if (lane == 0) p.scores[b * p.rows] = 0;
      continue;
    }
    for (int64_t row = lane; row < K; row += G) {  // one backtrace per lane
      const scalar_t value = final_values[row];
      if (value == kNegInf) continue;  // fewer than K sequences exist
      p.scores[b * p.rows + row] = value;
      int64_t* path = p.paths + (b * p.rows + row) * L;
      int64_t tag = final_codes[row] / K, rank = final_codes[row] % K;
      for (int64_t i = n - 1; i >= 0; --i) {
        path[i] = tag;
        if (i == 0) break;
        const int64_t code = backpointers[(i * T + tag) * K + rank];
        if (code >= T * K) break;  // cannot happen with valid data; never read out of range
        tag = code / K;
        rank = code % K;
      }
    }
  }
}

// Number of tag sequences of length L, saturated at `cap` (as the CPU kernel).
int64_t num_sequences_capped(int64_t T, int64_t L, int64_t cap) {
  int64_t count = 1;
  for (int64_t i = 0; i < L && count < cap; ++i) count = count > cap / T ? cap : count * T;
  return std::min(count, cap);
}

// Backpointer workspaces are per group of a persistent launch; cap their total so that a huge
// L * T * K does not allocate gigabytes (fewer groups then run at once; results are the same).
constexpr int64_t kBackpointerBudget = int64_t{256} << 20;

// shared_kernel / generic_kernel: the decoder's kAllShared = true / false variants.
template <typename scalar_t, typename bp_t, typename Kernel>
void launch_decoder(Kernel shared_kernel, Kernel generic_kernel, const CrfArgs& a, int64_t rows, int64_t K,
                    size_t arena_bytes, at::Tensor& scores, at::Tensor& paths, Status& status) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  if (B == 0) return;
  const SharedPlan plan = plan_shared(T, arena_bytes, 0, align_up(T * T * sizeof(scalar_t)));
  const Kernel kernel = all_in_shared(plan, false) ? shared_kernel : generic_kernel;
  const int64_t per_block = std::max<int64_t>(1, plan.groups_per_block * L * T * K * (int64_t)sizeof(bp_t));
  const int64_t blocks = persistent_blocks(kernel, plan, B, std::max<int64_t>(1, kBackpointerBudget / per_block));
  const int64_t slots = blocks * plan.groups_per_block;
  const auto bytes = a.emissions.options().dtype(at::kByte);
  at::Tensor backpointers = at::empty({std::max<int64_t>(1, slots * L * T * K * (int64_t)sizeof(bp_t))}, bytes);
  at::Tensor arena_workspace = plan.arena_in_shared ? at::Tensor() : at::empty({slots * (int64_t)arena_bytes}, bytes);

  DecodeParams<scalar_t, bp_t> params;
  params.emissions = a.emissions.data_ptr<scalar_t>();
  params.transitions = a.transitions.data_ptr<scalar_t>();
  params.start = a.start.data_ptr<scalar_t>();
  params.end = a.end.data_ptr<scalar_t>();
  params.lengths = a.lengths.data_ptr<int64_t>();
  params.scores = scores.data_ptr<scalar_t>();
  params.paths = paths.data_ptr<int64_t>();
  params.backpointers = reinterpret_cast<bp_t*>(backpointers.data_ptr<uint8_t>());
  params.arena_workspace = arena_workspace.defined() ? arena_workspace.data_ptr<uint8_t>() : nullptr;
  params.status = status.data();
  params.batch = B;
  params.max_len = L;
  params.rows = rows;
  params.list_len = K;
  params.num_tags = (int)T;
  params.plan = plan;
  params.arena_bytes = arena_bytes;
  kernel<<<(unsigned)blocks, plan.threads, plan.shared_bytes, current_stream()>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_sizes(int64_t T, int64_t K) {
  // Table indices s * T + t and codes s * K + rank are 32-bit.
  TORCH_CHECK_VALUE(T * T < (int64_t{1} << 31) && T * K < (int64_t{1} << 31),
                    "crfkit: the CUDA kernels need num_tags^2 and num_tags * k below 2^31, got num_tags = ", T,
                    ", k = ", K);
}

// scores (B,), paths (B, L) int64 (-1 at padded positions and where no sequence is allowed).
std::tuple<at::Tensor, at::Tensor> viterbi_cuda(const at::Tensor& emissions_in, const at::Tensor& transitions_in,
                                                const at::Tensor& start_in, const at::Tensor& end_in,
                                                const at::Tensor& lengths_in) {
  const CrfArgs a = checked_cuda_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const c10::cuda::CUDAGuard guard(a.emissions.device());
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  check_sizes(T, 1);
  Status status(a.emissions);
  launch_validate_inputs(a.lengths, L, a.transitions, a.start, a.end, status);
  at::Tensor paths = at::full({B, L}, -1, a.lengths.options());
  at::Tensor scores = at::empty({B}, a.emissions.options());
  AT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_viterbi_cuda", [&] {
    dispatch_backpointer_type(T, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      launch_decoder<scalar_t, bp_t>(viterbi_kernel<scalar_t, bp_t, true>, viterbi_kernel<scalar_t, bp_t, false>, a,
                                     1, 1, align_up(2 * T * sizeof(scalar_t)), scores, paths, status);
    });
  });
  status.raise_if_bad(a.lengths, L);
  return {scores, paths};
}

// scores (B, k), paths (B, k, L) int64: the k best distinct sequences per sentence, descending;
// rows beyond the number of allowed sequences hold -1 / -inf.
std::tuple<at::Tensor, at::Tensor> kbest_viterbi_cuda(const at::Tensor& emissions_in, const at::Tensor& transitions_in,
                                                      const at::Tensor& start_in, const at::Tensor& end_in,
                                                      const at::Tensor& lengths_in, int64_t k) {
  TORCH_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule: use the cheaper kernel
    auto [best_scores, best_paths] = viterbi_cuda(emissions_in, transitions_in, start_in, end_in, lengths_in);
    return {best_scores.unsqueeze(1), best_paths.unsqueeze(1)};
  }
  const CrfArgs a = checked_cuda_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const c10::cuda::CUDAGuard guard(a.emissions.device());
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  // No sentence has more than T^L sequences, so lists longer than that only hold -inf.
  const int64_t K = num_sequences_capped(T, L, k);
  check_sizes(T, K);
  Status status(a.emissions);
  launch_validate_inputs(a.lengths, L, a.transitions, a.start, a.end, status);
  at::Tensor paths = at::full({B, k, L}, -1, a.lengths.options());
  at::Tensor scores = at::full({B, k}, -std::numeric_limits<double>::infinity(), a.emissions.options());
  AT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_kbest_viterbi_cuda", [&] {
    const int G = lanes_per_sentence(T);
    const size_t arena_bytes = kbest_arena<scalar_t>(T, K, G).bytes;
    dispatch_backpointer_type(T * K, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      launch_decoder<scalar_t, bp_t>(kbest_kernel<scalar_t, bp_t, true>, kbest_kernel<scalar_t, bp_t, false>, a, k,
                                     K, arena_bytes, scores, paths, status);
    });
  });
  status.raise_if_bad(a.lengths, L);
  return {scores, paths};
}

}  // namespace

TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("viterbi", &viterbi_cuda);
  m.impl("kbest_viterbi", &kbest_viterbi_cuda);
}

}  // namespace cuda
}  // namespace crfkit
