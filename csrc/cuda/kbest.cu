// CUDA kernels: exact k-best Viterbi, the whole time loop and the backtrace in one launch, with
// results identical to the CPU kernel (csrc/cpu/kbest.cpp) bit for bit: kbest_kernel (a group of
// lanes per sentence, a lane per tag) and kbest_per_tag_kernel (a block per sentence, a group of
// lanes per tag), and k-best with log-probabilities (kbest_viterbi_with_log_probs). The layout,
// the arithmetic and the tie rule are described in viterbi_common.cuh, which holds what k-best
// shares with Viterbi (viterbi.cu).
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "per_example.cuh"
#include "viterbi_common.cuh"

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

// Buffers laid out one after another, 16-byte aligned: the offset of a buffer of `bytes`, with
// `at` moved past it.
__host__ __device__ inline size_t place(size_t& at, size_t bytes) {
  const size_t offset = at;
  at = align_up(at + bytes);
  return offset;
}

template <typename scalar_t>
__host__ __device__ inline KbestArena kbest_arena(int64_t T, int64_t K, int64_t G) {
  KbestArena a{};
  size_t at = 0;
  a.lists_a = place(at, T * K * sizeof(scalar_t));
  a.lists_b = place(at, T * K * sizeof(scalar_t));
  a.head_values = place(at, T * G * sizeof(scalar_t));
  a.heads = place(at, T * G * sizeof(int32_t));
  a.final_values = place(at, K * sizeof(scalar_t));
  a.final_codes = place(at, K * sizeof(int32_t));
  a.bytes = at;
  return a;
}

// Row `row` of sentence b's k-best output, written whole (the host does not fill the outputs):
// its score `value` and, for a sequence (value > -inf, n > 0), its path followed back from the
// final merge's code (last tag * K + rank) through the backpointers [(i * T + t) * K + r];
// -1 beyond the sentence's n positions and everywhere in rows that hold no sequence.
template <typename scalar_t, typename bp_t>
__device__ void write_kbest_row(const DecodeParams<scalar_t, bp_t>& p, int64_t b, int64_t n, int64_t row,
                                scalar_t value, int64_t code, const bp_t* backpointers) {
  const int64_t T = p.num_tags, K = p.list_len, L = p.max_len;
  p.scores[b * p.rows + row] = value;
  if (p.log_probs != nullptr) {  // as reference.log_probs_from_scores: log Z clamped to the lowest finite value
    const scalar_t lowest = -std::numeric_limits<scalar_t>::max();
    p.log_probs[b * p.rows + row] = value - max_(p.log_z[b], lowest);
  }
  int64_t* path = p.paths + (b * p.rows + row) * L;
  int64_t unwritten_from = 0;  // path[unwritten_from, L) gets -1
  if (value != neg_inf<scalar_t>() && n > 0) {
    unwritten_from = n;
    int64_t tag = code / K, rank = code % K;
    for (int64_t i = n - 1; i >= 0; --i) {
      path[i] = tag;
      if (i == 0) break;
      const int64_t previous = backpointers[(i * T + tag) * K + rank];
      if (previous >= T * K) {  // cannot happen with valid data; never read out of range
        for (int64_t j = 0; j < i; ++j) path[j] = -1;
        break;
      }
      tag = previous / K;
      rank = previous % K;
    }
  }
  for (int64_t i = unwritten_from; i < L; ++i) path[i] = -1;
}

// Every output row of sentence b (n positions), rows first, first + stride, ... on this thread
// (one backtrace each): the final merge's values and codes for a good sentence, 0 for row 0 of
// an empty one (the empty sequence), -inf otherwise (rows beyond the K = list_len sequences,
// and sentences with bad emissions). Codes are read only where the merge wrote them.
template <typename scalar_t, typename bp_t>
__device__ __forceinline__ void write_kbest_rows(const DecodeParams<scalar_t, bp_t>& p, int64_t b, int64_t n,
                                                 bool bad, const scalar_t* final_values, const int32_t* final_codes,
                                                 const bp_t* backpointers, int64_t first, int64_t stride) {
  const scalar_t kNegInf = neg_inf<scalar_t>();
  for (int64_t row = first; row < p.rows; row += stride) {
    scalar_t value = kNegInf;
    if (!bad && n == 0 && row == 0) value = 0;
    if (!bad && n > 0 && row < p.list_len) value = final_values[row];
    write_kbest_row(p, b, n, row, value, n > 0 && value != kNegInf ? final_codes[row] : 0, backpointers);
  }
}

