"""The C++ CPU kernel of sampling WITHOUT replacement (csrc/cpu/sampling.cpp,
torch.ops.crfkit.sample_without_replacement: stochastic beam search) against the PyTorch path
(crfkit/sampling.py's _without_replacement).

- Parity: given the same Gumbel noise (L, B, n, T), the standard Gumbels the PyTorch path draws for
  every child of every beam before it conditions them on the parents' values, the kernel's rows
  are the PyTorch path's, bit for bit in float64; in float32 they are the PyTorch path's run in
  float64 on the (exactly) upcast inputs and noise, since the kernel computes in double (the
  float32 PyTorch path rounds alpha and the perturbed values to float32: a sentence whose keys come
  within that rounding of each other may order its rows differently, which the test bounds).
  Ragged lengths with 0 and 1, -inf transitions, start and end, a sentence with no allowed
  sequence, n above the number of allowed sequences (rows that hold none), shared and per-example
  transitions (per sentence and per position), and random CRFs from peaked to flat, where the
  kernel's pruning (it scores only the children that can enter the top n) is exercised.
- The front end: crfkit.sample(..., replacement=False) on the compiled backend runs the kernel on
  the CPU and gives, for a generator seeded alike, the reference backend's rows and log-probs.
- The exact distribution: tests/test_sampling.py runs its Plackett-Luce order, inclusion
  probability, first-row and edge-case tests on this kernel too (its `sampler` fixture).
- Bad input: a clear error naming the argument.

Every test skips where the compiled extension is not built.
"""
import math

import pytest
import torch

import crfkit
from crfkit import reference, sampling
from test_sampling import enumerate_sentence, tiny_crf
from test_sampling_kernel import FORMS, _bad_calls, noise_for, ragged_crf, small_crf

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif("compiled" not in crfkit.backends.available(), reason="extension not built")]


def kernel(emissions, transitions, noise, lengths, start, end):
    return torch.ops.crfkit.sample_without_replacement(emissions, transitions, noise, lengths, start, end)


def pytorch_path(crf, n, noise):
    emissions, transitions, lengths, start, end = crf
    return sampling.sample(emissions, transitions, n, lengths, start, end, replacement=False, noise=noise)


def upcast(crf):
    return [x.double() if x.is_floating_point() else x for x in crf]


def check_rows_distinct(paths, lengths):
    """The rows of each sentence that hold a sequence are distinct; the others come last."""
    missing = sampling.missing_rows(paths, lengths, replacement=False)
    for b in range(paths.shape[0]):
        held = int((~missing[b]).sum())
        assert not missing[b, :held].any()  # the missing rows are the last ones
        rows = {tuple(r) for r in paths[b, :held, :int(lengths[b])].tolist()}
        assert len(rows) == held


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


# ---- parity with the PyTorch path ---------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [1, 4, 300])
@pytest.mark.parametrize("seed", [0, 1])
def test_float64_rows_equal_the_pytorch_path_given_the_same_noise(form, n, seed):
    crf = ragged_crf(form, torch.float64, seed)
    emissions, lengths = crf[0], crf[2]
    noise = noise_for(emissions, n, seed + 30)
    got = kernel(emissions, crf[1], noise, *crf[2:])
    want = pytorch_path(crf, n, noise)
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
    got = kernel(crf32[0], crf32[1], noise, *crf32[2:])
    assert torch.equal(got, pytorch_path(upcast(crf32), n, noise.double()))
    # The float32 PyTorch path itself: the same rows but where its float32 rounding decides a near tie.
    same_dtype = pytorch_path(crf32, n, noise)
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
    got = kernel(crf[0], crf[1], noise, *crf[2:])
    assert torch.equal(got, pytorch_path(crf, n, noise))
    check_rows_distinct(got, crf[2])


