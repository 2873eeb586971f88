// Autograd formulas of the crfkit ops, registered for the Autograd dispatch key (so for every
// device: the backward of each op is itself an op, e.g. log_partition_backward, dispatched to
// the kernels of the inputs' device).
//
// Why C++ and not torch.library.register_autograd in Python: with the Python formulas every
// differentiable call passed through Python's autograd wrapper twice (forward and backward:
// argument defaults, a Python autograd.Function, our Python backward), which cost more than the
// kernels themselves on small batches (benchmarks/results/NOTES.md has the timing). Here a call
// costs the C++ autograd node only.
//
// The marginals keep their Python formula (crfkit/backends/compiled.py): their derivative is a
// Hessian-vector product of log Z, the op marginals_backward where the device has a kernel for
// it (the CPU and CUDA), else taken through the reference implementation. marginals_backward
// itself has no derivative: its outputs raise when differentiated (marginals_backward_autograd
// below).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace crfkit {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// The gradients of the four score tensors, in the ops' order: emissions, transitions, start, end.
using EmitTransStartEndGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The crfkit op `name` with C++ signature Signature, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The gradients of an op's inputs, in the ops' argument order: emissions, transitions, then
// `undefined` empty gradients for the arguments that have none (k or tags, lengths), then start
// and end.
variable_list input_grads(const EmitTransStartEndGrads& grads, int undefined) {
  variable_list out = {std::get<0>(grads), std::get<1>(grads)};
  out.resize(2 + undefined);
  out.push_back(std::get<2>(grads));
  out.push_back(std::get<3>(grads));
  return out;
}

// Gradient of path scores: ones at the emissions / transitions / start / end each path uses.
// grad_scores (B, N), tags (B, N, L).
EmitTransStartEndGrads path_score_grads(const at::Tensor& grad_scores, const at::Tensor& emissions,
                                        const at::Tensor& tags, const at::Tensor& lengths) {
  static const auto op = op_handle<EmitTransStartEndGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&)>("crfkit::sequence_score_backward");
  return op.call(grad_scores.contiguous(), emissions, tags, lengths);
}

// The forward ops, looked up once.
using Crf = const at::Tensor&;  // the five CRF arguments: emissions, transitions, lengths, start, end
using DecodeOutputs = std::tuple<at::Tensor, at::Tensor>;               // scores, paths

const auto& log_partition_op() {
  static const auto op = op_handle<at::Tensor(Crf, Crf, Crf, Crf, Crf)>("crfkit::log_partition");
  return op;
}
const auto& viterbi_op() {
  static const auto op = op_handle<DecodeOutputs(Crf, Crf, Crf, Crf, Crf)>("crfkit::viterbi");
  return op;
}
const auto& kbest_viterbi_op() {
  static const auto op = op_handle<DecodeOutputs(Crf, Crf, int64_t, Crf, Crf, Crf)>("crfkit::kbest_viterbi");
  return op;
}
const auto& sequence_score_op() {
  static const auto op =
      op_handle<at::Tensor(Crf, Crf, const at::Tensor&, Crf, Crf, Crf)>("crfkit::sequence_score");
  return op;
}

// Whether a call records a backward: grad mode on and some score tensor requiring grad. When it
// does not, autograd_kernel calls the op under the autograd key directly: the
// autograd::Function machinery (a node, its saved inputs, output wrapping) is a measurable share
// of a small no-grad call (benchmarks/results/NOTES.md).
bool records_backward(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                      const at::Tensor& end) {
  return at::GradMode::is_enabled() && (emissions.requires_grad() || transitions.requires_grad() ||
                                        start.requires_grad() || end.requires_grad());
}

// An op's outputs (at::Tensor or a tuple of them) from those of its autograd::Function::apply.
template <typename Outputs>
Outputs as_outputs(const at::Tensor& output) {
  return output;
}
template <typename Outputs>
Outputs as_outputs(const variable_list& outputs) {
  return [&]<size_t... I>(std::index_sequence<I...>) { return Outputs{outputs[I]...}; }(
      std::make_index_sequence<std::tuple_size_v<Outputs>>{});
}