// k-best Viterbi under the k-max-plus semiring for decode_sentences (semiring.cuh): the rows
// are the K-lists of every tag, per position and tag one lane merges the T sorted lists.
template <typename scalar_t_, typename bp_t>
struct KbestDecoder {
  using scalar_t = scalar_t_;
  const int T, G;
  const int64_t K;
  scalar_t* const rows_a;         // (T, K) [t * K + r], sorted descending; two rows in turn
  scalar_t* const rows_b;
  scalar_t* const head_values;    // this lane's column of the merge state: entry s at [s * G]
  int32_t* const heads;
  scalar_t* const final_values;   // (K,)
  int32_t* const final_codes;     // (K,)
  bp_t* const backpointers;       // [(i * T + t) * K + r]

  __device__ static int64_t list_length(const DecodeParams<scalar_t, bp_t>& p) { return p.list_len; }

  __device__ __forceinline__ KbestDecoder(const DecodeParams<scalar_t, bp_t>& p, unsigned char* arena,
                                          const DecodeGroup g)
      : KbestDecoder(p, arena, g, kbest_arena<scalar_t>(g.T, g.K, g.G)) {}

  __device__ __forceinline__ KbestDecoder(const DecodeParams<scalar_t, bp_t>& p, unsigned char* arena,
                                          const DecodeGroup g, const KbestArena layout)
      : T(g.T),
        G(g.G),
        K(g.K),
        rows_a(reinterpret_cast<scalar_t*>(arena + layout.lists_a)),
        rows_b(reinterpret_cast<scalar_t*>(arena + layout.lists_b)),
        head_values(reinterpret_cast<scalar_t*>(arena + layout.head_values) + g.lane),
        heads(reinterpret_cast<int32_t*>(arena + layout.heads) + g.lane),
        final_values(reinterpret_cast<scalar_t*>(arena + layout.final_values)),
        final_codes(reinterpret_cast<int32_t*>(arena + layout.final_codes)),
        backpointers(p.backpointers + g.slot * g.L * g.T * g.K) {}

  // Position 0: one sequence per tag, in rank 0 of its list.
  __device__ __forceinline__ void first(scalar_t* rows, int t, scalar_t value) const {
    rows[t * K] = value;
    for (int64_t r = 1; r < K; ++r) rows[t * K + r] = neg_inf<scalar_t>();
  }

  // Position i itself: the backpointers are indexed per tag, [(i * T + t) * K + r]. (Static: a
  // member call here changes nvcc's code for this kernel.)
  __device__ __forceinline__ static int64_t position(int64_t i) { return i; }

  template <typename Emission>
  __device__ __forceinline__ void step(const scalar_t* cur, scalar_t* next, const scalar_t* trans, int64_t i, int t,
                                       Emission&& emission) const {
    const scalar_t kNegInf = neg_inf<scalar_t>();
    const scalar_t e = emission();
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

  __device__ __forceinline__ void finish(const DecodeParams<scalar_t, bp_t>& p, const scalar_t* cur,
                                         const Sentence& sentence, bool bad, int lane) const {
    const scalar_t kNegInf = neg_inf<scalar_t>();
    const int64_t n = sentence.n;
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
    if (!sentence.exists) return;
    const int64_t b = sentence.b;
    if (bad && lane == 0) report(p.status, kBadEmissions, b);
    write_kbest_rows(p, b, n, bad, final_values, final_codes, backpointers, lane, G);
  }
};

template <typename scalar_t, typename bp_t, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) kbest_kernel(const DecodeParams<scalar_t, bp_t> p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  decode_sentences<KbestDecoder<scalar_t, bp_t>, kAllShared>(p, shared_raw);
}

