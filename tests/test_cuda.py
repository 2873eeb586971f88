"""The CUDA kernels against the CPU kernels of the same compiled extension.

Skipped unless a GPU is visible and crfkit._C was built with its CUDA kernels
(crfkit.backend_info()['cuda_kernels']). On the GPU machine:

    python -m pytest -q tests/test_cuda.py
    compute-sanitizer --tool memcheck python -m pytest -q tests/test_cuda.py -k "not compile"

Values AND gradients of every op against the CPU kernels on random inputs with ragged lengths
(0 and L included), T in {1, 2, 5, 9, 37, 100}, float32 and float64, forbidden (-inf) scores,
all-forbidden sentences, integer scores with many exact ties (decoded paths and scores must be
IDENTICAL to the CPU's: same tie rule, same summation order), k up to more than the number of
sequences, B = 0 and L = 0; shapes that put the kernels' buffers in global instead of shared
memory and batches larger than the persistent grid; opcheck of each op; torch.compile; bad
input raises.

CRFKIT_CUDA_TESTS_EMULATED=1 runs the same tests on a machine without a GPU against the CPU
emulator of the kernels (tools/cuda_compile_check/emulator: the kernels' own source compiled
for the CPU, lanes as threads; built on first use, a few minutes): it executes the kernel code
and checks the tests themselves, but says nothing about the GPU's own behaviour.
"""
import contextlib
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import crfkit
from crfkit.backends import op_table
from conftest import check_compile_matches_eager, random_crf

EMULATED = os.environ.get("CRFKIT_CUDA_TESTS_EMULATED", "") == "1"
COMPILED = "compiled" in crfkit.backends.available()
HAVE_CUDA = COMPILED and torch.cuda.is_available() and crfkit.backend_info()["cuda_kernels"]
DEVICE = "cpu" if EMULATED else "cuda"

if not COMPILED:
    pytestmark = pytest.mark.skip(reason="the compiled extension crfkit._C is not built")
elif EMULATED:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "cuda_compile_check" / "emulator"))
    import emulated  # noqa: E402

    emulated.load()
elif not HAVE_CUDA:
    pytestmark = pytest.mark.skip(
        reason="no CUDA device, or crfkit._C was built without its CUDA kernels (CRFKIT_FORCE_CUDA=1 "
               f"builds them); torch.cuda.is_available() = {torch.cuda.is_available()}")

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-4)}
SMALL = EMULATED  # the emulator runs a lane per OS thread: keep the largest batches smaller


def device_ops():
    """The raw ops that run the CUDA kernels (their emulation on CPU tensors when EMULATED)."""
    return torch.ops.crfkit_emu if EMULATED else torch.ops.crfkit


@contextlib.contextmanager
def on_device():
    """crfkit's functional API runs the CUDA kernels within the block (CUDA tensors do that by
    themselves; the emulator needs the compiled backend pointed at it)."""
    if EMULATED:
        with emulated.emulated_kernels():
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def _compiled_backend():
    if COMPILED:
        with crfkit.use_backend("compiled"):
            yield
    else:
        yield


def to(device, tensors):
    return [x.to(device) for x in tensors]


def forbid(inputs, seed, share=0.3):
    """-inf in some transitions, and (when B > 2 and sentence 2 is not empty) at every tag of
    one position of sentence 2, so that all of its sequences are forbidden."""
    em, tr, ln, s, e = [x.clone() for x in inputs]
    g = torch.Generator().manual_seed(seed)
    T = tr.shape[0]
    if T > 1:
        tr[torch.rand(T, T, generator=g) < share] = -math.inf
    if em.shape[0] > 2 and int(ln[2]) > 0:
        em[2, int(ln[2]) // 2, :] = -math.inf
    return em, tr, ln, s, e


def every_output(inputs, on_gpu, k, with_grads=True):
    """Values and (with_grads) gradients of every op, by the CUDA kernels (on_gpu) or the CPU
    kernels, returned on the CPU. Gradients: of a weighted sum of the finite log Z (through
    log_partition_with_marginals and its backward), of the scores of random gold tags, of the
    finite Viterbi and k-best scores (through sequence_score_backward)."""
    device = DEVICE if on_gpu else "cpu"
    em, tr, ln, s, e = to(device, inputs)
    B, L, T = em.shape
    with on_device() if on_gpu else contextlib.nullcontext():
        params = [x.detach().clone().requires_grad_() for x in (em, tr, s, e)]
        pe, pt, ps, pn = params
        log_z = crfkit.log_partition(pe, pt, ln, ps, pn)
        marginals = crfkit.marginals(em, tr, ln, s, e)
        counts = crfkit.expected_transition_counts(em, tr, ln, s, e)
        scores, paths = crfkit.viterbi(pe, pt, ln, ps, pn)
        best = crfkit.kbest_viterbi(pe, pt, k, ln, ps, pn)
        gold = torch.randint(0, T, (B, L), generator=torch.Generator().manual_seed(5)).to(device)
        gold_scores = crfkit.sequence_score(pe, pt, gold, ln, ps, pn)
        weights = torch.linspace(0.5, 1.5, B, dtype=em.dtype, device=device)
        finite_z = torch.isfinite(log_z)
        objective = (log_z[finite_z] * weights[finite_z]).sum() + gold_scores.sum() \
            + best.scores[torch.isfinite(best.scores)].sum() + scores[torch.isfinite(scores)].sum()
        grads = torch.autograd.grad(objective, params, allow_unused=True) if with_grads else ()
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    out = dict(log_z=log_z, marginals=marginals, transition_counts=counts,
               viterbi_paths=paths, viterbi_scores=scores,
               kbest_paths=best.paths, kbest_scores=best.scores, kbest_log_probs=best.log_probs,
               gold_scores=gold_scores,
               **{f"grad_{n}": g for n, g in zip(("emissions", "transitions", "start", "end"), grads)})
    return {name: value.detach().cpu() for name, value in out.items()}


# Additions only, in the same order as the CPU kernels: equal bit for bit.
EXACT = ("viterbi_paths", "viterbi_scores", "kbest_paths", "kbest_scores", "gold_scores")


def assert_matches_cpu(inputs, k, dtype, with_grads=True):
    got = every_output(inputs, True, k, with_grads)
    want = every_output(inputs, False, k, with_grads)
    for name in want:
        if name in EXACT:
            assert torch.equal(got[name], want[name]), name
        elif name == "kbest_log_probs":
            # score - log Z in the inputs' dtype: an ulp of a large log Z (the parallel-in-time
            # path rounds it differently from the CPU) is an ulp of every log-probability
            finite = want["log_z"][torch.isfinite(want["log_z"])]
            ulp = torch.finfo(dtype).eps * float(finite.abs().max()) if finite.numel() else 0.0
            tol = dict(rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] + 2 * ulp)
            torch.testing.assert_close(got[name], want[name], **tol, msg=name)
        else:
            torch.testing.assert_close(got[name], want[name], **TOL[dtype], msg=name)
    return got


