"""The C++ CPU sampling kernels (csrc/cpu/sampling.cpp): with replacement
(torch.ops.crfkit.sample_with_replacement) and without replacement
(torch.ops.crfkit.sample_without_replacement: stochastic beam search), against the PyTorch path
(crfkit/sampling.py) and against brute-force enumeration.

- Parity: given the same Gumbel noise (L, B, n, T) (without replacement: the standard Gumbels the
  PyTorch path draws for every child of every beam before it conditions them on the parents'
  values), the kernel's rows are the PyTorch path's, bit for bit in float64; in float32 they are
  the PyTorch path's run in float64 on the (exactly) upcast inputs and noise, since the kernel
  computes in double. The float32 PyTorch path rounds alpha and the logits (without replacement:
  the perturbed values) to float32, so a draw whose two best perturbed logits lie within that
  rounding may differ, and without replacement a sentence whose keys come that close may order
  its rows differently; the tests bound both. Ragged lengths with 0 and 1, -inf transitions,
  start and end, a sentence with no allowed sequence, shared and per-example transitions (per
  sentence and per position); without replacement also n above the number of allowed sequences
  (rows that hold none) and random CRFs from peaked to flat, where the kernel's pruning (it scores
  only the children that can enter the top n) is exercised.
- The front end: crfkit.sample(..., replacement=...) on the compiled backend runs the kernel on
  the CPU, and a generator seeded alike gives the reference backend's rows and log-probs (the
  noise is drawn in one order).
- The distribution: tests/test_sampling.py runs its chi-square tests with replacement (which also
  show that the bound rejects a wrong distribution) and its Plackett-Luce order, inclusion
  probability, first-row and edge-case tests without replacement on these kernels too (its
  `sampler` fixture).
- Bad input: a clear error naming the argument.

Tests that hold for both samplers are parametrized over them (with_replacement,
without_replacement); the others come in a section per sampler. Every test skips where the
compiled extension is not built.
"""
import math
from dataclasses import dataclass

import pytest
import torch

import crfkit
from crfkit import reference, sampling
from test_sampling import enumerate_sentence, tiny_crf

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")]


@dataclass(frozen=True)
class Sampler:
    """One of the two samplers. `name` is at once its op (torch.ops.crfkit.<name>), its PyTorch
    path (reference.<name>, the backends' fallback), its compiled._KERNELS key ((name, device))
    and the numba backend's attribute; `replacement` is the crfkit.sample flag that picks it."""
    name: str
    replacement: bool

    @property
    def op(self):
        return getattr(torch.ops.crfkit, self.name)

    @property
    def id(self):
        return self.name.removeprefix("sample_")  # with_replacement, without_replacement


WITH = Sampler("sample_with_replacement", replacement=True)
WITHOUT = Sampler("sample_without_replacement", replacement=False)
both_samplers = pytest.mark.parametrize("sampler", [WITH, WITHOUT], ids=lambda s: s.id)


def kernel(sampler, emissions, transitions, noise, lengths, start, end):
    return sampler.op(emissions, transitions, noise, lengths, start, end)


def pytorch_path(sampler, crf, n, noise):
    emissions, transitions, lengths, start, end = crf
    return sampling.sample(emissions, transitions, n, lengths, start, end, replacement=sampler.replacement,
                           noise=noise)


def upcast(crf):
    return [x.double() if x.is_floating_point() else x for x in crf]


def noise_for(emissions, n, seed):
    B, L, T = emissions.shape
    return reference.gumbel_noise((L, B, n, T), emissions, torch.Generator().manual_seed(seed))