// ---- k-best for small batches: a block per sentence, a group of lanes per tag ----------------
// kbest_kernel gives each tag's merge (K rounds, each a scan over the T list heads) to ONE
// lane, so a position costs about K * T dependent shared-memory steps: with few sentences the
// device is nearly idle and that chain is most of the time (benchmarks/results/NOTES.md has a
// timing). Here a sentence gets a whole block: one group of G lanes per tag t (G = the smallest
// power of two >= T, so T * G <= 1024 for T <= 32), and lane s of the group holds the head of
// predecessor s's list. A round of the merge is then one group_argmax
// over the heads (log2 G shuffle steps) instead of a T-step scan, and the T tags' merges run at
// once. Each lane's transition trans[s, t] and end score end[s] never change: they live in
// registers. The picks, their order and the arithmetic are those of kbest_kernel (and the CPU
// kbest_step): head = list[s][rank] + trans[s, t], the largest head wins with the smaller s
// winning a tie, out = head + emission; so the results are identical bit for bit.

// Shared memory of one block of kbest_per_tag_kernel (byte offsets).
struct PerTagPlan {
  int lanes = 1;        // G
  int threads = 32;     // T * G rounded up to whole warps
  size_t lists_a = 0, lists_b = 0;  // (T, K) scalars each: the lists of the previous / current position
  size_t final_values = 0;          // (K,) scalars: the K best totals (after end scores)
  size_t final_codes = 0;           // (K,) int32: their codes s * K + rank
  size_t backpointers = 0;          // (L, T, K) bp_t, when backpointers_in_shared
  bool backpointers_in_shared = false;
  size_t shared_bytes = 0;
};

template <typename scalar_t, typename bp_t>
PerTagPlan per_tag_plan(int64_t T, int64_t K, int64_t L) {
  PerTagPlan plan;
  plan.lanes = lanes_per_sentence(T);
  plan.threads = (int)((T * plan.lanes + kWarpSize - 1) / kWarpSize * kWarpSize);
  size_t at = 0;
  plan.lists_a = place(at, T * K * sizeof(scalar_t));
  plan.lists_b = place(at, T * K * sizeof(scalar_t));
  plan.final_values = place(at, K * sizeof(scalar_t));
  plan.final_codes = place(at, K * sizeof(int32_t));
  // The backtrace follows L dependent backpointers: from shared memory when they fit (short
  // sentences, small K), else from the global workspace.
  const size_t backpointer_bytes = align_up(L * T * K * sizeof(bp_t));
  plan.backpointers = at;
  plan.backpointers_in_shared = at + backpointer_bytes <= kSharedBudget;
  if (plan.backpointers_in_shared) at += backpointer_bytes;
  plan.shared_bytes = at;
  return plan;
}

// A merge round by round of T lists sorted in descending order, lists[s * K + r], each shifted
// by the offset of its lane: the K largest of lists[s * K + r] + offset_s over all s and r, by
// the G lanes of a group, lane s walking list s (`walks` false for lanes without a list and for
// idle groups). Round r: the group's largest head, the smaller s on a tie (the sequential merge
// scans s upwards with a strict '>'); the lane that owns it calls take(r, value, s * K + rank)
// and advances. Once only -inf is left, the rounds take -inf. Every lane of the warp runs all K
// rounds (shuffles with the full mask).
template <typename scalar_t, typename Take>
__device__ __forceinline__ void group_merge_lists(const scalar_t* lists, int64_t K, scalar_t offset, bool walks, int s,
                                                  int G, Take&& take) {
  int rank = 0;
  scalar_t head = walks ? lists[s * K] + offset : neg_inf<scalar_t>();
  for (int64_t r = 0; r < K; ++r) {
    scalar_t best = head;
    int best_s = s;
    group_argmax(best, best_s, G);
    if (best_s == s) {
      if (walks) take(r, best, (int64_t)s * K + rank);
      ++rank;
      head = walks && rank < K ? lists[s * K + rank] + offset : neg_inf<scalar_t>();
    }
  }
}