@pytest.mark.parametrize("form", ["sentence", "position"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_per_example_crfs(form, dtype):
    crf = random_crf(5, 16, 6, 1.5, seed=3, dtype=dtype, form=form, forbid=0.3)
    noise = noise_for(crf[0], 9, 5)
    got = kernel(crf[0], crf[1], noise, *crf[2:])
    assert torch.equal(got, pytorch_path(upcast(crf), 9, noise.double()))
    check_rows_distinct(got, crf[2])


def test_the_rows_are_allowed_sequences():
    crf = ragged_crf("position", torch.float64, 3)
    got = kernel(crf[0], crf[1], noise_for(crf[0], 50, 3), *crf[2:])
    missing = sampling.missing_rows(got, crf[2], replacement=False)
    scores = reference.sequence_score(crf[0], crf[1], got.clamp(min=0), crf[2], crf[3], crf[4])
    assert torch.isfinite(scores[~missing]).all()  # no forbidden tag, transition, first or last tag
    assert missing[4].all() and missing[1].tolist() == [False] + [True] * 49


def test_the_kernel_reads_only_the_noise_of_real_positions():
    emissions, transitions, lengths, start, end = ragged_crf("shared", torch.float64)
    noise = noise_for(emissions, 20, 3)
    B, L = lengths.shape[0], emissions.shape[1]
    changed = noise.clone()
    for b in range(B):  # position i of sentence b takes noise[L - 1 - i, b]
        for i in range(int(lengths[b]), L):
            changed[L - 1 - i, b] = float("nan")
    assert torch.equal(kernel(emissions, transitions, changed, lengths, start, end),
                       kernel(emissions, transitions, noise, lengths, start, end))


def test_the_noise_decides_the_rows():
    crf = ragged_crf("shared", torch.float64, 2)
    first = kernel(crf[0], crf[1], noise_for(crf[0], 6, 1), *crf[2:])
    assert not torch.equal(first, kernel(crf[0], crf[1], noise_for(crf[0], 6, 2), *crf[2:]))


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_rows(threads):
    emissions, transitions, lengths, start, end = ragged_crf("position", torch.float32, 4)
    noise = noise_for(emissions, 50, 4)
    one = kernel(emissions, transitions, noise, lengths, start, end)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(kernel(emissions, transitions, noise, lengths, start, end), one)
    finally:
        torch.set_num_threads(saved)


def test_strided_and_expanded_arguments():
    emissions, transitions, lengths, start, end = ragged_crf("shared", torch.float64, 5)
    noise = noise_for(emissions, 30, 5)
    want = kernel(emissions, transitions, noise, lengths, start, end)
    em_t = emissions.transpose(0, 1).contiguous().transpose(0, 1)
    tr_t = transitions.t().contiguous().t()
    noise_t = noise.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert not (em_t.is_contiguous() or tr_t.is_contiguous() or noise_t.is_contiguous())
    assert torch.equal(kernel(em_t, tr_t, noise_t, lengths, start, end), want)
    B, _, T = emissions.shape
    per_example = kernel(emissions, transitions.expand(B, 1, T, T), noise, lengths, start.expand(B, T),
                         end.expand(B, T))
    assert torch.equal(per_example, want)


@pytest.mark.parametrize("B,L,n", [(0, 4, 3), (3, 0, 3), (0, 0, 2), (3, 4, 0)])
def test_empty_shapes(B, L, n):
    T = 3
    emissions = torch.zeros(B, L, T, dtype=torch.float64)
    zeros = torch.zeros(T, dtype=torch.float64)
    noise = torch.zeros(L, B, n, T, dtype=torch.float64)
    paths = kernel(emissions, torch.zeros(T, T, dtype=torch.float64), noise, torch.full((B,), L), zeros, zeros)
    assert paths.shape == (B, n, L) and paths.dtype == torch.int64 and (paths == -1).all()


def test_one_tag():
    emissions = torch.randn(3, 2, 1, dtype=torch.float64)
    zeros = torch.zeros(1, dtype=torch.float64)
    paths = kernel(emissions, torch.zeros(1, 1, dtype=torch.float64), noise_for(emissions, 3, 0),
                   torch.tensor([2, 1, 0]), zeros, zeros)
    # One sequence per sentence: row 0 holds it, the other rows none.
    assert paths.tolist() == [[[0, 0], [-1, -1], [-1, -1]], [[0, -1], [-1, -1], [-1, -1]], [[-1, -1]] * 3]


def test_opcheck_and_torch_compile():
    emissions, transitions, lengths, start, end = ragged_crf("sentence", torch.float32, 6)
    noise = noise_for(emissions, 4, 6)
    args = (emissions, transitions, noise, lengths, start, end)
    torch.library.opcheck(torch.ops.crfkit.sample_without_replacement, args)
    torch._dynamo.reset()
    try:
        compiled_fn = torch.compile(lambda *a: torch.ops.crfkit.sample_without_replacement(*a), fullgraph=True)
        assert torch.equal(compiled_fn(*args), kernel(*args))
    finally:
        torch._dynamo.reset()


# ---- the front end: crfkit.sample(..., replacement=False) ---------------------------------------
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


def test_crfkit_sample_takes_the_kernel_on_the_cpu_and_the_pytorch_path_elsewhere(monkeypatch):
    calls = []
    pytorch = reference.sample_without_replacement

    def watched(*args, **kwargs):
        calls.append(1)
        return pytorch(*args, **kwargs)

    monkeypatch.setattr(reference, "sample_without_replacement", watched)
    emissions, transitions, lengths, start, end = ragged_crf("position", torch.float64, 8)
    with crfkit.use_backend("compiled"):
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=False)
        assert calls == []  # the kernel
        em = emissions.clone().requires_grad_()
        drawn = crfkit.sample(em, transitions, 5, lengths, start, end, replacement=False)
        assert calls == []  # also when the log-probabilities are differentiable
        drawn.log_probs[drawn.log_probs > -math.inf].sum().backward()
        assert torch.isfinite(em.grad).all()
        # Without a kernel for the device (a build without it): the PyTorch path.
        from crfkit.backends import compiled

        monkeypatch.setitem(compiled._KERNELS, ("sample_without_replacement", "CPU"), False)
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=False)
        assert calls == [1]
        monkeypatch.setitem(compiled._KERNELS, ("sample_without_replacement", "CPU"), True)
        crfkit.sample(emissions, transitions, 5, lengths, start, end)
        assert calls == [1]  # with replacement: not this sampler
    with crfkit.use_backend("reference"):
        crfkit.sample(emissions, transitions, 5, lengths, start, end, replacement=False)
        assert calls == [1, 1]