def ragged_crf(form, dtype, seed=0):
    """A batch with lengths 7, 0, 1, 3, 7, 2, 6, 1; -inf transitions, a forbidden first and last tag,
    a forbidden emission; sentence 4 has no allowed sequence (every tag forbidden at position 3).
    form: "shared" ((T, T), start / end (T,)), "sentence" ((B, 1, T, T)) or "position"
    ((B, L, T, T)); per example with start / end (B, T)."""
    g = torch.Generator().manual_seed(seed)
    B, L, T = 8, 7, 5

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 1.5

    lengths = torch.tensor([7, 0, 1, 3, 7, 2, 6, 1])
    emissions = draw(B, L, T)
    if form == "shared":
        transitions, start, end = draw(T, T), draw(T), draw(T)
    else:
        transitions, start, end = draw(B, 1 if form == "sentence" else L, T, T), draw(B, T), draw(B, T)
    transitions[..., 0, 2] = -math.inf
    transitions[..., 3, :2] = -math.inf
    start[..., 4] = -math.inf
    end[..., 1] = -math.inf
    emissions[0, 2, 0] = -math.inf
    emissions[4, 3] = -math.inf
    return [x.to(dtype) if x.is_floating_point() else x for x in (emissions, transitions, lengths, start, end)]


FORMS = ["shared", "sentence", "position"]