template <typename scalar_t, typename bp_t>
__global__ void __launch_bounds__(1024) kbest_per_tag_kernel(const DecodeParams<scalar_t, bp_t> p, const PerTagPlan plan) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int T = p.num_tags;
  const int G = plan.lanes;
  const int t = threadIdx.x / G;  // the tag this lane's group merges for (t >= T: an idle group)
  const int s = threadIdx.x % G;  // the predecessor whose list the lane walks (s >= T: none)
  const bool walks = t < T && s < T;
  const int64_t L = p.max_len;
  const int64_t K = p.list_len;
  const scalar_t kNegInf = neg_inf<scalar_t>();
  const scalar_t transition = walks ? p.transitions[s * T + t] : scalar_t(0);  // trans[s, t]
  const scalar_t end_score = s < T ? p.end[s] : scalar_t(0);                   // for the final merge
  check_inputs(p.checks);

  scalar_t* const lists_a = reinterpret_cast<scalar_t*>(shared_raw + plan.lists_a);  // [t * K + r]
  scalar_t* const lists_b = reinterpret_cast<scalar_t*>(shared_raw + plan.lists_b);
  scalar_t* const final_values = reinterpret_cast<scalar_t*>(shared_raw + plan.final_values);
  int32_t* const final_codes = reinterpret_cast<int32_t*>(shared_raw + plan.final_codes);
  bp_t* const backpointers = plan.backpointers_in_shared  // [(i * T + t) * K + r]
                                 ? reinterpret_cast<bp_t*>(shared_raw + plan.backpointers)
                                 : p.backpointers + (int64_t)blockIdx.x * L * T * K;

  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    __syncthreads();  // the previous sentence (backtrace included) is finished by every lane
    const int64_t n = safe_length(p.lengths, b, L);
    const scalar_t* emit = p.emissions + b * L * T;
    bool bad = false;  // this lane saw a NaN / +inf emission
    for (int64_t x = threadIdx.x; x < T * K; x += blockDim.x) {  // position 0: rank 0 of each list
      const int64_t tag = x / K;
      lists_a[x] = x % K == 0 && n > 0 ? p.start[tag] + emit[tag] : kNegInf;
      if (x % K == 0 && n > 0) bad |= is_nan_or_pos_inf(emit[tag]);
    }
    scalar_t* cur = lists_a;
    scalar_t* next = lists_b;
    // The group's emission, loaded one position ahead (its latency overlaps a whole step).
    scalar_t emit_ahead = t < T && n > 1 ? emit[T + t] : scalar_t(0);
    __syncthreads();  // position 0's lists are complete
    for (int64_t i = 1; i < n; ++i) {
      const scalar_t e = emit_ahead;
      if (t < T && i + 1 < n) emit_ahead = emit[(i + 1) * T + t];
      if (walks && s == 0) bad |= is_nan_or_pos_inf(e);
      scalar_t* out = next + t * K;
      bp_t* bp = backpointers + (i * T + t) * K;
      group_merge_lists(cur, K, transition, walks, s, G, [&](int64_t r, scalar_t best, int64_t code) {
        if (best == kNegInf) {  // no sequence left for this slot
          out[r] = kNegInf;
        } else {
          out[r] = best + e;
          bp[r] = static_cast<bp_t>(code);
        }
      });
      __syncthreads();  // next is complete, and nobody reads cur any more
      scalar_t* swap = cur;
      cur = next;
      next = swap;
    }
    const bool sentence_bad = __syncthreads_or(bad) != 0;
    // The K best over last tags (with the end scores): group 0's lanes walk the lists; the rest
    // of warp 0 joins the shuffles only.
    if (threadIdx.x < kWarpSize && n > 0 && !sentence_bad) {
      group_merge_lists(cur, K, end_score, t == 0 && s < T, s, G, [&](int64_t r, scalar_t best, int64_t code) {
        final_values[r] = best;
        final_codes[r] = static_cast<int32_t>(code);
      });
    }
    __syncthreads();  // final_values / final_codes and every backpointer visible to the block
    if (sentence_bad && threadIdx.x == 0) report(p.status, kBadEmissions, b);
    write_kbest_rows(p, b, n, sentence_bad, final_values, final_codes, backpointers, threadIdx.x, blockDim.x);
  }
}