// The Autograd-key kernel of op: its autograd::Function when the call records a backward
// (`records`: records_backward of the call's score tensors), otherwise the op itself below the
// autograd key.
template <typename Function, typename Op, typename... Args>
auto autograd_kernel(bool records, const Op& op, const Args&... args) {
  using Outputs = decltype(op.call(args...));
  if (!records) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(args...);
  }
  return as_outputs<Outputs>(Function::apply(args...));
}

// ---- log Z --------------------------------------------------------------------------------------
// Where the device has a log_partition_with_marginals kernel (CPU and CUDA), a differentiable log Z
// computes its gradients for an upstream gradient of 1 in the forward, while the forward rows
// are in cache, and the backward only scales them: the backward is linear in the upstream
// gradient. (A forward that saves its rows, 16 B L T bytes, for a backward that reads them back
// measured slower: benchmarks/results/NOTES.md.) The cost: a differentiable log Z that is never
// differentiated does the backward's work too; evaluate under torch.no_grad(). On CUDA it also
// saves a second kernel launch and status read: log_partition_backward re-runs the
// forward-backward kernel (it stays the path of a device without log_partition_with_marginals).
bool computes_marginals_in_forward(const at::Tensor& emissions) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("crfkit::log_partition_with_marginals", "");
  return op.hasKernelForDispatchKey(c10::computeDispatchKey(std::nullopt, emissions.layout(), emissions.device()));
}

using MarginalsOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // log_z, marginals, counts

const auto& log_partition_with_marginals_op() {
  static const auto op = op_handle<MarginalsOutputs(Crf, Crf, Crf, Crf, Crf)>("crfkit::log_partition_with_marginals");
  return op;
}

const auto& log_partition_backward_from_marginals_op() {
  static const auto op =
      op_handle<EmitTransStartEndGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "crfkit::log_partition_backward_from_marginals");
  return op;
}

// The gradients from the marginals are not differentiable (the marginals' derivative is not
// recorded). When the backward itself is recorded (create_graph=True), they get a node that
// raises as soon as a second derivative passes through it, instead of a silently incomplete
// one: its edges lead to the upstream gradient and to the score tensors, so any derivative
// that depends on them reaches it.
//
// torch 2.13 holds autograd nodes in c10::intrusive_ptr, earlier versions (2.11 on the GPU
// machine) in std::shared_ptr: the node is made in whichever handle wrap_outputs' constructor
// returns. (NodeT is a template parameter so that the branch not taken is never instantiated.)
using NodeHandle = torch::autograd::function_constructor::result_type;

template <class NodeT, class... Args>
NodeHandle make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodeHandle, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  }
}

constexpr const char* kLogZOnce =
    "crfkit: the gradient of log Z is differentiable once only; for second derivatives use "
    "the reference backend (crfkit.use_backend(\"reference\"))";

EmitTransStartEndGrads once_differentiable(EmitTransStartEndGrads grads, const variable_list& inputs,
                                           const char* message = kLogZOnce) {
  if (!at::GradMode::is_enabled()) return grads;
  torch::autograd::tensor_list outputs = {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads),
                                          std::get<3>(grads)};
  auto error_node = [message](torch::autograd::edge_list&& edges) {
    return make_node<torch::autograd::Error>(message, std::move(edges));
  };
  const variable_list out = torch::autograd::wrap_outputs(inputs, std::move(outputs), error_node);
  return {out[0], out[1], out[2], out[3]};
}