# (B, L, T, k): every T of the grid, lengths 0 and L included (random_crf), k from 1 to more
# than the number of sequences of the short sentences.
SHAPES = [(1, 1, 1, 1), (3, 4, 1, 3), (5, 6, 2, 2), (6, 3, 2, 20), (7, 9, 5, 5), (8, 33, 9, 15),
          (4, 40, 37, 5), (3, 20, 100, 15), (70, 12, 9, 40),
          # the edges of the register kernels (log_partition.cu): 16 lanes, 32 lanes (float; double
          # from T = 17 takes the generic kernel), all 32 lanes owning a tag
          (5, 10, 16, 4), (6, 11, 17, 5), (4, 9, 32, 3)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,k", SHAPES)
def test_every_op_matches_cpu(dtype, B, L, T, k):
    assert_matches_cpu(random_crf(B, L, T, dtype=dtype, scale=2.0), k, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,k", [(6, 7, 5, 7), (9, 20, 9, 15), (4, 30, 37, 5), (3, 12, 100, 4)])
def test_forbidden_scores_and_all_forbidden_sentences(dtype, B, L, T, k):
    inputs = forbid(random_crf(B, L, T, dtype=dtype, scale=2.0), seed=B * L + T)
    got = assert_matches_cpu(inputs, k, dtype)
    if B > 2 and int(inputs[2][2]) > 0:  # the dead sentence: log Z = -inf, no path, zero marginals
        assert got["log_z"][2] == -math.inf and (got["viterbi_paths"][2] == -1).all()
        assert (got["marginals"][2] == 0).all() and (got["kbest_scores"][2] == -math.inf).all()
    for name in ("marginals", "transition_counts", "grad_emissions", "grad_transitions", "grad_start", "grad_end"):
        assert not torch.isnan(got[name]).any(), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,k", [(9, 12, 5, 1), (9, 12, 5, 25), (16, 30, 9, 15), (5, 8, 2, 300), (4, 25, 37, 15)])
def test_integer_scores_with_ties_decode_identically(dtype, B, L, T, k):
    # Scores in {-1, 0, 1}: many sequences of exactly equal score; the tie rule decides the rows.
    got = assert_matches_cpu(random_crf(B, L, T, dtype=dtype, integer=True), k, dtype)
    assert torch.equal(got["kbest_paths"][:, 0], got["viterbi_paths"])


# k-best has two CUDA kernels (csrc/cuda/kbest.cu): kbest_kernel (a lane per tag, the default)
# and kbest_per_tag_kernel (a block per sentence; CRFKIT_CUDA_KBEST_KERNEL=per_tag, or auto for
# small batches and K <= 5; the tests force each). Each must give the CPU's paths and
# scores bit for bit. Shapes: T = 1, K above the number of sequences, 16 and 32 lanes per tag
# (T = 9, 17, 32: blocks of 160, 544 and 1024 threads), empty and length-1 sentences,
# backpointers in shared memory and (L T K > 48 KiB; 16-bit codes at T K = 272) in the global
# workspace, more sentences than resident blocks, and T = 37, where per_tag does not apply and
# kbest_kernel runs.
KBEST_KERNEL_SHAPES = [(1, 1, 1, 3), (4, 5, 2, 40), (7, 9, 5, 5), (9, 33, 9, 15), (5, 14, 17, 6),
                       (3, 9, 32, 3), (3, 90, 16, 17), (40, 6, 3, 4), (4, 12, 37, 5)]


@pytest.mark.parametrize("kernel", ["per_tag", "per_sentence"])
@pytest.mark.parametrize("scores", ["random", "forbidden", "integer"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,k", KBEST_KERNEL_SHAPES)
def test_both_kbest_kernels_decode_like_the_cpu(B, L, T, k, dtype, scores, kernel, monkeypatch):
    inputs = random_crf(B, L, T, dtype=dtype, scale=2.0, integer=scores == "integer")
    if scores == "forbidden":
        inputs = forbid(inputs, seed=B + L + T)
    em, tr, ln, s, e = inputs
    want_scores, want_paths = torch.ops.crfkit.kbest_viterbi(em, tr, k, ln, s, e)
    monkeypatch.setenv("CRFKIT_CUDA_KBEST_KERNEL", kernel)
    em, tr, ln, s, e = to(DEVICE, inputs)
    got_scores, got_paths = device_ops().kbest_viterbi(em, tr, k, ln, s, e)
    assert torch.equal(got_scores.cpu(), want_scores)
    assert torch.equal(got_paths.cpu(), want_paths)


@pytest.mark.parametrize("kernel", ["per_tag", "per_sentence"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,k", [(1, 1, 1, 1), (1, 9, 5, 4), (6, 3, 2, 20), (7, 9, 5, 5), (4, 30, 37, 5),
                                     (0, 4, 3, 3)])
def test_kbest_with_log_probs_is_the_separate_ops(dtype, B, L, T, k, kernel, monkeypatch):
    # The op behind a k-best without gradient (one status read on the device; the k-best kernel
    # writes the log-probabilities with the scores): the outputs of kbest_viterbi and
    # log_probs_from_scores(log_partition) on the same device, bit for bit, and the CPU's
    # (log-probabilities to the tolerance of log Z).
    monkeypatch.setenv("CRFKIT_CUDA_KBEST_KERNEL", kernel)
    inputs = forbid(random_crf(B, L, T, dtype=dtype, scale=2.0), seed=B + L + T)
    em, tr, ln, s, e = to(DEVICE, inputs)
    ops = device_ops()
    scores, paths, log_probs = ops.kbest_viterbi_with_log_probs(em, tr, k, ln, s, e)
    want_scores, want_paths = ops.kbest_viterbi(em, tr, k, ln, s, e)
    want_log_probs = crfkit.reference.log_probs_from_scores(want_scores, ops.log_partition(em, tr, ln, s, e))
    assert torch.equal(scores, want_scores) and torch.equal(paths, want_paths)
    assert torch.equal(log_probs, want_log_probs) and not log_probs.isnan().any()
    cem, ctr, cln, cs, ce = inputs  # on the CPU
    cpu_scores, cpu_paths, cpu_log_probs = torch.ops.crfkit.kbest_viterbi_with_log_probs(cem, ctr, k, cln, cs, ce)
    assert torch.equal(scores.cpu(), cpu_scores) and torch.equal(paths.cpu(), cpu_paths)
    torch.testing.assert_close(log_probs.cpu(), cpu_log_probs, **TOL[dtype])
    with on_device():
        public = crfkit.kbest_viterbi(em, tr, k, ln, s, e)
    assert torch.equal(public.log_probs, log_probs) and torch.equal(public.paths, paths)


@pytest.mark.parametrize("kernel", ["per_tag", "per_sentence"])
def test_both_kbest_kernels_check_the_emissions_within_the_lengths(kernel, monkeypatch):
    monkeypatch.setenv("CRFKIT_CUDA_KBEST_KERNEL", kernel)
    for _, mutate, pattern in BAD_VALUES[:2]:  # NaN at position 0, +inf at position 3
        with pytest.raises(ValueError, match=pattern):
            RAW["kbest_viterbi"](*mutate(*_good()))
    em, tr, ln, s, e = _good()
    clean = RAW["kbest_viterbi"](em, tr, ln, s, e)
    dirty = RAW["kbest_viterbi"](_put(em, (1, 3, 0), math.nan), tr, ln, s, e)  # sentence 1 has length 2
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


def test_kbest_kernel_choice_must_be_known(monkeypatch):
    monkeypatch.setenv("CRFKIT_CUDA_KBEST_KERNEL", "fastest")
    em, tr, ln, s, e = to(DEVICE, random_crf(2, 4, 3))
    with pytest.raises(ValueError, match="CRFKIT_CUDA_KBEST_KERNEL must be per_sentence, per_tag or auto"):
        device_ops().kbest_viterbi(em, tr, 2, ln, s, e)


@pytest.mark.parametrize("path", ["sequential", "chunked", "per_tag"])
def test_decoders_write_their_outputs_whole(path, monkeypatch):
    # The host does not fill the decoders' outputs: every score and path entry (-1 beyond a
    # sentence, -inf / -1 in the rows of sequences that do not exist and of dead sentences) is
    # the kernels' own write. Blocks just freed, full of values no output holds, are what the
    # allocator hands out next, so an entry left unwritten shows up as 12345 or NaN.
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always" if path == "chunked" else "never")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", "2")
    monkeypatch.setenv("CRFKIT_CUDA_KBEST_KERNEL", "per_tag" if path == "per_tag" else "per_sentence")
    inputs = forbid(random_crf(6, 7, 3, dtype=torch.float32, scale=2.0), seed=3)
    em, tr, ln, s, e = inputs
    assert int(ln.min()) == 0 and int(ln[2]) > 0  # an empty sentence and a dead one (forbid)
    B, L, _ = em.shape
    for k in (1, 4, 40):  # Viterbi; k-best; more rows than the short sentences have sequences
        want = torch.ops.crfkit.kbest_viterbi(em, tr, k, ln, s, e)
        for _ in range(2):
            junk = [torch.full((B, k, L), 12345, dtype=torch.long, device=DEVICE),
                    torch.full((B, k), math.nan, dtype=torch.float32, device=DEVICE)]
            del junk
            got = device_ops().kbest_viterbi(*to(DEVICE, inputs[:2]), k, *to(DEVICE, inputs[2:]))
            assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), k
        want_log_probs = torch.ops.crfkit.kbest_viterbi_with_log_probs(em, tr, k, ln, s, e)[2]
        junk = torch.full((B, k), math.nan, dtype=torch.float32, device=DEVICE)
        del junk
        got = device_ops().kbest_viterbi_with_log_probs(*to(DEVICE, inputs[:2]), k, *to(DEVICE, inputs[2:]))
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got[:2], want)), k
        torch.testing.assert_close(got[2].cpu(), want_log_probs, **TOL[torch.float32])


@pytest.mark.parametrize("path,T", [("sequential", 3), ("chunked", 3), ("generic", 37)])
def test_marginals_are_written_whole(path, T, monkeypatch):
    # Likewise the rows of marginals, of log_partition_with_marginals and of the backward: zero
    # beyond each sentence and for a dead sentence, written by the kernels (T = 37: the generic
    # kernel, T = 3: the register kernel, sequential or parallel in time).
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always" if path == "chunked" else "never")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", "2")
    inputs = forbid(random_crf(6, 7, T, dtype=torch.float32, scale=2.0), seed=3)
    em, tr, ln, s, e = inputs
    B, L, _ = em.shape
    ones = torch.ones(B, dtype=em.dtype)
    cpu, ops = torch.ops.crfkit, device_ops()
    calls = {
        "marginals": lambda o, x: o.marginals(*x),
        "log_partition_with_marginals": lambda o, x: o.log_partition_with_marginals(*x)[1],
        "log_partition_backward": lambda o, x: o.log_partition_backward(ones.to(x[0].device), *x)[0],
    }
    for name, call in calls.items():
        want = call(cpu, inputs)
        assert (want[ln == 0] == 0).all() and (want[0] != 0).any()
        assert int(ln[2]) == 0 or (want[2] == 0).all()  # forbid() leaves sentence 2 no sequence
        for _ in range(2):
            junk = torch.full((B, L, T), math.nan, dtype=torch.float32, device=DEVICE)
            del junk
            got = call(ops, to(DEVICE, inputs)).cpu()
            torch.testing.assert_close(got, want, **TOL[torch.float32], msg=name)
            for b in range(B):
                assert (got[b, int(ln[b]):] == 0).all(), name


