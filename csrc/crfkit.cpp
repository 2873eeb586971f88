// The crfkit operator library: one schema per op, nothing else. The CPU kernels are registered
// by csrc/cpu/dispatch.cpp (the copy for this CPU's instruction set), the CUDA kernels by
// csrc/cuda/*.cu; the autograd formulas and the fake (meta) implementations from Python
// (crfkit/backends/compiled.py, crfkit/backends/op_table.py).
//
// Built against torch's stable C ABI only (csrc/tensor.h), and against Python's limited API
// (Py_LIMITED_API, set by the build: an abi3 module), so one binary serves every torch from the
// targeted version on and every Python from 3.10 on. The library also loads without Python's
// import machinery: torch.ops.load_library(path) registers the ops (a torch.export /
// AOTInductor package needs nothing else).
//
// Shapes: emissions (B, L, T); transitions (T, T) as [from, to]; start, end (T,);
// lengths (B,) int64; tags (B, N, L) int64. The CPU kernels also take per-example transitions
// (B, Lt, T, T), Lt = 1 or L, with start, end (B, T) (csrc/cpu/per_example.h).
#include <Python.h>

#include "tensor.h"

#include "cpu/dispatch.h"
#include "cpu/recycled_memory.h"

namespace {

// crfkit._C.release_cached_memory() -> int: frees the recycled buffers
// (csrc/cpu/recycled_memory.h) and returns the bytes freed.
PyObject* release_cached_memory(PyObject*, PyObject*) {
  return PyLong_FromLongLong(crfkit::cpu::release_recycled_memory());
}

// crfkit._C.cached_memory() -> int: the bytes kept now.
PyObject* cached_memory(PyObject*, PyObject*) {
  return PyLong_FromLongLong(crfkit::cpu::recycled_memory_bytes());
}

// crfkit._C.cpu_isa() -> str: the copy of the CPU kernels in use (csrc/cpu/dispatch.h).
PyObject* cpu_isa(PyObject*, PyObject*) { return PyUnicode_FromString(crfkit::cpu::cpu_isa_in_use()); }

// crfkit._C.recycles_memory() -> bool: whether this build keeps freed buffers for reuse (it
// needs torch 2.11's stable ABI: a build targeting 2.10 allocates afresh; recycled_memory.h).
PyObject* recycles_memory(PyObject*, PyObject*) {
#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_11_0
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"release_cached_memory", release_cached_memory, METH_NOARGS, "Free crfkit's cached CPU buffers."},
    {"cached_memory", cached_memory, METH_NOARGS, "Bytes of CPU buffers crfkit keeps between calls."},
    {"cpu_isa", cpu_isa, METH_NOARGS, "The instruction set of the CPU kernels in use."},
    {"recycles_memory", recycles_memory, METH_NOARGS, "Whether freed CPU buffers are kept for reuse."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// Importing crfkit._C loads this library and so registers the ops; the module has three functions
// for the memory crfkit keeps between calls and one that names the CPU kernels' instruction set.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}

STABLE_TORCH_LIBRARY(crfkit, m) {
  // Every op takes its arguments in the order of crfkit.functional: emissions, transitions, then
  // k, tags or noise where the op has one, then lengths, start, end. Backward ops take the upstream
  // gradient first and return the gradients of emissions, transitions, start and end.
  m.def("log_partition(Tensor emissions, Tensor transitions, Tensor lengths, Tensor start, "
        "Tensor end) -> Tensor");
  m.def("marginals(Tensor emissions, Tensor transitions, Tensor lengths, Tensor start, "
        "Tensor end) -> Tensor");
  // The marginals' vector-Jacobian product for an upstream gradient grad_marginals (B, L, T):
  // the gradients of (emissions, transitions, start, end), a Hessian-vector product of log Z
  // (csrc/cpu/marginals_backward.cpp, csrc/cuda/marginals_backward.cu). Not differentiable.
  m.def("marginals_backward(Tensor grad_marginals, Tensor emissions, Tensor transitions, "
        "Tensor lengths, Tensor start, Tensor end) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("log_partition_backward(Tensor grad_log_z, Tensor emissions, Tensor transitions, "
        "Tensor lengths, Tensor start, Tensor end) -> (Tensor, Tensor, Tensor, Tensor)");
  // log Z (B,) with its gradients for grad_log_z = 1: the marginals (B, L, T) and the expected
  // transition counts (B, T, T) (used when log Z is differentiated; crfkit/backends/compiled.py).
  m.def("log_partition_with_marginals(Tensor emissions, Tensor transitions, Tensor lengths, "
        "Tensor start, Tensor end) -> (Tensor log_z, Tensor marginals, Tensor transition_counts)");
  m.def("log_partition_backward_from_marginals(Tensor grad_log_z, Tensor marginals, "
        "Tensor transition_counts, Tensor lengths) -> (Tensor, Tensor, Tensor, Tensor)");
  // Pairwise marginals summed over positions, per sentence: (B, T, T).
  m.def("expected_transition_counts(Tensor emissions, Tensor transitions, Tensor lengths, "
        "Tensor start, Tensor end) -> Tensor");
  // Their vector-Jacobian product for an upstream gradient grad_counts (B, T, T), as
  // marginals_backward (csrc/cpu/marginals_backward.cpp, csrc/cuda/marginals_backward.cu). Not
  // differentiable.
  m.def("expected_transition_counts_backward(Tensor grad_counts, Tensor emissions, Tensor transitions, "
        "Tensor lengths, Tensor start, Tensor end) -> (Tensor, Tensor, Tensor, Tensor)");
  // Decoders return (scores, paths), as crfkit.viterbi / kbest_viterbi and torch.topk do (values
  // first): opcheck's AOT test also needs the differentiable output first.
  m.def("viterbi(Tensor emissions, Tensor transitions, Tensor lengths, Tensor start, "
        "Tensor end) -> (Tensor scores, Tensor paths)");
  m.def("kbest_viterbi(Tensor emissions, Tensor transitions, int k, Tensor lengths, Tensor start, "
        "Tensor end) -> (Tensor scores, Tensor paths)");
  // kbest_viterbi's outputs and log_probs (B, k) = scores - log Z, from one call (the CPU runs
  // the two kernels side by side for small batches; CUDA reads its status once). Not
  // differentiable: the front end uses it for k-best without gradient.
  m.def("kbest_viterbi_with_log_probs(Tensor emissions, Tensor transitions, int k, Tensor lengths, "
        "Tensor start, Tensor end) -> (Tensor scores, Tensor paths, Tensor log_probs)");
  m.def("sequence_score(Tensor emissions, Tensor transitions, Tensor tags, Tensor lengths, "
        "Tensor start, Tensor end) -> Tensor");
  m.def("sequence_score_backward(Tensor grad_scores, Tensor emissions, Tensor tags, "
        "Tensor lengths) -> (Tensor, Tensor, Tensor, Tensor)");
  // n tag sequences per sentence drawn exactly, with replacement (forward filtering, backward
  // sampling): paths (B, n, L) int64, -1 at padded positions and in every row of a sentence with
  // no allowed sequence. noise (L, B, n, T): standard Gumbels in the emissions' dtype, drawn by
  // the caller (the op takes no generator); noise[k] serves position L - 1 - k, the right-to-left
  // order of crfkit/sampling.py (csrc/cpu/sampling.cpp). CPU only; not differentiable (integer
  // paths: the front end scores them with sequence_score and log_partition).
  m.def("sample_with_replacement(Tensor emissions, Tensor transitions, Tensor noise, Tensor lengths, "
        "Tensor start, Tensor end) -> Tensor");
  // n DISTINCT tag sequences per sentence, an exact sample without replacement (stochastic beam
  // search, the Gumbel-top-k trick): paths (B, n, L) int64, the rows in the order of sequential
  // drawing, -1 at padded positions and in the rows after the last allowed sequence. noise as
  // sample_with_replacement's: the (L, B, n, T) standard Gumbels the PyTorch path perturbs each
  // beam's children with (crfkit/sampling.py). CPU only; not differentiable.
  m.def("sample_without_replacement(Tensor emissions, Tensor transitions, Tensor noise, Tensor lengths, "
        "Tensor start, Tensor end) -> Tensor");
}
