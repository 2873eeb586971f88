// CUDA kernel: Viterbi, the whole time loop and the backtrace in one launch, with results
// identical to the CPU kernel (csrc/cpu/viterbi.cpp) bit for bit. The layout, the arithmetic and
// the tie rule are described in viterbi_common.cuh, which holds what Viterbi shares with k-best
// (kbest.cu).
#include "common.cuh"
#include "per_example.cuh"
#include "viterbi_common.cuh"
#include "viterbi_chunked.cuh"

namespace crfkit {
namespace cuda {
namespace {

// Viterbi under the max-plus semiring for decode_sentences (semiring.cuh): the rows are delta
// (one score per tag), per position and tag one lane scans the T predecessors.
template <typename scalar_t_, typename bp_t>
struct ViterbiDecoder {
  using scalar_t = scalar_t_;
  const int T, G;
  const int64_t L;
  scalar_t* const rows_a;        // (T,) delta, two rows in turn
  scalar_t* const rows_b;        // (T,)
  bp_t* const backpointers;      // [i * T + t]: best predecessor of t at i

  __device__ static int64_t list_length(const DecodeParams<scalar_t, bp_t>&) { return 1; }

  __device__ __forceinline__ ViterbiDecoder(const DecodeParams<scalar_t, bp_t>& p, unsigned char* arena,
                                            const DecodeGroup g)
      : T(g.T),
        G(g.G),
        L(g.L),
        rows_a(reinterpret_cast<scalar_t*>(arena)),
        rows_b(reinterpret_cast<scalar_t*>(arena) + g.T),
        backpointers(p.backpointers + g.slot * g.L * g.T) {}

  __device__ __forceinline__ void first(scalar_t* rows, int t, scalar_t value) const { rows[t] = value; }

  // The backpointers of position i, [t].
  __device__ __forceinline__ bp_t* position(int64_t i) const { return backpointers + i * T; }

  template <typename Emission>
  __device__ __forceinline__ void step(const scalar_t* cur, scalar_t* next, const scalar_t* trans, bp_t* bp_i, int t,
                                       Emission&& emission) const {
    scalar_t best = cur[0] + trans[t];
    int arg = 0;
    for (int s = 1; s < T; ++s) {
      const scalar_t candidate = cur[s] + trans[s * T + t];
      if (candidate > best) {  // strict: the smaller predecessor wins a tie
        best = candidate;
        arg = s;
      }
    }
    const scalar_t e = emission();
    next[t] = best + e;
    bp_i[t] = static_cast<bp_t>(arg);
  }

  __device__ __forceinline__ void finish(const DecodeParams<scalar_t, bp_t>& p, const scalar_t* cur,
                                         const Sentence& sentence, bool bad, int lane) const {
    const int64_t n = sentence.n;
    // Best last tag: ascending scan per lane (first maximum), then the group's smallest index.
    int best_tag = T;  // "none" for lanes without tags: loses every tie against a real tag
    scalar_t best = neg_inf<scalar_t>();
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
    if (!sentence.exists) return;
    // The path row is written whole (the host does not fill it): lane 0 backtraces [0, n) where
    // a best sequence exists (-inf: every sequence forbidden), the group writes -1 elsewhere.
    const bool has_path = !bad && n > 0 && best != neg_inf<scalar_t>() && best_tag < T;
    int64_t* path = p.paths + sentence.b * L;
    for (int64_t i = (has_path ? n : 0) + lane; i < L; i += G) path[i] = -1;
    if (lane != 0) return;
    if (bad) {
      report(p.status, kBadEmissions, sentence.b);
    } else if (n == 0) {
      p.scores[sentence.b] = 0;  // the empty sequence; its path is all -1
    } else {
      p.scores[sentence.b] = best;
      if (has_path) {
        int tag = best_tag;
        for (int64_t i = n - 1; i >= 0; --i) {
          path[i] = tag;
          if (i == 0) break;
          const uint32_t code = backpointers[i * T + tag];
          if (code >= (uint32_t)T) {  // cannot happen with valid data; never read out of range
            for (int64_t j = 0; j < i; ++j) path[j] = -1;
            break;
          }
          tag = (int)code;
        }
      }
    }
  }
};

template <typename scalar_t, typename bp_t, bool kAllShared>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) viterbi_kernel(const DecodeParams<scalar_t, bp_t> p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  decode_sentences<ViterbiDecoder<scalar_t, bp_t>, kAllShared>(p, shared_raw);
}

}  // namespace

namespace {

// ---- parallel in time (viterbi_chunked.cuh; the choice: time_chunk_length, common.cu) -----------
// The chunked Viterbi of one call, T <= kLanes within the register kernels' range, chunks of S.
template <typename scalar_t, int kLanes>
void launch_viterbi_chunked(const CrfArgs& a, int64_t S, Tensor& scores, Tensor& paths, Status& status) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const int64_t C = (L + S - 1) / S;
  const auto options = options_of(a.emissions);
  const cudaStream_t stream = current_stream();
  Tensor matrices = empty({B * C * T * T}, options);
  Tensor boundary = empty({B * C * T}, options);
  Tensor last_delta = empty({B * T}, options);
  Tensor backpointers = empty({B * L * T}, options.dtype(kByte));
  Tensor maps = empty({B * C * T}, options.dtype(kByte));
  Tensor end_tags = empty({B * C}, options.dtype(kInt));  // written whole by the finish kernel
  Tensor bad = empty({B}, options.dtype(kInt));
  // Zeroed by a memset: on the host a fraction of an aten fill's time.
  CRFKIT_CUDA_CHECK(cudaMemsetAsync(bad.mutable_data_ptr<int>(), 0, B * sizeof(int), stream));