@pytest.mark.parametrize("B,L,T", [(0, 5, 3), (4, 0, 3), (0, 0, 1)])
def test_empty_batch_and_empty_sentences(B, L, T):
    got = assert_matches_cpu(random_crf(B, L, T), 3, torch.float64)
    if B > 0 and L == 0:
        assert (got["log_z"] == 0).all() and (got["kbest_scores"][:, 0] == 0).all()
        assert (got["kbest_scores"][:, 1:] == -math.inf).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batches_larger_than_the_persistent_grid(dtype):
    # More sentences than groups resident on the device: each group walks several.
    assert_matches_cpu(random_crf(300 if SMALL else 20000, 6, 3, dtype=dtype, scale=2.0), 4, dtype)


@pytest.mark.parametrize("B,L,T,k", [(3, 3, 100, 100), (2, 3, 2000, 2)])
def test_buffers_in_global_memory(B, L, T, k):
    # T = 100 with k = 100: k-best lists too large for shared memory; T = 2000: even the
    # per-sentence vectors and the transition tables live in global memory. Not the gradients on
    # the emulator at T = 2000: their kernels reduce each of the T * T entries with a warp's
    # shuffles, which are OS-thread barriers there (a cost growing as T * T).
    with_grads = not (SMALL and T > 1000)
    assert_matches_cpu(random_crf(B, L, T, dtype=torch.float32), k, torch.float32, with_grads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,forbidden", [(7, 9, 5, False), (9, 20, 9, True), (5, 12, 37, True), (3, 6, 100, False)])
def test_log_partition_with_marginals_and_its_backward_match_cpu(dtype, B, L, T, forbidden):
    # The raw ops behind a differentiable log Z: per-sentence log Z, marginals and transition
    # counts (the counts in shared memory up to T = 37, in global memory at T = 100), and the
    # backward from them for upstream gradients that include 0 and a negative one.
    inputs = random_crf(B, L, T, dtype=dtype, scale=2.0)
    if forbidden:
        inputs = forbid(inputs, seed=B + T)
    em, tr, ln, s, e = inputs
    grad = torch.linspace(-1.0, 2.0, B, dtype=dtype)
    grad[1] = 0
    cpu = torch.ops.crfkit
    want = cpu.log_partition_with_marginals(em, tr, ln, s, e)
    got = device_ops().log_partition_with_marginals(*to(DEVICE, (em, tr, ln, s, e)))
    for name, a, b in zip(("log_z", "marginals", "transition_counts"), got, want):
        torch.testing.assert_close(a.cpu(), b, **TOL[dtype], msg=name)
    assert not torch.isnan(got[2]).any()
    want_grads = cpu.log_partition_backward_from_marginals(grad, want[1], want[2], ln)
    got_grads = device_ops().log_partition_backward_from_marginals(*to(DEVICE, (grad, want[1], want[2], ln)))
    for name, a, b in zip(("emissions", "transitions", "start", "end"), got_grads, want_grads):
        torch.testing.assert_close(a.cpu(), b, **TOL[dtype], msg=name)
    counts = device_ops().expected_transition_counts(*to(DEVICE, (em, tr, ln, s, e)))
    assert torch.equal(counts, got[2])


# The backward ops of the marginals and of the expected transition counts
# (csrc/cuda/marginals_backward.cu: a Hessian-vector product of log Z in the direction of the
# upstream gradient, V (B, L, T) in the emissions or W (B, T, T) in the transitions) against the
# CPU kernels: T below, at and above a warp (lanes owning 0, 1 and several tags), forbidden
# transitions with an all-forbidden sentence, scores wide enough that lines span many orders of
# magnitude, and a batch larger than the warps of the grid.
@pytest.mark.parametrize("op", ["marginals_backward", "expected_transition_counts_backward"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T", [(1, 1, 1), (3, 4, 1), (5, 6, 2), (7, 9, 5), (8, 33, 9), (4, 40, 37),
                                   (6, 11, 33), (3, 12, 100), (70, 12, 9)])
@pytest.mark.parametrize("scores", ["random", "forbidden", "large"])
def test_second_derivative_kernels_match_cpu(op, dtype, B, L, T, scores):
    inputs = random_crf(B, L, T, dtype=dtype, scale=20.0 if scores == "large" else 2.0)
    if scores == "forbidden":
        inputs = forbid(inputs, seed=B + T)
    shape = (B, L, T) if op == "marginals_backward" else (B, T, T)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(T), dtype=dtype)
    want = getattr(torch.ops.crfkit, op)(grad, *inputs)
    got = getattr(device_ops(), op)(*to(DEVICE, (grad, *inputs)))
    for name, a, b in zip(("emissions", "transitions", "start", "end"), got, want):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.cpu(), b, **TOL[dtype], msg=name)
    if T > 1 and scores == "random":  # not trivially zero
        assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0


def test_counts_backward_checks_its_upstream_gradient():
    em, tr, ln, s, e = to(DEVICE, random_crf(3, 4, 3))
    grad = torch.ones(3, 3, 3, dtype=em.dtype, device=em.device)
    with pytest.raises(ValueError, match=r"grad_counts must be \(batch, num_tags, num_tags\)"):
        device_ops().expected_transition_counts_backward(grad[:2], em, tr, ln, s, e)
    with pytest.raises(ValueError, match="grad_counts must have the dtype of emissions"):
        device_ops().expected_transition_counts_backward(grad.float(), em, tr, ln, s, e)


def test_marginals_backward_checks_its_upstream_gradient():
    em, tr, ln, s, e = to(DEVICE, random_crf(3, 4, 3))
    grad = torch.ones_like(em)
    with pytest.raises(ValueError, match=r"grad_marginals must be \(batch, seq_len, num_tags\)"):
        device_ops().marginals_backward(grad[:, :3], em, tr, ln, s, e)
    with pytest.raises(ValueError, match="grad_marginals must have the dtype of emissions"):
        device_ops().marginals_backward(grad.float(), em, tr, ln, s, e)


@pytest.mark.parametrize("op", ["marginals", "expected_transition_counts"])
def test_second_derivatives_are_taken_by_the_kernel(op):
    # crfkit.marginals' and crfkit.expected_transition_counts' backward on the device are the
    # kernels above (not autograd over the reference): the same gradients as the CPU kernels,
    # and a third derivative raises as there.
    em, tr, ln, s, e = random_crf(5, 8, 4)
    grad = torch.randn(em.shape if op == "marginals" else (5, 4, 4), dtype=torch.float64)

    def gradients(device):
        params = [x.to(device).requires_grad_() for x in (em, tr, s, e)]
        with on_device() if device == DEVICE else contextlib.nullcontext():
            out = getattr(crfkit, op)(params[0], params[1], ln.to(device), params[2], params[3])
            grads = torch.autograd.grad(out, params, grad.to(device), create_graph=True)
            # crfkit/backends/compiled.py registers the formulas for crfkit's ops, not the emulator's
            if not (EMULATED and device == DEVICE):
                with pytest.raises(RuntimeError, match="not differentiable"):
                    grads[0].sum().backward()
        return [g.detach().cpu() for g in grads]

    for a, b in zip(gradients(DEVICE), gradients("cpu")):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