struct LogPartition : torch::autograd::Function<LogPartition> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& emissions, const at::Tensor& transitions,
                            const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (computes_marginals_in_forward(emissions)) {
      auto [log_z, marginals, counts] =
          log_partition_with_marginals_op().call(emissions, transitions, lengths, start, end);
      // The score tensors serve only as the edges of once_differentiable's node (and, like any
      // saved input, make an in-place change of them before the backward an error).
      ctx->save_for_backward({emissions, transitions, lengths, start, end, marginals, counts});
      return log_z;
    }
    ctx->save_for_backward({emissions, transitions, lengths, start, end});
    return log_partition_op().call(emissions, transitions, lengths, start, end);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    if (saved.size() == 7) {  // the inputs, then marginals and counts
      EmitTransStartEndGrads from_marginals;
      {
        at::AutoDispatchBelowADInplaceOrView below_autograd;  // not differentiable: see once_differentiable
        from_marginals = log_partition_backward_from_marginals_op().call(g, saved[5], saved[6], saved[2]);
      }
      const variable_list differentiated = {g, saved[0], saved[1], saved[3], saved[4]};
      return input_grads(once_differentiable(std::move(from_marginals), differentiated), 1);
    }
    static const auto op =
        op_handle<EmitTransStartEndGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&)>("crfkit::log_partition_backward");
    return input_grads(op.call(g, saved[0], saved[1], saved[2], saved[3], saved[4]), 1);
  }
};

at::Tensor log_partition_autograd(const at::Tensor& emissions, const at::Tensor& transitions,
                                  const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
  return autograd_kernel<LogPartition>(records_backward(emissions, transitions, start, end), log_partition_op(),
                                       emissions, transitions, lengths, start, end);
}

// ---- decoders: the scores are differentiable (sums of the scores the paths use) ----------------
struct Viterbi : torch::autograd::Function<Viterbi> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& emissions, const at::Tensor& transitions,
                               const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [scores, paths] = viterbi_op().call(emissions, transitions, lengths, start, end);
    ctx->save_for_backward({emissions, lengths, paths});
    ctx->mark_non_differentiable({paths});
    return {scores, paths};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // emissions, lengths, paths (B, L)
    return input_grads(path_score_grads(grads[0].unsqueeze(1), saved[0], saved[2].unsqueeze(1), saved[1]), 1);
  }
};

DecodeOutputs viterbi_autograd(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& lengths,
                               const at::Tensor& start, const at::Tensor& end) {
  return autograd_kernel<Viterbi>(records_backward(emissions, transitions, start, end), viterbi_op(), emissions,
                                  transitions, lengths, start, end);
}

struct KBestViterbi : torch::autograd::Function<KBestViterbi> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& emissions, const at::Tensor& transitions,
                               int64_t k, const at::Tensor& lengths, const at::Tensor& start,
                               const at::Tensor& end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [scores, paths] = kbest_viterbi_op().call(emissions, transitions, k, lengths, start, end);
    ctx->save_for_backward({emissions, lengths, paths});
    ctx->mark_non_differentiable({paths});
    return {scores, paths};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // emissions, lengths, paths (B, K, L)
    return input_grads(path_score_grads(grads[0], saved[0], saved[2], saved[1]), 2);
  }
};

DecodeOutputs kbest_viterbi_autograd(const at::Tensor& emissions, const at::Tensor& transitions, int64_t k,
                                     const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
  return autograd_kernel<KBestViterbi>(records_backward(emissions, transitions, start, end), kbest_viterbi_op(),
                                       emissions, transitions, k, lengths, start, end);
}

// ---- the score of given tag sequences ------------------------------------------------------------
struct SequenceScore : torch::autograd::Function<SequenceScore> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& emissions, const at::Tensor& transitions,
                            const at::Tensor& tags, const at::Tensor& lengths, const at::Tensor& start,
                            const at::Tensor& end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({emissions, lengths, tags});
    return sequence_score_op().call(emissions, transitions, tags, lengths, start, end);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // emissions, lengths, tags (B, N, L)
    return input_grads(path_score_grads(grads[0], saved[0], saved[2], saved[1]), 2);
  }
};

at::Tensor sequence_score_autograd(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& tags,
                                   const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
  return autograd_kernel<SequenceScore>(records_backward(emissions, transitions, start, end), sequence_score_op(),
                                        emissions, transitions, tags, lengths, start, end);
}