def test_the_numba_backend_falls_back_to_the_pytorch_path():
    if "numba" not in crfkit.backends.available():
        pytest.skip("numba is not installed")
    from crfkit.backends import numba_backend

    assert numba_backend.sample_without_replacement is reference.sample_without_replacement


def test_mask_and_allowed_reach_the_kernel():
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
@pytest.mark.parametrize("case", list(_bad_calls()) if "compiled" in crfkit.backends.available() else [])
def test_bad_arguments_raise_naming_them(case):
    args, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        kernel(*args)


def test_nan_noise_at_padded_positions_is_not_read():
    emissions, transitions, _, start, end = small_crf()
    noise = noise_for(emissions, 2, 9)
    lengths = torch.tensor([4, 0])
    noise[:, 1] = float("nan")  # sentence 1 has no real position
    paths = kernel(emissions, transitions, noise, lengths, start, end)
    assert (paths[1] == -1).all() and (paths[0] >= 0).all()


def test_pytorch_path_checks_the_noise_it_is_given():
    crf = small_crf()
    noise = noise_for(crf[0], 2, 9)
    with pytest.raises(ValueError, match=r"noise must be \(seq_len, batch, n, num_tags\)"):
        pytorch_path(crf, 3, noise)
    with pytest.raises(ValueError, match=r"noise must be .* of dtype torch.float64"):
        pytorch_path(crf, 2, noise.float())