# The parallel-in-time path (csrc/cuda/forward_backward_chunked.cuh), forced on: chunk lengths
# from 1 (every chunk a position) to more than some sentences, lengths that end inside a chunk,
# chunks beyond a sentence, 8 / 16 / 32 lanes, forbidden transitions and a sentence with every
# sequence forbidden, and scores large enough for the exact fallbacks.
CHUNKED_SHAPES = [(5, 20, 9), (3, 33, 5), (4, 17, 16), (2, 24, 32), (6, 9, 1), (1, 64, 2)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [3] if SMALL else [1, 3, 7])  # the emulator: about 40 s a case
@pytest.mark.parametrize("B,L,T", CHUNKED_SHAPES)
@pytest.mark.parametrize("scores", ["random", "forbidden", "large"])
def test_time_chunked_forward_backward_matches_cpu(dtype, chunk, B, L, T, scores, monkeypatch):
    inputs = random_crf(B, L, T, dtype=dtype, scale=300.0 if scores == "large" else 2.0)
    if scores == "forbidden":
        inputs = forbid(inputs, seed=B + L + T)
    grad = torch.linspace(-1.0, 2.0, B, dtype=dtype)
    grad[min(1, B - 1)] = 0
    cpu = torch.ops.crfkit
    em, tr, ln, s, e = inputs
    want = [cpu.log_partition(em, tr, ln, s, e), cpu.marginals(em, tr, ln, s, e),
            cpu.log_partition_backward(grad, em, tr, ln, s, e), cpu.log_partition_with_marginals(em, tr, ln, s, e),
            cpu.expected_transition_counts(em, tr, ln, s, e)]
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", str(chunk))
    ops = device_ops()
    em, tr, ln, s, e = to(DEVICE, inputs)
    got = [ops.log_partition(em, tr, ln, s, e), ops.marginals(em, tr, ln, s, e),
           ops.log_partition_backward(grad.to(DEVICE), em, tr, ln, s, e),
           ops.log_partition_with_marginals(em, tr, ln, s, e), ops.expected_transition_counts(em, tr, ln, s, e)]
    for name, a, b in zip(("log_z", "marginals", "backward", "with_marginals", "counts"), got, want):
        for i, (x, y) in enumerate(zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))):
            assert not torch.isnan(x).any(), (name, i)
            torch.testing.assert_close(x.cpu(), y, **TOL[dtype], msg=f"{name}[{i}]")
    assert torch.equal(got[3][2], got[4]) and torch.equal(got[3][1], got[1])


def test_time_chunked_path_checks_the_emissions_and_ignores_what_lies_beyond(monkeypatch):
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", "2")
    em, tr, ln, s, e = _good()

    def as_tuple(x):
        return x if isinstance(x, tuple) else (x,)

    for op in ("log_partition", "marginals", "log_partition_backward", "log_partition_with_marginals"):
        for _, mutate, pattern in BAD_VALUES[:2]:  # NaN at position 0 (chunk 0), +inf at position 3 (chunk 1)
            with pytest.raises(ValueError, match=pattern):
                RAW[op](*mutate(em, tr, ln, s, e))
        clean, dirty = RAW[op](em, tr, ln, s, e), RAW[op](_put(em, (1, 3, 0), math.nan), tr, ln, s, e)
        assert all(torch.equal(a, b) for a, b in zip(as_tuple(clean), as_tuple(dirty))), op


@pytest.mark.parametrize("name,value,message", [
    ("CRFKIT_CUDA_TIME_PARALLEL", "sometimes", "must be auto, always or never"),
    ("CRFKIT_CUDA_TIME_CHUNK", "0", "must be a positive integer"),
    ("CRFKIT_CUDA_TIME_CHUNK", "ten", "must be a positive integer")])