  ViterbiChunkParams<scalar_t> params;
  set_chunk_arguments<scalar_t>(params, a, S, C, matrices, status);
  params.checks = input_checks<scalar_t>(a, status);
  params.boundary = boundary.mutable_data_ptr<scalar_t>();
  params.last_delta = last_delta.mutable_data_ptr<scalar_t>();
  params.backpointers = backpointers.mutable_data_ptr<uint8_t>();
  params.maps = maps.mutable_data_ptr<uint8_t>();
  params.end_tags = end_tags.mutable_data_ptr<int>();
  params.bad = bad.mutable_data_ptr<int>();
  params.scores = scores.mutable_data_ptr<scalar_t>();
  params.paths = paths.mutable_data_ptr<int64_t>();
  const auto groups = chunk_group_blocks<kLanes>;

  viterbi_chunk_transfer_kernel<scalar_t, kLanes><<<groups(B * C * T), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  viterbi_chunk_scan_kernel<scalar_t, kLanes><<<groups(B), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  viterbi_chunk_decode_kernel<scalar_t, kLanes><<<groups(B * C), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  const int finish_threads = (int)std::min<int64_t>((C + kWarpSize - 1) / kWarpSize * kWarpSize, kMaxThreadsPerBlock);
  viterbi_chunk_finish_kernel<scalar_t><<<(unsigned)B, finish_threads, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// The decoders' launches, for arguments checked by checked_cuda_args, their values checked into
// `status` by the first kernel (input_checks); the ops below raise from `status` once everything is launched.
// scores (B,), paths (B, L) int64 (-1 at padded positions and where no sequence is allowed).
std::tuple<Tensor, Tensor> launch_viterbi(const CrfArgs& a, Status& status) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  check_sizes(T, 1);
  Tensor paths = empty({B, L}, options_of(a.lengths));  // written whole by the kernels
  Tensor scores = empty({B}, options_of(a.emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_viterbi_cuda", [&] {
    // Long sentences at small batch: parallel in time, for the register kernels' tag counts.
    if (T <= register_max_tags<scalar_t>()) {
      if (const int64_t S = time_chunk_length(B, L, T, register_lanes(T))) {
        dispatch_register_lanes<scalar_t>(T, [&](auto lanes) {
          launch_viterbi_chunked<scalar_t, decltype(lanes)::value>(a, S, scores, paths, status);
        });
        return;
      }
    }
    dispatch_backpointer_type(T, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      launch_decoder<scalar_t, bp_t>(viterbi_kernel<scalar_t, bp_t, true>, viterbi_kernel<scalar_t, bp_t, false>, a,
                                     1, 1, align_up(2 * T * sizeof(scalar_t)), scores, paths, status);
    });
  });
  return {scores, paths};
}

namespace {

std::tuple<Tensor, Tensor> viterbi_cuda(const Tensor& emissions, const Tensor& transitions,
                                                const Tensor& lengths, const Tensor& start,
                                                const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) return viterbi_per_example(emissions, transitions, lengths, start, end);
  return checked_launch(emissions, transitions, lengths, start, end,
                        [](const CrfArgs& a, Status& status) { return launch_viterbi(a, status); });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("viterbi", TORCH_BOX(&viterbi_cuda));
}

}  // namespace cuda
}  // namespace crfkit