def random_crf(B, L, T, scale, seed, dtype=torch.float64, form="shared", forbid=0.0):
    """Random lengths in [0, L] (L included); scores of standard deviation `scale`; a share
    `forbid` of the transitions -inf."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0] = L
    emissions = draw(B, L, T)
    if form == "shared":
        transitions, start, end = draw(T, T), draw(T), draw(T)
    else:
        transitions, start, end = draw(B, 1 if form == "sentence" else L, T, T), draw(B, T), draw(B, T)
    if forbid:
        transitions = transitions.masked_fill(torch.rand(transitions.shape, generator=g) < forbid, -math.inf)
    return [x.to(dtype) if x.is_floating_point() else x for x in (emissions, transitions, lengths, start, end)]


def check_rows_distinct(paths, lengths):
    """Without replacement: the rows of each sentence that hold a sequence are distinct; the others
    come last."""
    missing = sampling.missing_rows(paths, lengths, replacement=False)
    for b in range(paths.shape[0]):
        held = int((~missing[b]).sum())
        assert not missing[b, :held].any()  # the missing rows are the last ones
        rows = {tuple(r) for r in paths[b, :held, :int(lengths[b])].tolist()}
        assert len(rows) == held


# ---- the kernel, either sampler -----------------------------------------------------------------
@both_samplers
def test_the_kernel_reads_only_the_noise_of_real_positions(sampler):
    emissions, transitions, lengths, start, end = ragged_crf("shared", torch.float64)
    noise = noise_for(emissions, 20, 3)
    B, L = lengths.shape[0], emissions.shape[1]
    changed = noise.clone()
    for b in range(B):  # position i of sentence b takes noise[L - 1 - i, b]
        for i in range(int(lengths[b]), L):
            changed[L - 1 - i, b] = float("nan")
    assert torch.equal(kernel(sampler, emissions, transitions, changed, lengths, start, end),
                       kernel(sampler, emissions, transitions, noise, lengths, start, end))


@pytest.mark.parametrize("threads", [1, 2])
@both_samplers
def test_threads_do_not_change_the_rows(sampler, threads):
    emissions, transitions, lengths, start, end = ragged_crf("position", torch.float32, 4)
    noise = noise_for(emissions, 50, 4)
    one = kernel(sampler, emissions, transitions, noise, lengths, start, end)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(kernel(sampler, emissions, transitions, noise, lengths, start, end), one)
    finally:
        torch.set_num_threads(saved)


@both_samplers
def test_strided_and_expanded_arguments(sampler):
    emissions, transitions, lengths, start, end = ragged_crf("shared", torch.float64, 5)
    noise = noise_for(emissions, 30, 5)
    want = kernel(sampler, emissions, transitions, noise, lengths, start, end)
    em_t = emissions.transpose(0, 1).contiguous().transpose(0, 1)
    tr_t = transitions.t().contiguous().t()
    noise_t = noise.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert not (em_t.is_contiguous() or tr_t.is_contiguous() or noise_t.is_contiguous())
    assert torch.equal(kernel(sampler, em_t, tr_t, noise_t, lengths, start, end), want)
    # Shared transitions expanded per example give the shared kernel's rows.
    B, _, T = emissions.shape
    per_example = kernel(sampler, emissions, transitions.expand(B, 1, T, T), noise, lengths, start.expand(B, T),
                         end.expand(B, T))
    assert torch.equal(per_example, want)


@pytest.mark.parametrize("B,L,n", [(0, 4, 3), (3, 0, 3), (0, 0, 2), (3, 4, 0)])
@both_samplers
def test_empty_shapes(sampler, B, L, n):
    T = 3
    emissions = torch.zeros(B, L, T, dtype=torch.float64)
    zeros = torch.zeros(T, dtype=torch.float64)
    noise = torch.zeros(L, B, n, T, dtype=torch.float64)
    paths = kernel(sampler, emissions, torch.zeros(T, T, dtype=torch.float64), noise, torch.full((B,), L), zeros,
                   zeros)
    assert paths.shape == (B, n, L) and paths.dtype == torch.int64 and (paths == -1).all()


@both_samplers
def test_opcheck_and_torch_compile(sampler):
    emissions, transitions, lengths, start, end = ragged_crf("sentence", torch.float32, 6)
    noise = noise_for(emissions, 4, 6)
    args = (emissions, transitions, noise, lengths, start, end)
    op = sampler.op
    torch.library.opcheck(op, args)
    torch._dynamo.reset()
    try:
        compiled_fn = torch.compile(lambda *a: op(*a), fullgraph=True)
        assert torch.equal(compiled_fn(*args), kernel(sampler, *args))
    finally:
        torch._dynamo.reset()


# ---- the kernel with replacement ----------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float64_paths_equal_the_pytorch_path_given_the_same_noise(form, seed):
    crf = ragged_crf(form, torch.float64, seed)
    n = 300
    noise = noise_for(crf[0], n, seed + 10)
    got = kernel(WITH, crf[0], crf[1], noise, *crf[2:])
    want = pytorch_path(WITH, crf, n, noise)
    assert got.dtype == torch.int64 and got.shape == want.shape == (8, n, 7)
    assert torch.equal(got, want)
    assert (got[1] == -1).all() and (got[4] == -1).all()  # the empty sentence; no allowed sequence
    assert (got[2, :, 1:] == -1).all() and (got[2, :, 0] >= 0).all()  # length 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_paths_equal_the_pytorch_path_in_float64_on_the_same_noise(form, seed):
    crf32 = ragged_crf(form, torch.float32, seed)
    n = 300
    noise = noise_for(crf32[0], n, seed + 20)
    got = kernel(WITH, crf32[0], crf32[1], noise, *crf32[2:])
    assert torch.equal(got, pytorch_path(WITH, upcast(crf32), n, noise.double()))
    # The float32 PyTorch path itself: the same rows but where its float32 rounding of alpha and
    # of the logits decides a near tie (about one draw in 10^5 here).
    same_dtype = pytorch_path(WITH, crf32, n, noise)
    differing_rows = int((same_dtype != got).any(2).sum())
    assert differing_rows <= 0.002 * got.shape[0] * n, differing_rows


def test_one_tag_with_replacement():
    emissions = torch.randn(3, 2, 1, dtype=torch.float64)
    zeros = torch.zeros(1, dtype=torch.float64)
    paths = kernel(WITH, emissions, torch.zeros(1, 1, dtype=torch.float64), noise_for(emissions, 4, 0),
                   torch.tensor([2, 1, 0]), zeros, zeros)
    assert paths.tolist() == [[[0, 0]] * 4, [[0, -1]] * 4, [[-1, -1]] * 4]


# ---- the kernel without replacement -------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [1, 4, 300])
@pytest.mark.parametrize("seed", [0, 1])
def test_float64_rows_equal_the_pytorch_path_given_the_same_noise(form, n, seed):
    crf = ragged_crf(form, torch.float64, seed)
    emissions, lengths = crf[0], crf[2]
    noise = noise_for(emissions, n, seed + 30)
    got = kernel(WITHOUT, emissions, crf[1], noise, *crf[2:])
    want = pytorch_path(WITHOUT, crf, n, noise)
    assert got.dtype == torch.int64 and got.shape == want.shape == (8, n, 7)
    assert torch.equal(got, want)
    check_rows_distinct(got, lengths)
    assert (got[1] == -1).all() and (got[4] == -1).all()  # the empty sentence; no allowed sequence
    assert (got[2, :, 1:] == -1).all() and (got[2, 0, 0] >= 0)  # length 1
    if n == 300:  # more rows than sequences: every allowed sequence once, then rows that hold none
        for b in (2, 3, 5, 7):  # lengths 1, 3, 2, 1
            allowed = {seq for seq, _ in enumerate_sentence(crf, b)}
            held = int((got[b, :, 0] >= 0).sum())
            assert held == len(allowed) < n
            assert {tuple(r) for r in got[b, :held, :int(lengths[b])].tolist()} == allowed
            assert (got[b, held:] == -1).all()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_rows_equal_the_pytorch_path_in_float64_on_the_same_noise(form, seed):
    crf32 = ragged_crf(form, torch.float32, seed)
    n = 40
    noise = noise_for(crf32[0], n, seed + 40)
    got = kernel(WITHOUT, crf32[0], crf32[1], noise, *crf32[2:])
    assert torch.equal(got, pytorch_path(WITHOUT, upcast(crf32), n, noise.double()))
    # The float32 PyTorch path itself: the same rows but where its float32 rounding decides a near tie.
    same_dtype = pytorch_path(WITHOUT, crf32, n, noise)
    differing_sentences = int((same_dtype != got).any(2).any(1).sum())
    assert differing_sentences <= 1, differing_sentences


@pytest.mark.parametrize("scale", [0.0, 0.3, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("T,n", [(2, 3), (5, 1), (5, 7), (9, 5), (9, 15), (37, 15), (37, 40)])
def test_float64_rows_equal_the_pytorch_path_on_random_crfs(scale, T, n):
    # From flat (every sequence equally likely: many close perturbed values) to peaked, with n
    # below, near and above T: the kernel scores only the children that can enter the top n
    # (csrc/cpu/sampling.cpp), the PyTorch path all of them.
    crf = random_crf(6, 12, T, scale, seed=T * 100 + n + int(scale * 10), forbid=0.2)
    noise = noise_for(crf[0], n, T + n)
    got = kernel(WITHOUT, crf[0], crf[1], noise, *crf[2:])
    assert torch.equal(got, pytorch_path(WITHOUT, crf, n, noise))
    check_rows_distinct(got, crf[2])


@pytest.mark.parametrize("form", ["sentence", "position"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_per_example_crfs(form, dtype):
    crf = random_crf(5, 16, 6, 1.5, seed=3, dtype=dtype, form=form, forbid=0.3)
    noise = noise_for(crf[0], 9, 5)
    got = kernel(WITHOUT, crf[0], crf[1], noise, *crf[2:])
    assert torch.equal(got, pytorch_path(WITHOUT, upcast(crf), 9, noise.double()))
    check_rows_distinct(got, crf[2])


def test_the_rows_are_allowed_sequences():
    crf = ragged_crf("position", torch.float64, 3)
    got = kernel(WITHOUT, crf[0], crf[1], noise_for(crf[0], 50, 3), *crf[2:])
    missing = sampling.missing_rows(got, crf[2], replacement=False)
    scores = reference.sequence_score(crf[0], crf[1], got.clamp(min=0), crf[2], crf[3], crf[4])
    assert torch.isfinite(scores[~missing]).all()  # no forbidden tag, transition, first or last tag
    assert missing[4].all() and missing[1].tolist() == [False] + [True] * 49


def test_the_noise_decides_the_rows():
    crf = ragged_crf("shared", torch.float64, 2)
    first = kernel(WITHOUT, crf[0], crf[1], noise_for(crf[0], 6, 1), *crf[2:])
    assert not torch.equal(first, kernel(WITHOUT, crf[0], crf[1], noise_for(crf[0], 6, 2), *crf[2:]))


def test_one_tag_without_replacement():
    emissions = torch.randn(3, 2, 1, dtype=torch.float64)
    zeros = torch.zeros(1, dtype=torch.float64)
    paths = kernel(WITHOUT, emissions, torch.zeros(1, 1, dtype=torch.float64), noise_for(emissions, 3, 0),
                   torch.tensor([2, 1, 0]), zeros, zeros)
    # One sequence per sentence: row 0 holds it, the other rows none.
    assert paths.tolist() == [[[0, 0], [-1, -1], [-1, -1]], [[0, -1], [-1, -1], [-1, -1]], [[-1, -1]] * 3]


# ---- the front end, either sampler: crfkit.sample -----------------------------------------------
def test_noise_drawn_at_once_is_the_noise_drawn_per_position():
    # What makes the kernel's samples the PyTorch path's for one generator: torch.rand draws its
    # elements in order on the CPU, so (L, B, n, T) at once is L draws of (B, n, T) in turn.
    like = torch.zeros(1, dtype=torch.float32)
    for dtype in (torch.float32, torch.float64):
        like = like.to(dtype)
        at_once = reference.gumbel_noise((6, 3, 5, 7), like, torch.Generator().manual_seed(9))
        g = torch.Generator().manual_seed(9)
        in_turn = torch.stack([reference.gumbel_noise((3, 5, 7), like, g) for _ in range(6)])
        assert torch.equal(at_once, in_turn)


@both_samplers
def test_crfkit_sample_takes_the_kernel_on_the_cpu_and_the_pytorch_path_elsewhere(sampler, monkeypatch):
    calls = []
    pytorch = getattr(reference, sampler.name)

    def watched(*args, **kwargs):
        calls.append(1)
        return pytorch(*args, **kwargs)

    monkeypatch.setattr(reference, sampler.name, watched)
    emissions, transitions, lengths, start, end = ragged_crf("position", torch.float64, 8)
    replacement = sampler.replacement
    with crfkit.use_backend("compiled"):
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=replacement)
        assert calls == []  # the kernel
        em = emissions.clone().requires_grad_()
        drawn = crfkit.sample(em, transitions, 5, lengths, start, end, replacement=replacement)
        assert calls == []  # also when the log-probabilities are differentiable
        drawn.log_probs[drawn.log_probs > -math.inf].sum().backward()
        assert torch.isfinite(em.grad).all()
        # Without a kernel for the device (a build without it): the PyTorch path.
        from crfkit.backends import compiled

        monkeypatch.setitem(compiled._KERNELS, (sampler.name, "CPU"), False)
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=replacement)
        assert calls == [1]
        monkeypatch.setitem(compiled._KERNELS, (sampler.name, "CPU"), True)
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=not replacement)
        assert calls == [1]  # the other sampler: not this one's PyTorch path
    with crfkit.use_backend("reference"):
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=replacement)
        assert calls == [1, 1]


@both_samplers
def test_the_numba_backend_falls_back_to_the_pytorch_path(sampler):
    if "numba" not in crfkit.backends.available():
        pytest.skip("numba is not installed")
    from crfkit.backends import numba_backend

    assert getattr(numba_backend, sampler.name) is getattr(reference, sampler.name)


# ---- the front end with replacement -------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_crfkit_sample_gives_the_reference_backends_samples(form, dtype):
    emissions, transitions, lengths, start, end = ragged_crf(form, dtype, 7)
    results = {}
    for backend in ("compiled", "reference"):
        g = torch.Generator().manual_seed(11)
        with crfkit.use_backend(backend):
            results[backend] = crfkit.sample(emissions, transitions, 200, lengths, start, end, generator=g)
        results[backend + " state"] = g.get_state()
    got, want = results["compiled"], results["reference"]
    assert torch.equal(results["compiled state"], results["reference state"])  # as many numbers drawn
    if dtype == torch.float64:
        assert torch.equal(got.paths, want.paths)
        torch.testing.assert_close(got.log_probs, want.log_probs)
    else:  # (see test_float32_paths_equal_the_pytorch_path_in_float64_on_the_same_noise)
        same = (got.paths == want.paths).all(2)
        assert float(same.float().mean()) > 0.998
        torch.testing.assert_close(got.log_probs[same], want.log_probs[same], rtol=1e-5, atol=1e-5)
    assert (got.log_probs[4] == -math.inf).all() and (got.log_probs[1] == 0).all()


def test_mask_and_allowed_reach_the_kernel_with_replacement():
    emissions, transitions, _, start, end = tiny_crf(3, [4, 4], 6, forbid=False)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    allowed = torch.ones(2, 4, 3, dtype=torch.bool)
    allowed[:, :, 2] = False
    with crfkit.use_backend("compiled"):
        paths = crfkit.sample(emissions, transitions, 500, start=start, end=end, mask=mask, allowed=allowed,
                              generator=torch.Generator().manual_seed(1)).paths
    assert (paths[0, :, 1] == -1).all()
    real = paths[mask.unsqueeze(1).expand_as(paths)]
    assert ((real == 0) | (real == 1)).all()


# ---- the front end without replacement: crfkit.sample(..., replacement=False) -------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_crfkit_sample_gives_the_reference_backends_rows(form, dtype):
    emissions, transitions, lengths, start, end = ragged_crf(form, dtype, 7)
    results = {}
    for backend in ("compiled", "reference"):
        g = torch.Generator().manual_seed(11)
        with crfkit.use_backend(backend):
            results[backend] = crfkit.sample(emissions, transitions, 60, lengths, start, end, replacement=False,
                                             generator=g)
        results[backend + " state"] = g.get_state()
    got, want = results["compiled"], results["reference"]
    assert torch.equal(results["compiled state"], results["reference state"])  # as many numbers drawn
    if dtype == torch.float64:
        assert torch.equal(got.paths, want.paths)
        torch.testing.assert_close(got.log_probs, want.log_probs)
    else:  # (see test_float32_rows_equal_the_pytorch_path_in_float64_on_the_same_noise)
        same = (got.paths == want.paths).all(2)
        assert int((~same).any(1).sum()) <= 1
        torch.testing.assert_close(got.log_probs[same], want.log_probs[same], rtol=1e-5, atol=1e-5)
    assert (got.log_probs[4] == -math.inf).all()  # no allowed sequence
    assert got.log_probs[1, 0] == 0 and (got.log_probs[1, 1:] == -math.inf).all()  # the empty sequence, once
    # Rows in the order of sequential drawing; a sentence's rows are distinct sequences.
    check_rows_distinct(got.paths, lengths)


def test_mask_and_allowed_reach_the_kernel_without_replacement():
    emissions, transitions, _, start, end = tiny_crf(3, [4, 4], 6, forbid=False)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    allowed = torch.ones(2, 4, 3, dtype=torch.bool)
    allowed[:, :, 2] = False
    with crfkit.use_backend("compiled"):
        drawn = crfkit.sample(emissions, transitions, 20, start=start, end=end, mask=mask, allowed=allowed,
                              replacement=False, generator=torch.Generator().manual_seed(1))
    paths = drawn.paths
    # Sentence 0 has 3 real positions, 2 allowed tags each: 8 sequences, then 12 rows that hold none.
    assert (paths[0, :, 1] == -1).all() and (paths[0, :8] != -1).sum() == 8 * 3 and (paths[0, 8:] == -1).all()
    assert (drawn.log_probs[0, :8] > -math.inf).all() and (drawn.log_probs[0, 8:] == -math.inf).all()
    real = paths[0, :8][:, [0, 2, 3]]
    assert ((real == 0) | (real == 1)).all() and len({tuple(r) for r in real.tolist()}) == 8
    # The 8 rows are all the allowed sequences: their probabilities sum to 1.
    assert float(drawn.log_probs[0, :8].exp().sum()) == pytest.approx(1.0, abs=1e-12)
    assert len({tuple(r) for r in paths[1, :16].tolist()}) == 16 and (paths[1, :16] >= 0).all()
    assert (paths[1, 16:] == -1).all()


# ---- bad input ----------------------------------------------------------------------------------
def small_crf():
    """2 sentences of lengths 4 and 2, 4 positions, 3 tags, float64."""
    g = torch.Generator().manual_seed(9)
    emissions, transitions = torch.randn(2, 4, 3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g,
                                                                                               dtype=torch.float64)
    start, end = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    return emissions, transitions, torch.tensor([4, 2]), start, end


def _bad_calls():
    # (No device case: on a CPU-only machine the other device is "meta", whose dispatch key takes a
    # call with any meta argument to the fake implementation, not to this kernel.)
    emissions, transitions, lengths, start, end = small_crf()
    noise = noise_for(emissions, 2, 9)
    inf_noise = noise.clone()
    inf_noise[0, 0, 1, 0] = float("inf")  # position 3 of sentence 0 (length 4)
    per_example = transitions.expand(2, 1, 3, 3)
    nan = torch.tensor(math.nan, dtype=torch.float64)
    return {
        "noise rank": ((emissions, transitions, noise[0], lengths, start, end),
                       r"noise must be \(seq_len, batch, num_samples, num_tags\) = \(4, 2, n, 3\), got \[2, 2, 3\]"),
        "noise positions": ((emissions, transitions, noise[1:], lengths, start, end),
                            r"noise must be \(seq_len, batch, num_samples, num_tags\)"),
        "noise tags": ((emissions, transitions, noise[..., :2], lengths, start, end),
                       r"noise must be .* got \[4, 2, 2, 2\]"),
        "noise dtype": ((emissions, transitions, noise.float(), lengths, start, end),
                        r"noise must have the dtype of emissions"),
        "noise +inf": ((emissions, transitions, inf_noise, lengths, start, end),
                       r"noise\[:, 0\] contains NaN or \+-inf within the sentence's length"),
        "emissions dtype": ((emissions.long(), transitions.long(), noise.long(), lengths, start.long(), end.long()),
                            r"float32 or float64 emissions"),
        "emissions rank": ((emissions[0], transitions, noise, lengths, start, end),
                           r"emissions must be \(batch, seq_len, num_tags\)"),
        "emissions NaN": ((emissions.index_put((torch.tensor(0), torch.tensor(1), torch.tensor(2)),
                                               nan), transitions, noise, lengths, start, end),
                          r"emissions\[0\] contains NaN or \+inf within its length"),
        "transitions shape": ((emissions, transitions[:2], noise, lengths, start, end),
                              r"transitions must be \(num_tags, num_tags\)"),
        "transitions dtype": ((emissions, transitions.float(), noise, lengths, start, end),
                              r"transitions, start and end must have the dtype of emissions"),
        "transitions NaN": ((emissions, transitions.index_put((torch.tensor(0), torch.tensor(1)),
                                                              nan), noise, lengths, start, end),
                            r"transitions contains NaN or \+inf"),
        "per-example start": ((emissions, per_example, noise, lengths, start, end.expand(2, 3)),
                              r"start must be \(batch, num_tags\) = \(2, 3\)"),
        "per-example transitions": ((emissions, transitions.expand(2, 3, 3, 3), noise, lengths, start.expand(2, 3),
                                     end.expand(2, 3)), r"transitions must be .* per example"),
        "lengths dtype": ((emissions, transitions, noise, lengths.int(), start, end), r"lengths must be int64"),
        "lengths value": ((emissions, transitions, noise, torch.tensor([5, 0]), start, end),
                          r"lengths\[0\] = 5 is outside \[0, seq_len = 4\]"),
        "end shape": ((emissions, transitions, noise, lengths, start, end[:2]), r"end must be \(num_tags,\)"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()) if "compiled" in crfkit.backends.available() else [])
@both_samplers
def test_bad_arguments_raise_naming_them(sampler, case):
    args, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        kernel(sampler, *args)


@both_samplers
def test_nan_noise_at_padded_positions_is_not_read(sampler):
    emissions, transitions, _, start, end = small_crf()
    noise = noise_for(emissions, 2, 9)
    lengths = torch.tensor([4, 0])
    noise[:, 1] = float("nan")  # sentence 1 has no real position
    paths = kernel(sampler, emissions, transitions, noise, lengths, start, end)
    assert (paths[1] == -1).all() and (paths[0] >= 0).all()


def test_pytorch_path_checks_the_noise_it_is_given():  # (without replacement)
    crf = small_crf()
    noise = noise_for(crf[0], 2, 9)
    with pytest.raises(ValueError, match=r"noise must be \(seq_len, batch, n, num_tags\)"):
        pytorch_path(WITHOUT, crf, 3, noise)
    with pytest.raises(ValueError, match=r"noise must be .* of dtype torch.float64"):
        pytorch_path(WITHOUT, crf, 2, noise.float())