def test_time_parallel_settings_must_be_valid(name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    em, tr, ln, s, e = _good()
    with pytest.raises(ValueError, match=f"{name} {message}"):
        device_ops().log_partition(em, tr, ln, s, e)


def test_backward_from_marginals_checks_its_arguments():
    em, tr, ln, s, e = _good()
    ops = device_ops()
    _, mu, counts = ops.log_partition_with_marginals(em, tr, ln, s, e)
    g = torch.ones(2, device=DEVICE)
    # Beyond the lengths the emissions' gradient is exactly 0, even for an infinite upstream gradient.
    infinite = torch.tensor([math.inf, 1.0], device=DEVICE)
    grads = ops.log_partition_backward_from_marginals(infinite, mu, counts, torch.tensor([2, 1], device=DEVICE))
    assert (grads[0][0, 2:] == 0).all() and (grads[0][1, 1:] == 0).all()
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside \[0, seq_len = 4\]"):
        ops.log_partition_backward_from_marginals(g, mu, counts, torch.tensor([4, 5], device=DEVICE))
    with pytest.raises(ValueError, match=r"transition_counts must be \(batch, num_tags, num_tags\)"):
        ops.log_partition_backward_from_marginals(g, mu, counts[:, :2], ln)
    with pytest.raises(ValueError, match=r"grad_log_z must be \(batch,\)"):
        ops.log_partition_backward_from_marginals(torch.ones(3, device=DEVICE), mu, counts, ln)
    with pytest.raises(ValueError, match="grad_log_z must have the dtype of marginals"):
        ops.log_partition_backward_from_marginals(g.double(), mu, counts, ln)
    with pytest.raises(ValueError, match="lengths must be int64"):
        ops.log_partition_backward_from_marginals(g, mu, counts, ln.int())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_scores_take_the_exact_fallback(dtype):
    # Scores of magnitude 1e3: the factored sums underflow and the exact log-space path runs.
    assert_matches_cpu(random_crf(5, 20, 9, dtype=dtype, scale=300.0), 5, dtype)
    assert_matches_cpu(random_crf(4, 12, 20, dtype=dtype, scale=300.0), 5, dtype)


def test_results_are_deterministic():
    em, tr, ln, s, e = to(DEVICE, random_crf(64, 40, 9, dtype=torch.float32, scale=2.0))
    ops = device_ops()
    runs = [ops.log_partition_backward(torch.ones(64, device=DEVICE), em, tr, ln, s, e) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_non_contiguous_and_expanded_inputs():
    em, tr, ln, s, e = to(DEVICE, random_crf(4, 6, 5))
    em_t = em.transpose(0, 1).contiguous().transpose(0, 1)
    tr_t = tr.t().contiguous().t()
    assert not em_t.is_contiguous() and not tr_t.is_contiguous()
    ops = device_ops()
    torch.testing.assert_close(ops.log_partition(em_t, tr_t, ln, s, e), ops.log_partition(em, tr, ln, s, e))
    assert torch.equal(ops.viterbi(em_t, tr_t, ln, s, e)[1], ops.viterbi(em, tr, ln, s, e)[1])
    expanded = em[:1].expand(5, 6, 5)
    out = ops.log_partition(expanded, tr, torch.full((5,), 6, device=DEVICE), s, e)
    assert torch.equal(out, out[:1].expand(5))


def test_half_precision_inputs():
    em, tr, ln, s, e = random_crf(4, 10, 5, dtype=torch.float32)
    for half in (torch.float16, torch.bfloat16):
        with on_device():
            got = crfkit.log_partition(em.to(DEVICE, half), tr.to(DEVICE), ln.to(DEVICE), s.to(DEVICE), e.to(DEVICE))
        want = crfkit.log_partition(em.to(half), tr, ln, s, e)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


def test_opcheck_every_op():
    em, tr, ln, s, e = to(DEVICE, random_crf(3, 6, 4))
    req = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    ops = device_ops()
    cases = op_table.example_arguments(ops, req[0], req[1], ln, req[2], req[3],
                                       tags=torch.randint(0, 4, (3, 2, 6)).to(DEVICE), k=5,
                                       grad_log_z=torch.ones(3, dtype=torch.float64, device=DEVICE),
                                       grad_scores=torch.ones(3, 2, dtype=torch.float64, device=DEVICE),
                                       grad_marginals=torch.randn(3, 6, 4, dtype=torch.float64, device=DEVICE))
    namespace = "crfkit_emu" if EMULATED else "crfkit"
    with on_device():  # the autograd formulas call the backward ops of the same kernels
        for name, args in cases.items():
            if not op_table.OPS[name].cuda:  # a CPU-only op
                continue
            assert op_table.has_kernel(namespace, name, "CPU" if EMULATED else "CUDA"), name
            torch.library.opcheck(getattr(ops, name), args)


def test_torch_compile_fullgraph():
    em, tr, ln, s, e = to(DEVICE, random_crf(4, 12, 5, dtype=torch.float32))
    torch._dynamo.reset()  # no graph traced for other kernels (the CPU ones) is reused
    try:
        check_compile_matches_eager(em, tr, ln, s, e, on_device())
    finally:
        torch._dynamo.reset()


# ---- bad input ----------------------------------------------------------------------------------
def _put(x, index, value):
    x = x.clone()
    x[index] = value
    return x


FUNCTIONAL = {
    "log_partition": lambda em, tr, ln, s, e: crfkit.log_partition(em, tr, ln, s, e),
    "marginals": lambda em, tr, ln, s, e: crfkit.marginals(em, tr, ln, s, e),
    "viterbi": lambda em, tr, ln, s, e: crfkit.viterbi(em, tr, ln, s, e),
    "kbest_viterbi": lambda em, tr, ln, s, e: crfkit.kbest_viterbi(em, tr, 3, ln, s, e),
    "sequence_score": lambda em, tr, ln, s, e: crfkit.sequence_score(
        em, tr, torch.zeros(em.shape[:2], dtype=torch.long, device=em.device), ln, s, e),
}
RAW = {
    "log_partition": lambda em, tr, ln, s, e: device_ops().log_partition(em, tr, ln, s, e),
    "marginals": lambda em, tr, ln, s, e: device_ops().marginals(em, tr, ln, s, e),
    "log_partition_backward": lambda em, tr, ln, s, e: device_ops().log_partition_backward(
        torch.ones(em.shape[0], dtype=em.dtype, device=em.device), em, tr, ln, s, e),
    "log_partition_with_marginals": lambda em, tr, ln, s, e: device_ops().log_partition_with_marginals(
        em, tr, ln, s, e),
    "expected_transition_counts": lambda em, tr, ln, s, e: device_ops().expected_transition_counts(em, tr, ln, s, e),
    "viterbi": lambda em, tr, ln, s, e: device_ops().viterbi(em, tr, ln, s, e),
    "kbest_viterbi": lambda em, tr, ln, s, e: device_ops().kbest_viterbi(em, tr, 3, ln, s, e),
    "kbest_viterbi_with_log_probs": lambda em, tr, ln, s, e: device_ops().kbest_viterbi_with_log_probs(
        em, tr, 3, ln, s, e),
    "sequence_score": lambda em, tr, ln, s, e: device_ops().sequence_score(
        em, tr, torch.zeros(em.shape[0], 1, em.shape[1], dtype=torch.long, device=em.device), ln, s, e),
    "marginals_backward": lambda em, tr, ln, s, e: device_ops().marginals_backward(
        torch.ones_like(em), em, tr, ln, s, e),
    "expected_transition_counts_backward": lambda em, tr, ln, s, e: device_ops().expected_transition_counts_backward(
        torch.ones(em.shape[0], em.shape[2], em.shape[2], dtype=em.dtype, device=em.device), em, tr, ln, s, e),
    "sample_with_replacement": lambda em, tr, ln, s, e: device_ops().sample_with_replacement(
        em, tr, _noise(em, 3), ln, s, e),
    "sample_without_replacement": lambda em, tr, ln, s, e: device_ops().sample_without_replacement(
        em, tr, _noise(em, 3), ln, s, e),
}
BAD_VALUES = [
    # (description, mutate(em, tr, ln, s, e), message pattern)
    ("NaN emission", lambda em, tr, ln, s, e: (_put(em, (1, 0, 2), math.nan), tr, ln, s, e),
     r"emissions\[1\].*NaN or \+inf"),
    ("+inf emission", lambda em, tr, ln, s, e: (_put(em, (0, 3, 0), math.inf), tr, ln, s, e),
     r"emissions\[0\].*NaN or \+inf"),
    ("NaN transition", lambda em, tr, ln, s, e: (em, _put(tr, (0, 1), math.nan), ln, s, e),
     r"transitions contains NaN or \+inf"),
    ("+inf start", lambda em, tr, ln, s, e: (em, tr, ln, _put(s, 1, math.inf), e), r"start contains NaN or \+inf"),
    ("NaN end", lambda em, tr, ln, s, e: (em, tr, ln, s, _put(e, 2, math.nan)), r"end contains NaN or \+inf"),
]


def _noise(em, n, seed=0):
    """Standard Gumbels (L, B, n, T) for the samplers, drawn on the CPU (the same on every device)."""
    B, L, T = em.shape
    like = torch.empty((), dtype=em.dtype)
    g = torch.Generator().manual_seed(seed)
    return crfkit.reference.gumbel_noise((L, B, n, T), like, g).to(em.device)


def _good():
    """Valid float32 inputs: 2 sentences of lengths 4 and 2, 4 positions, 3 tags."""
    em, tr, _, s, e = random_crf(2, 4, 3, dtype=torch.float32)
    return to(DEVICE, (em, tr, torch.tensor([4, 2]), s, e))


@pytest.mark.parametrize("op", RAW)
@pytest.mark.parametrize("case", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_values_raise(op, case):
    _, mutate, pattern = case
    with pytest.raises(ValueError, match=pattern):
        RAW[op](*mutate(*_good()))
    if op in FUNCTIONAL:
        with on_device(), pytest.raises(ValueError, match=pattern):
            FUNCTIONAL[op](*mutate(*_good()))


@pytest.mark.parametrize("op", RAW)
def test_garbage_beyond_the_lengths_is_ignored(op):
    em, tr, ln, s, e = _good()
    clean = RAW[op](em, tr, ln, s, e)
    dirty = RAW[op](_put(em, (1, 3, 0), math.nan), tr, ln, s, e)  # sentence 1 has length 2
    for a, b in zip(clean if isinstance(clean, tuple) else (clean,), dirty if isinstance(dirty, tuple) else (dirty,)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", RAW)
@pytest.mark.parametrize("lengths", [[4, -1], [5, 1]])
def test_lengths_out_of_range_raise(op, lengths):
    em, tr, _, s, e = _good()
    bad = torch.tensor(lengths, device=DEVICE)
    message = r"lengths\[[01]\] = (-1|5) is outside \[0, seq_len = 4\]"
    with pytest.raises(ValueError, match=message):
        RAW[op](em, tr, bad, s, e)
    if op in FUNCTIONAL:
        # The front end leaves the lengths to the kernels here (no read back to the host:
        # compiled.VALUES_CHECKED_ON_DEVICE), so the message is theirs.
        with on_device(), pytest.raises(ValueError, match=message):
            FUNCTIONAL[op](em, tr, bad, s, e)


def test_differentiable_expected_counts_check_the_lengths():
    # A differentiable call runs the kernel (its backward, on CUDA, differentiates the reference).
    em, tr, _, s, e = _good()
    with on_device(), pytest.raises(ValueError, match=r"lengths\[0\] = 5 is outside \[0, seq_len = 4\]"):
        crfkit.expected_transition_counts(em.requires_grad_(), tr, torch.tensor([5, 1], device=DEVICE), s, e)


def test_bad_tags_raise():
    em, tr, ln, s, e = _good()
    ops = device_ops()
    tags = torch.zeros(2, 1, 4, dtype=torch.long, device=DEVICE)
    tags[1, 0, 1] = 7  # within sentence 1 (length 2)
    with pytest.raises(ValueError, match=r"tags\[1, 0, 1\] = 7 is not a tag index in \[0, 3\)"):
        ops.sequence_score(em, tr, tags, ln, s, e)
    with on_device(), pytest.raises(ValueError, match=r"tags\[1, 0, 1\] = 7 is not a tag index in \[0, 3\)"):
        crfkit.sequence_score(em, tr, tags[:, 0], ln, s, e)  # the front end leaves the tags to the kernel
    with pytest.raises(ValueError, match="is not a tag index"):
        ops.sequence_score_backward(torch.ones(2, 1, device=DEVICE), em, tags, ln)
    tags[1, 0, 1] = 0
    tags[1, 0, 3] = -100  # padding: ignored
    ops.sequence_score(em, tr, tags, ln, s, e)
    ops.sequence_score_backward(torch.ones(2, 1, device=DEVICE), em, tags, ln)


@pytest.mark.skipif(EMULATED, reason="needs a CUDA device beside the CPU")
def test_mixed_devices_raise():
    em, tr, ln, s, e = _good()
    ops = device_ops()
    with pytest.raises(ValueError, match="transitions is on cpu"):
        crfkit.log_partition(em, tr.cpu(), ln, s, e)
    with pytest.raises(ValueError, match="lengths is on cpu"):
        crfkit.viterbi(em, tr, ln.cpu(), s, e)
    for make in (lambda: ops.log_partition(em, tr.cpu(), ln, s, e),
                 lambda: ops.viterbi(em, tr, ln.cpu(), s, e),
                 lambda: ops.kbest_viterbi(em.cpu(), tr, 2, ln.cpu(), s.cpu(), e.cpu()),
                 lambda: ops.sequence_score(em, tr, torch.zeros(2, 1, 4, dtype=torch.long), ln, s, e),
                 lambda: ops.log_partition_backward(torch.ones(2), em, tr, ln, s, e),
                 lambda: ops.log_partition_with_marginals(em, tr, ln, s.cpu(), e),
                 lambda: ops.log_partition_backward_from_marginals(
                     torch.ones(2), torch.zeros(2, 4, 3, device=em.device), torch.zeros(2, 3, 3, device=em.device), ln),
                 lambda: ops.sequence_score_backward(torch.ones(2, 1), em, torch.zeros(2, 1, 4, dtype=torch.long), ln)):
        with pytest.raises(RuntimeError, match="device"):
            make()


# ---- deferred errors and CUDA graphs (crfkit/backends/deferred_errors.py) ----------------------
@pytest.fixture
def checked_mode():
    """Each test starts and ends in checked mode with nothing recorded."""
    crfkit.deferred_errors(False)
    crfkit.check_errors()
    yield
    crfkit.deferred_errors(False)
    with contextlib.suppress(ValueError):
        crfkit.check_errors()


@pytest.mark.parametrize("op", RAW)
def test_deferred_mode_records_bad_input_until_check_errors(op, checked_mode):
    em, tr, _, s, e = _good()
    bad = torch.tensor([4, 5], device=DEVICE)
    with crfkit.deferred_errors():
        assert crfkit.backends.deferred_errors.is_deferred()
        RAW[op](em, tr, bad, s, e)  # no exception: nothing is read back
        with pytest.raises(ValueError, match=r"lengths\[1\] was outside \[0, seq_len\]"):
            crfkit.check_errors()
        crfkit.check_errors()  # the check cleared the record
        RAW[op](em, _put(tr, (0, 1), math.nan), torch.tensor([4, 2], device=DEVICE), s, e)
    assert not crfkit.backends.deferred_errors.is_deferred()  # the block restored checked mode
    with pytest.raises(ValueError, match=r"transitions contained NaN or \+inf"):
        crfkit.check_errors()
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside"):  # checked again
        RAW[op](em, tr, bad, s, e)


def test_deferred_mode_as_a_call_and_its_values(checked_mode):
    em, tr, ln, s, e = _good()
    want = [RAW[op](em, tr, ln, s, e) for op in RAW]
    crfkit.deferred_errors()  # as a call: stays on
    try:
        got = [RAW[op](em, tr, ln, s, e) for op in RAW]
        tags = torch.zeros(2, 1, 4, dtype=torch.long, device=DEVICE)
        tags[1, 0, 1] = 7
        device_ops().sequence_score(em, tr, tags, ln, s, e)
        with pytest.raises(ValueError, match=r"a tag was not a tag index in \[0, num_tags\) \(flat index 5 of tags\)"):
            crfkit.check_errors()
        device_ops().log_partition(_put(em, (1, 0, 2), math.nan), tr, ln, s, e)
        with pytest.raises(ValueError, match=r"emissions\[1\] contained NaN or \+inf"):
            crfkit.check_errors()
    finally:
        crfkit.deferred_errors(False)
    for a, b in zip(want, got):  # the same kernels, only the error words differ
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        crfkit.deferred_errors("yes")


def _step_inputs(seed):
    """Inputs of a CUDA-graph test: float32 (B, L, T) = (6, 10, 5), ragged lengths."""
    em, tr, ln, s, e = random_crf(6, 10, 5, dtype=torch.float32, scale=2.0, seed=seed)
    return to(DEVICE, (em, tr, ln, s, e))


@pytest.mark.skipif(EMULATED, reason="CUDA graphs need a GPU")
def test_no_host_synchronisation_in_deferred_mode(checked_mode):
    # torch's sync debug mode raises on any copy to the host that waits for the GPU.
    em, tr, ln, s, e = _step_inputs(1)
    tags = torch.zeros(6, 10, dtype=torch.long, device=DEVICE)
    params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    for op in RAW:  # warm-up: lazy initialisation may synchronise
        RAW[op](em, tr, ln, s, e)
    with crfkit.deferred_errors():
        crfkit.log_partition(*params[:2], ln, *params[2:])  # makes the persistent words
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with crfkit.deferred_errors(False), pytest.raises(RuntimeError, match="synchroniz"):
                RAW["log_partition"](em, tr, ln, s, e)  # checked mode: the status read is seen
            for op in RAW:
                RAW[op](em, tr, ln, s, e)
            loss = (crfkit.log_partition(*params[:2], ln, *params[2:])
                    - crfkit.sequence_score(params[0], params[1], tags, ln, params[2], params[3])).sum()
            loss.backward()
            crfkit.viterbi(em, tr, ln, s, e)
            crfkit.kbest_viterbi(em, tr, 3, ln, s, e)
            crfkit.marginals(em, tr, ln, s, e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    crfkit.check_errors()


@pytest.mark.skipif(EMULATED, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("op", RAW)
def test_every_op_captures_in_a_cuda_graph(op, checked_mode):
    static = _step_inputs(2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        RAW[op](*static)  # warm-up on a side stream, as torch.cuda.graph needs
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # checked mode: deferred automatically while capturing
        out = RAW[op](*static)
    fresh = _step_inputs(3)
    for x, y in zip(static, fresh):
        x.copy_(y)
    graph.replay()
    want = RAW[op](*fresh)
    for x, y in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    crfkit.check_errors()
    static[2].copy_(torch.tensor([10, 11, 0, 3, 4, 5], device=DEVICE))  # lengths[1] > L: seen at the check
    graph.replay()
    with pytest.raises(ValueError, match=r"lengths\[1\] was outside"):
        crfkit.check_errors()


@pytest.mark.skipif(EMULATED, reason="CUDA graphs need a GPU")
def test_a_training_step_captures_in_a_cuda_graph(checked_mode):
    # Forward and backward of the CRF loss, as torch.cuda.make_graphed_callables runs them.
    em, tr, ln, s, e = _step_inputs(4)
    tags = torch.randint(0, 5, (6, 10), device=DEVICE)

    def nll(emissions, transitions, start, end):
        return (crfkit.log_partition(emissions, transitions, ln, start, end)
                - crfkit.sequence_score(emissions, transitions, tags, ln, start, end)).sum()

    module = torch.cuda.make_graphed_callables(nll, tuple(x.clone().requires_grad_() for x in (em, tr, s, e)))
    inputs = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    loss = module(*inputs)
    loss.backward()
    want_inputs = [x.clone().requires_grad_() for x in (em, tr, s, e)]
    want = nll(*want_inputs)
    want.backward()
    torch.testing.assert_close(loss, want)
    for x, y in zip(inputs, want_inputs):
        torch.testing.assert_close(x.grad, y.grad)
    crfkit.check_errors()


# ---- the parallel-in-time Viterbi (csrc/cuda/viterbi_chunked.cuh), forced on --------------------
# Paths and scores must be the CPU kernel's bit for bit: the chunked recursion steps exactly as the
# sequential kernel from boundary values that differ by rounding only (none of the random data's
# near-ties falls within that rounding), and the score is summed along the path in the sequential
# order. Chunk lengths from 1 to more than some sentences, 8 / 16 / 32 lanes, lengths 0 and L,
# forbidden transitions with a sentence whose every sequence is forbidden, integer scores with ties
# (double at T = 32 is beyond the register range: the sequential kernel, with the setting on).
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("B,L,T", CHUNKED_SHAPES)
@pytest.mark.parametrize("scores", ["random", "forbidden", "integer"])
def test_time_chunked_viterbi_decodes_like_the_cpu(dtype, chunk, B, L, T, scores, monkeypatch):
    inputs = random_crf(B, L, T, dtype=dtype, scale=2.0, integer=scores == "integer")
    if scores == "forbidden":
        inputs = forbid(inputs, seed=B + L + T)
    em, tr, ln, s, e = inputs
    want_scores, want_paths = torch.ops.crfkit.viterbi(em, tr, ln, s, e)
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", str(chunk))
    got_scores, got_paths = device_ops().viterbi(*to(DEVICE, inputs))
    assert torch.equal(got_scores.cpu(), want_scores)
    assert torch.equal(got_paths.cpu(), want_paths)
    if scores == "forbidden" and B > 2 and int(ln[2]) > 0:  # the dead sentence
        assert got_scores[2] == -math.inf and (got_paths[2] == -1).all()


def test_time_chunked_viterbi_checks_the_emissions_and_ignores_what_lies_beyond(monkeypatch):
    monkeypatch.setenv("CRFKIT_CUDA_TIME_PARALLEL", "always")
    monkeypatch.setenv("CRFKIT_CUDA_TIME_CHUNK", "2")
    for _, mutate, pattern in BAD_VALUES[:2]:  # NaN at position 0 (chunk 0), +inf at position 3 (chunk 1)
        with pytest.raises(ValueError, match=pattern):
            RAW["viterbi"](*mutate(*_good()))
    em, tr, ln, s, e = _good()
    clean = RAW["viterbi"](em, tr, ln, s, e)
    dirty = RAW["viterbi"](_put(em, (1, 3, 0), math.nan), tr, ln, s, e)  # sentence 1 has length 2
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    want = torch.ops.crfkit.viterbi(*[x.cpu() for x in (em, tr, ln, s, e)])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(clean, want))


# ---- issue 59's arguments on the device (a real GPU only: they are front-end transforms and the
# reference, which the emulator's raw ops do not exercise) ---------------------------------------
@pytest.mark.skipif(EMULATED, reason="runs the public ops on CUDA tensors: a real GPU only")
def test_mask_allowed_and_per_example_transitions_match_cpu():
    em, tr, ln, st, en = random_crf(6, 9, 5, seed=59)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(1)) < 0.7
    allowed = torch.rand(6, 9, 5, generator=torch.Generator().manual_seed(2)) < 0.6
    allowed[..., 0] = True
    per_position = torch.randn(6, 9, 5, 5, dtype=em.dtype)
    cases = [dict(mask=mask), dict(allowed=allowed), dict(mask=mask, allowed=allowed)]
    for kwargs in cases:
        cpu = (crfkit.log_partition(em, tr, start=st, end=en, **kwargs),
               crfkit.marginals(em, tr, start=st, end=en, **kwargs),
               crfkit.kbest_viterbi(em, tr, 4, start=st, end=en, **kwargs).paths)
        dev = {k: v.cuda() for k, v in kwargs.items()}
        gpu = (crfkit.log_partition(em.cuda(), tr.cuda(), start=st.cuda(), end=en.cuda(), **dev),
               crfkit.marginals(em.cuda(), tr.cuda(), start=st.cuda(), end=en.cuda(), **dev),
               crfkit.kbest_viterbi(em.cuda(), tr.cuda(), 4, start=st.cuda(), end=en.cuda(), **dev).paths)
        torch.testing.assert_close(gpu[0].cpu(), cpu[0], **TOL[em.dtype])
        torch.testing.assert_close(gpu[1].cpu(), cpu[1], **TOL[em.dtype])
        assert torch.equal(gpu[2].cpu(), cpu[2])
    torch.testing.assert_close(crfkit.log_partition(em.cuda(), per_position.cuda(), ln.cuda()).cpu(),
                               crfkit.log_partition(em, per_position, ln), **TOL[em.dtype])
    generator = torch.Generator(device="cuda").manual_seed(0)
    samples = crfkit.sample(em.cuda(), tr.cuda(), 50, ln.cuda(), allowed=allowed.cuda(), generator=generator)
    paths = samples.paths.cpu()
    real = paths >= 0
    assert bool(allowed.unsqueeze(1).expand(6, 50, 9, 5).gather(3, paths.clamp(min=0).unsqueeze(3)).squeeze(3)[real]
                .all())


# ---- sampling (csrc/cuda/sampling.cu against csrc/cpu/sampling.cpp, the same noise) ------------
SAMPLERS = ("sample_with_replacement", "sample_without_replacement")
SAMPLE_SHAPES = [(1, 1, 1, 1), (3, 4, 1, 5), (5, 6, 2, 3), (6, 3, 2, 20), (7, 9, 5, 1), (7, 9, 5, 40),
                 (4, 12, 9, 15), (3, 20, 37, 7)]


def _samples_on_both(op, inputs, n, seed=0):
    noise = _noise(inputs[0], n, seed)
    em, tr, ln, s, e = inputs
    want = getattr(torch.ops.crfkit, op)(em, tr, noise, ln, s, e)
    got = getattr(device_ops(), op)(*to(DEVICE, (em, tr)), noise.to(DEVICE), *to(DEVICE, (ln, s, e))).cpu()
    return got, want


@pytest.mark.parametrize("op", SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T,n", SAMPLE_SHAPES)
@pytest.mark.parametrize("scores", ["random", "forbidden"])
def test_samplers_match_cpu(op, dtype, B, L, T, n, scores):
    inputs = random_crf(B, L, T, dtype=dtype, scale=2.0)
    if scores == "forbidden":
        inputs = forbid(inputs, seed=B * L + T)
    for seed in (0, 1):
        got, want = _samples_on_both(op, inputs, n, seed)
        assert got.shape == (B, n, L) and got.dtype == torch.long
        assert torch.equal(got, want), (seed, (got != want).nonzero()[:5].tolist())


@pytest.mark.parametrize("op", SAMPLERS)
def test_samplers_on_sentences_with_no_allowed_sequence_and_empty_ones(op):
    em, tr, ln, s, e = random_crf(5, 6, 4, seed=3)
    ln = torch.tensor([6, 0, 4, 1, 6])
    e = e.clone()
    em = em.clone()
    em[2, 3] = -math.inf  # sentence 2: every sequence forbidden
    got, want = _samples_on_both(op, (em, tr, ln, s, e), 6)
    assert torch.equal(got, want)
    assert (got[1] == -1).all() and (got[2] == -1).all()  # empty, and all forbidden: no row holds a sequence
    assert (got[3, :, 1:] == -1).all()
    if op == "sample_with_replacement":
        assert (got[3, :, 0] >= 0).all()
    else:  # 4 sequences of length 1: rows 4 and 5 hold none
        assert (got[3, :4, 0].sort().values == torch.arange(4)).all() and (got[3, 4:] == -1).all()


@pytest.mark.parametrize("op", SAMPLERS)
def test_samplers_on_batches_larger_than_the_persistent_grid(op):
    inputs = random_crf(40 if SMALL else 3000, 7, 5, seed=11)
    got, want = _samples_on_both(op, inputs, 4)
    assert torch.equal(got, want)


@pytest.mark.parametrize("op", SAMPLERS)
def test_samplers_check_their_noise(op):
    em, tr, ln, s, e = _good()  # lengths 4 and 2
    raw = getattr(device_ops(), op)
    noise = _noise(em, 3)
    with pytest.raises(ValueError, match=r"noise\[:, 1\] contains NaN or \+-inf"):
        raw(em, tr, _put(noise, (3, 1, 2, 0), -math.inf), ln, s, e)  # position L - 1 - 3 = 0 of sentence 1
    clean = raw(em, tr, noise, ln, s, e)
    assert torch.equal(raw(em, tr, _put(noise, (0, 1, 2, 0), math.nan), ln, s, e), clean)  # beyond its length
    with pytest.raises(ValueError, match=r"noise must be \(seq_len, batch, num_samples, num_tags\)"):
        raw(em, tr, noise[:, :, :, :2], ln, s, e)
    with pytest.raises(ValueError, match="noise must have the dtype of emissions"):
        raw(em, tr, noise.double(), ln, s, e)


@pytest.mark.parametrize("replacement", [True, False])
def test_public_sample_runs_the_device_kernel(replacement):
    from crfkit.backends import compiled

    em, tr, ln, s, e = to(DEVICE, random_crf(6, 8, 5, seed=21))
    with on_device():
        assert compiled._has_kernel("sample_with_replacement" if replacement else "sample_without_replacement", em)
        generator = torch.Generator(device=DEVICE).manual_seed(3)
        samples = crfkit.sample(em, tr, 12, ln, s, e, replacement=replacement, generator=generator)
        again = crfkit.sample(em, tr, 12, ln, s, e, replacement=replacement,
                              generator=torch.Generator(device=DEVICE).manual_seed(3))
    assert torch.equal(samples.paths, again.paths)  # seeded: repeatable
    paths, log_probs = samples.paths.cpu(), samples.log_probs.cpu()
    cpu = [x.cpu() for x in (em, tr, ln, s, e)]
    want = crfkit.sequence_score(cpu[0], cpu[1], paths.clamp(min=0), cpu[2], cpu[3], cpu[4]) \
        - crfkit.log_partition(*cpu).unsqueeze(1)
    missing = crfkit.sampling.missing_rows(paths, cpu[2], replacement)  # rows beyond the sentence's sequences
    assert bool(missing.any()) != replacement and bool((log_probs[missing] == -math.inf).all())
    torch.testing.assert_close(log_probs[~missing], want[~missing], **TOL[torch.float64])
    if not replacement:  # distinct rows per sentence
        for b in range(6):
            rows = {tuple(r[: int(cpu[2][b])].tolist()) for r in paths[b]}
            assert len(rows) == min(12, 5 ** int(cpu[2][b])) or int(cpu[2][b]) == 0


# ---- per-example transitions (csrc/cuda/per_example.cu, and sequence_score.cu / sampling.cu's
# kernels, against csrc/cpu/per_example.cpp and sampling.cpp) ---------------------------------
PER_EXAMPLE_SHAPES = [(1, 1, 1), (3, 4, 2), (5, 6, 3), (4, 7, 9), (3, 5, 37), (2, 3, 40)]


def _per_example_inputs(B, L, T, per_position, dtype=torch.float64, scores="random", seed=0):
    """emissions (B, L, T) with ragged lengths (0 and L included), transitions (B, Lt, T, T) with
    Lt = L (per_position) or 1, start / end (B, T). scores: "random", "forbidden" (-inf in a third
    of the transitions, every tag of one position of sentence 2) or "integer" (values in {-1, 0, 1}:
    many exact ties)."""
    em, _, ln, _, _ = random_crf(B, L, T, dtype=dtype, seed=seed, integer=scores == "integer")
    g = torch.Generator().manual_seed(seed + 1)
    Lt = max(L, 1) if per_position else 1

    def draw(*shape):
        if scores == "integer":
            return torch.randint(-1, 2, shape, generator=g).to(dtype)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    tr, st, en = draw(B, Lt, T, T), draw(B, T), draw(B, T)
    if scores == "forbidden":
        if T > 1:
            tr[torch.rand(tr.shape, generator=g) < 0.3] = -math.inf
        if B > 2 and int(ln[2]) > 0:
            em = em.clone()
            em[2, int(ln[2]) // 2] = -math.inf
    return em, tr, ln, st, en


def _per_example_outputs(ops, inputs, k):
    """Every op that takes per-example transitions, on `ops`' kernels, as CPU tensors."""
    em, tr, ln, st, en = inputs
    B, L, T = em.shape
    g = torch.linspace(0.5, 1.5, B, dtype=em.dtype, device=em.device)
    tags = torch.randint(0, T, (B, 3, L), generator=torch.Generator().manual_seed(7)).to(em.device)
    log_z, marginals, counts = ops.log_partition_with_marginals(em, tr, ln, st, en)
    out = dict(
        log_z=ops.log_partition(em, tr, ln, st, en),
        marginals=ops.marginals(em, tr, ln, st, en),
        with_marginals=(log_z, marginals, counts),
        backward=ops.log_partition_backward(g, em, tr, ln, st, en),
        counts=ops.expected_transition_counts(em, tr, ln, st, en),
        viterbi=ops.viterbi(em, tr, ln, st, en),
        kbest=ops.kbest_viterbi(em, tr, k, ln, st, en),
        kbest_log_probs=ops.kbest_viterbi_with_log_probs(em, tr, k, ln, st, en),
        sequence_score=ops.sequence_score(em, tr, tags, ln, st, en),
    )
    return {name: tuple(x.cpu() for x in (v if isinstance(v, tuple) else (v,))) for name, v in out.items()}


# Decoded paths and their scores: additions in the CPU kernels' order, so equal bit for bit.
PER_EXAMPLE_EXACT = ("viterbi", "kbest", "sequence_score")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,L,T", PER_EXAMPLE_SHAPES)
@pytest.mark.parametrize("per_position", [False, True], ids=["per_sentence", "per_position"])
@pytest.mark.parametrize("scores", ["random", "forbidden", "integer"])
def test_per_example_ops_match_cpu(dtype, B, L, T, per_position, scores):
    inputs = _per_example_inputs(B, L, T, per_position, dtype, scores, seed=B * 100 + L * 10 + T)
    k = 4
    want = _per_example_outputs(torch.ops.crfkit, inputs, k)
    got = _per_example_outputs(device_ops(), to(DEVICE, inputs), k)
    for name in want:
        for index, (g, w) in enumerate(zip(got[name], want[name])):
            assert g.shape == w.shape and g.dtype == w.dtype, (name, index)
            if name in PER_EXAMPLE_EXACT or g.dtype == torch.long or (name == "kbest_log_probs" and index < 2):
                assert torch.equal(g, w), (name, index)
            else:
                torch.testing.assert_close(g, w, **TOL[dtype], msg=f"{name}[{index}]")
    # the gradients from log_partition_with_marginals' outputs, as the autograd formula takes them
    log_z, marginals, counts = (x.to(DEVICE) for x in got["with_marginals"])
    grad = torch.linspace(-1, 2, B, dtype=dtype).to(DEVICE)
    from_marginals = device_ops().log_partition_backward_from_marginals(grad, marginals, counts, inputs[2].to(DEVICE))
    cpu = torch.ops.crfkit.log_partition_backward_from_marginals(grad.cpu(), *want["with_marginals"][1:],
                                                                 inputs[2])
    for g, w in zip(from_marginals, cpu):
        torch.testing.assert_close(g.cpu(), w, **TOL[dtype])


@pytest.mark.parametrize("op", SAMPLERS)
@pytest.mark.parametrize("per_position", [False, True], ids=["per_sentence", "per_position"])
@pytest.mark.parametrize("scores", ["random", "forbidden"])
def test_per_example_samplers_match_cpu(op, per_position, scores):
    for B, L, T in PER_EXAMPLE_SHAPES:
        em, tr, ln, st, en = _per_example_inputs(B, L, T, per_position, scores=scores, seed=T)
        noise = _noise(em, 5, seed=B)
        want = getattr(torch.ops.crfkit, op)(em, tr, noise, ln, st, en)
        got = getattr(device_ops(), op)(*to(DEVICE, (em, tr, noise, ln, st, en))).cpu()
        assert torch.equal(got, want), (B, L, T)


def test_per_example_kernels_on_batches_larger_than_the_persistent_grid():
    inputs = _per_example_inputs(40 if SMALL else 3000, 6, 5, per_position=True, seed=3)
    want = _per_example_outputs(torch.ops.crfkit, inputs, 3)
    got = _per_example_outputs(device_ops(), to(DEVICE, inputs), 3)
    assert torch.equal(got["kbest"][1], want["kbest"][1])
    torch.testing.assert_close(got["backward"], want["backward"], **TOL[torch.float64])


PER_EXAMPLE_BAD = [
    ("nan transition", lambda em, tr, ln, s, e: (em, _put(tr, (1, 0, 2, 1), math.nan), ln, s, e),
     r"transitions contains NaN or \+inf"),
    ("inf start", lambda em, tr, ln, s, e: (em, tr, ln, _put(s, (1, 2), math.inf), e),
     r"start contains NaN or \+inf"),
    ("nan end", lambda em, tr, ln, s, e: (em, tr, ln, s, _put(e, (0, 0), math.nan)), r"end contains NaN or \+inf"),
    ("nan emission", lambda em, tr, ln, s, e: (_put(em, (1, 1, 0), math.nan), tr, ln, s, e),
     r"emissions\[1\] contains NaN or \+inf within its length"),
    ("length", lambda em, tr, ln, s, e: (em, tr, _put(ln, 1, 9), s, e),
     r"lengths\[1\] = 9 is outside \[0, seq_len = 4\]"),
    ("shared start", lambda em, tr, ln, s, e: (em, tr, ln, s[0], e),
     r"start must be \(batch, num_tags\) = \(2, 3\) when transitions are per example"),
    ("transitions shape", lambda em, tr, ln, s, e: (em, tr[:, :, :2], ln, s, e),
     r"transitions must be \(num_tags, num_tags\) or, per example"),
]


def _per_example_good():
    """Valid float32 per-example inputs: 2 sentences of lengths 4 and 2, 4 positions, 3 tags, one
    transition matrix per position."""
    em, tr, _, s, e = _per_example_inputs(2, 4, 3, per_position=True, dtype=torch.float32, seed=5)
    return to(DEVICE, (em, tr, torch.tensor([4, 2]), s, e))


# The second-derivative kernels take shared transitions only, on both devices (compiled.py's
# formula runs autograd over the reference for per-example ones).
SECOND_DERIVATIVES = ("marginals_backward", "expected_transition_counts_backward")


@pytest.mark.parametrize("op", SECOND_DERIVATIVES)
def test_second_derivative_kernels_refuse_per_example_transitions(op):
    with pytest.raises(RuntimeError, match=r"per-example transitions \(batch, Lt, num_tags, num_tags\) are not "
                                           r"supported by this CUDA kernel, got transitions of shape \[2, 4, 3, 3\]"):
        RAW[op](*_per_example_good())


@pytest.mark.parametrize("op", [op for op in RAW if op not in SECOND_DERIVATIVES])
@pytest.mark.parametrize("case", PER_EXAMPLE_BAD, ids=[c[0] for c in PER_EXAMPLE_BAD])
def test_per_example_bad_values_raise(op, case):
    _, mutate, pattern = case
    with pytest.raises(ValueError, match=pattern):
        RAW[op](*mutate(*_per_example_good()))
    em, tr, ln, s, e = _per_example_good()
    clean = RAW[op](em, tr, ln, s, e)  # NaN beyond sentence 1's length (2) is never read
    garbage = RAW[op](_put(em, (1, 3, 1), math.nan), tr, ln, s, e)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (clean, garbage))):
        assert torch.equal(a, b), op


def test_public_ops_take_per_example_transitions_on_the_device():
    """crfkit's functions route per-example calls to the device's kernels (not the reference), with
    gradients of the parameters' shapes."""
    from crfkit import backends

    em, tr, ln, st, en = _per_example_inputs(5, 6, 4, per_position=True, seed=9)
    cpu_params = [x.clone().requires_grad_() for x in (em, tr, st, en)]
    cpu = crfkit.log_partition(cpu_params[0], cpu_params[1], ln, cpu_params[2], cpu_params[3])
    cpu_grads = torch.autograd.grad(cpu.sum(), cpu_params)
    with on_device():
        params = [x.to(DEVICE).requires_grad_() for x in (em, tr, st, en)]
        assert backends.for_transitions(params[1]) is backends.current()
        log_z = crfkit.log_partition(params[0], params[1], ln.to(DEVICE), params[2], params[3])
        grads = torch.autograd.grad(log_z.sum(), params)
        paths = crfkit.kbest_viterbi(*(x.detach() for x in params[:2]), 3, ln.to(DEVICE),
                                     *(x.detach() for x in params[2:])).paths
    torch.testing.assert_close(log_z.detach().cpu(), cpu.detach(), **TOL[torch.float64])
    for g, w in zip(grads, cpu_grads):
        torch.testing.assert_close(g.cpu(), w, **TOL[torch.float64])
    assert torch.equal(paths.cpu(), crfkit.kbest_viterbi(em, tr, 3, ln, st, en).paths)