// ---- the marginals' backward ------------------------------------------------------------------
// marginals_backward (the marginals' vector-Jacobian product, a second derivative of log Z) has
// no derivative of its own: a third one is not needed. As for the gradient of log Z above, when
// a call is recorded (the marginals differentiated with create_graph=True, or the op called on
// tensors that require grad) its outputs get a node that raises as soon as a derivative passes
// through it, instead of a silently missing one.
using SecondDerivativeOp = c10::TypedOperatorHandle<EmitTransStartEndGrads(Crf, Crf, Crf, Crf, Crf, Crf)>;

// op (marginals_backward or expected_transition_counts_backward) below autograd, its outputs
// made once-differentiable with `message`.
EmitTransStartEndGrads second_derivative(const SecondDerivativeOp& op, const char* message,
                                         const at::Tensor& grad, const at::Tensor& emissions,
                                         const at::Tensor& transitions, const at::Tensor& lengths,
                                         const at::Tensor& start, const at::Tensor& end) {
  EmitTransStartEndGrads grads;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    grads = op.call(grad, emissions, transitions, lengths, start, end);
  }
  return once_differentiable(std::move(grads), {grad, emissions, transitions, start, end}, message);
}

EmitTransStartEndGrads marginals_backward_autograd(const at::Tensor& grad_marginals, const at::Tensor& emissions,
                                                   const at::Tensor& transitions, const at::Tensor& lengths,
                                                   const at::Tensor& start, const at::Tensor& end) {
  static const auto op = op_handle<EmitTransStartEndGrads(Crf, Crf, Crf, Crf, Crf, Crf)>("crfkit::marginals_backward");
  return second_derivative(
      op,
      "crfkit: the gradient of the marginals (marginals_backward) is not differentiable; for third "
      "derivatives of log Z use the reference backend (crfkit.use_backend(\"reference\"))",
      grad_marginals, emissions, transitions, lengths, start, end);
}

// The same for the expected transition counts' vector-Jacobian product.
EmitTransStartEndGrads expected_transition_counts_backward_autograd(
    const at::Tensor& grad_counts, const at::Tensor& emissions, const at::Tensor& transitions,
    const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end) {
  static const auto op = op_handle<EmitTransStartEndGrads(Crf, Crf, Crf, Crf, Crf, Crf)>(
      "crfkit::expected_transition_counts_backward");
  return second_derivative(
      op,
      "crfkit: the gradient of the expected transition counts (expected_transition_counts_backward) is "
      "not differentiable; for third derivatives of log Z use the reference backend "
      "(crfkit.use_backend(\"reference\"))",
      grad_counts, emissions, transitions, lengths, start, end);
}

// kbest_viterbi_with_log_probs has no derivative: a call that would record one raises instead of
// returning outputs that silently carry no gradient.
using KBestLogProbsOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // scores, paths, log_probs

KBestLogProbsOutputs kbest_viterbi_with_log_probs_autograd(const at::Tensor& emissions, const at::Tensor& transitions,
                                                           int64_t k, const at::Tensor& lengths,
                                                           const at::Tensor& start, const at::Tensor& end) {
  TORCH_CHECK(!records_backward(emissions, transitions, start, end),
              "crfkit: kbest_viterbi_with_log_probs is not differentiable; call it under torch.no_grad(), or "
              "use kbest_viterbi and log_partition (crfkit.kbest_viterbi does)");
  static const auto op =
      op_handle<KBestLogProbsOutputs(Crf, Crf, int64_t, Crf, Crf, Crf)>("crfkit::kbest_viterbi_with_log_probs");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(emissions, transitions, k, lengths, start, end);
}

}  // namespace

TORCH_LIBRARY_IMPL(crfkit, Autograd, m) {
  m.impl("log_partition", &log_partition_autograd);
  m.impl("viterbi", &viterbi_autograd);
  m.impl("kbest_viterbi", &kbest_viterbi_autograd);
  m.impl("kbest_viterbi_with_log_probs", &kbest_viterbi_with_log_probs_autograd);
  m.impl("marginals_backward", &marginals_backward_autograd);
  m.impl("expected_transition_counts_backward", &expected_transition_counts_backward_autograd);
  m.impl("sequence_score", &sequence_score_autograd);
}

}  // namespace crfkit