// Which k-best kernel runs: CRFKIT_CUDA_KBEST_KERNEL =
//   per_sentence  (the default) kbest_kernel always;
//   per_tag       kbest_per_tag_kernel wherever it applies (launch_kbest_per_tag), else kbest_kernel;
//   auto          kbest_per_tag_kernel where it applies, K <= 5 and the batch is small (at most
//                 two sentences per multiprocessor), else kbest_kernel.
// Timed on a GPU (benchmarks/results/gpu_nvidia_h200_notes.md), the per-tag kernel is a few
// percent faster only in auto's cases and clearly slower elsewhere (large batches, larger K),
// so it is not the default. Tests run both kernels on the same inputs.
enum class KbestKernel { kPerSentence, kPerTag, kAuto };

KbestKernel kbest_kernel_choice() {
  const char* value = std::getenv("CRFKIT_CUDA_KBEST_KERNEL");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "per_sentence") == 0) return KbestKernel::kPerSentence;
  if (std::strcmp(value, "per_tag") == 0) return KbestKernel::kPerTag;
  if (std::strcmp(value, "auto") == 0) return KbestKernel::kAuto;
  CRFKIT_CHECK_VALUE(false, "crfkit: the environment variable CRFKIT_CUDA_KBEST_KERNEL must be per_sentence, per_tag "
                    "or auto, got '", value, "'");
}

// Launches kbest_per_tag_kernel and returns true, or returns false (nothing launched) where it
// does not apply (T > 32: a group per tag would not fit in a block; lists too large for shared
// memory) or, unless `forced`, outside auto's cases (K <= 5, at most two sentences per multiprocessor).
template <typename scalar_t, typename bp_t>
bool launch_kbest_per_tag(const CrfArgs& a, int64_t rows, int64_t K, bool forced, Tensor& scores,
                          Tensor& paths, Status& status, const LogProbOutputs& log_probs) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const PerTagPlan plan = per_tag_plan<scalar_t, bp_t>(T, K, L);
  if (T > kWarpSize || plan.backpointers > kSharedBudget) return false;
  if (B == 0) return true;
  if (!forced) {
    if (K > 5) return false;
    if (B > 2 * (int64_t)current_device_attribute(cudaDevAttrMultiProcessorCount)) return false;
  }
  const auto kernel = kbest_per_tag_kernel<scalar_t, bp_t>;
  SharedPlan one_sentence_per_block;
  one_sentence_per_block.threads = plan.threads;
  one_sentence_per_block.groups_per_block = 1;
  one_sentence_per_block.shared_bytes = plan.shared_bytes;
  const int64_t resident = persistent_blocks(kernel, one_sentence_per_block, B);
  if (!forced && resident < B) return false;
  const int64_t per_block = L * T * K * (int64_t)sizeof(bp_t);  // > 0 when not in shared memory
  const int64_t blocks = plan.backpointers_in_shared
                             ? resident
                             : std::min(resident, std::max<int64_t>(1, kBackpointerBudget / per_block));
  const auto bytes = options_of(a.emissions).dtype(kByte);
  Tensor backpointers = plan.backpointers_in_shared ? Tensor() : empty({std::max<int64_t>(1, blocks * per_block)}, bytes);

  const auto params = decode_params<scalar_t, bp_t>(a, rows, K, scores, paths, backpointers, status, log_probs);
  kernel<<<(unsigned)blocks, plan.threads, plan.shared_bytes, current_stream()>>>(params, plan);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace

// log_probs (B, k) = scores - log Z (viterbi_common.cuh), log Z clamped to the lowest finite value as
// reference.log_probs_from_scores does (so missing rows stay -inf), by two aten ops.
Tensor log_probs_from_scores(const Tensor& scores, const Tensor& log_z) {
  const double lowest = scores.scalar_type() == kFloat ? std::numeric_limits<float>::lowest()
                                                           : std::numeric_limits<double>::lowest();
  // clamp_min(log_z, lowest) as a boxed call of aten::clamp_min.Tensor (the stable ABI has no
  // clamp): the bound is a 0-dim tensor on log_z's device, broadcast.
  std::array<StableIValue, 2> stack{
      torch::stable::detail::from(log_z),
      torch::stable::detail::from(full({}, lowest, options_of(log_z)))};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::clamp_min", "Tensor", stack.data(), TORCH_ABI_VERSION));
  const Tensor clamped = torch::stable::detail::to<Tensor>(stack[0]);
  return torch::stable::subtract(scores, torch::stable::unsqueeze(clamped, 1));
}

namespace {

// scores (B, k), paths (B, k, L) int64: the k best distinct sequences per sentence, descending;
// rows beyond the number of allowed sequences hold -1 / -inf. With log_z (B,) given (queued on
// the stream before), also log_probs (B, k) = log_probs_from_scores(scores, log_z), written by
// the k-best kernel with the scores (bit for bit the same subtraction, two launches fewer).
struct KbestOutputs {
  Tensor scores, paths, log_probs;
};

KbestOutputs launch_kbest_viterbi(const CrfArgs& a, int64_t k, Status& status, const Tensor& log_z = {}) {
  CRFKIT_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule: use the cheaper kernel
    auto [best_scores, best_paths] = launch_viterbi(a, status);
    const Tensor scores = torch::stable::unsqueeze(best_scores, 1);
    return {scores, torch::stable::unsqueeze(best_paths, 1), log_z.defined() ? log_probs_from_scores(scores, log_z) : Tensor()};
  }
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  // No sentence has more than T^L sequences, so lists longer than that only hold -inf.
  const int64_t K = num_sequences_capped(T, L, k);
  check_sizes(T, K);
  // Written whole by the kernels: no fill launches (host time, issue 30).
  Tensor paths = empty({B, k, L}, options_of(a.lengths));
  Tensor scores = empty({B, k}, options_of(a.emissions));
  const LogProbOutputs log_probs{log_z, log_z.defined() ? empty({B, k}, options_of(a.emissions)) : Tensor()};
  const KbestKernel choice = kbest_kernel_choice();
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_kbest_viterbi_cuda", [&] {
    const int G = lanes_per_sentence(T);
    const size_t arena_bytes = kbest_arena<scalar_t>(T, K, G).bytes;
    dispatch_backpointer_type(T * K, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      if (choice != KbestKernel::kPerSentence &&
          launch_kbest_per_tag<scalar_t, bp_t>(a, k, K, choice == KbestKernel::kPerTag, scores, paths, status,
                                               log_probs)) {
        return;
      }
      launch_decoder<scalar_t, bp_t>(kbest_kernel<scalar_t, bp_t, true>, kbest_kernel<scalar_t, bp_t, false>, a, k,
                                     K, arena_bytes, scores, paths, status, log_probs);
    });
  });
  return {scores, paths, log_probs.log_probs};
}

std::tuple<Tensor, Tensor> kbest_viterbi_cuda(const Tensor& emissions, const Tensor& transitions,
                                                      int64_t k, const Tensor& lengths,
                                                      const Tensor& start, const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) return kbest_viterbi_per_example(emissions, transitions, k, lengths, start, end);
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    KbestOutputs out = launch_kbest_viterbi(a, k, status);
    return std::make_tuple(out.scores, out.paths);
  });
}

// kbest_viterbi's outputs and log_probs (B, k) = scores - log Z (log Z clamped to the lowest
// finite value, as reference.log_probs_from_scores does, so missing rows stay -inf): log Z's
// kernels, then the k-best kernel, which writes the log-probabilities with the scores, then one
// status read, where the two ops called in turn read theirs twice.
std::tuple<Tensor, Tensor, Tensor> kbest_viterbi_with_log_probs_cuda(
    const Tensor& emissions, const Tensor& transitions, int64_t k, const Tensor& lengths,
    const Tensor& start, const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) {
    return kbest_viterbi_with_log_probs_per_example(emissions, transitions, k, lengths, start, end);
  }
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    const Tensor log_z = launch_log_partition(a, status);
    KbestOutputs out = launch_kbest_viterbi(a, k, status, log_z);
    return std::make_tuple(out.scores, out.paths, out.log_probs);
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("kbest_viterbi", TORCH_BOX(&kbest_viterbi_cuda));
  m.impl("kbest_viterbi_with_log_probs", TORCH_BOX(&kbest_viterbi_with_log_probs_cuda));
}

}  // namespace cuda
}  // namespace crfkit
