"""Wrong input raises a clear exception that names the argument; nothing crashes, hangs or
returns NaN. Non-contiguous and expanded tensors are not wrong: they must work."""
import math

import pytest
import torch

import crfkit
from crfkit import _arguments
from conftest import random_crf

OPS = {
    "log_partition": lambda em, tr, **kw: crfkit.log_partition(em, tr, **kw),
    "marginals": lambda em, tr, **kw: crfkit.marginals(em, tr, **kw),
    "viterbi": lambda em, tr, **kw: crfkit.viterbi(em, tr, **kw),
    "kbest_viterbi": lambda em, tr, **kw: crfkit.kbest_viterbi(em, tr, 3, **kw),
    "sequence_score": lambda em, tr, **kw: crfkit.sequence_score(em, tr, torch.zeros(2, 4, dtype=torch.long), **kw),
    "expected_transition_counts": lambda em, tr, **kw: crfkit.expected_transition_counts(em, tr, **kw),
    # (a generator of its own: two calls with the same arguments give the same samples)
    "sample": lambda em, tr, **kw: crfkit.sample(em, tr, 3, generator=torch.Generator().manual_seed(0), **kw),
    "sample_without_replacement": lambda em, tr, **kw: crfkit.sample(
        em, tr, 3, replacement=False, generator=torch.Generator().manual_seed(0), **kw),
}


def good():
    """Valid float32 inputs of 2 sentences, 4 positions, 3 tags (the shapes OPS expects)."""
    em, tr, ln, s, e = random_crf(2, 4, 3, dtype=torch.float32)
    return em, tr, dict(lengths=ln, start=s, end=e)


CASES = [
    # (description, mutate(em, tr, kw) -> (em, tr, kw), exception, message pattern)
    ("2-d emissions", lambda em, tr, kw: (em[0], tr, kw), ValueError, "emissions must have 3 dimensions"),
    ("integer emissions", lambda em, tr, kw: (em.long(), tr, kw), TypeError, "emissions must be a floating-point"),
    ("list emissions", lambda em, tr, kw: (em.tolist(), tr, kw), TypeError, "emissions must be a torch.Tensor"),
    ("no tags", lambda em, tr, kw: (em[:, :, :0], tr[:0, :0], {**kw, "start": None, "end": None}), ValueError,
     "at least one tag"),
    ("transitions missing", lambda em, tr, kw: (em, None, kw), TypeError, "transitions is required"),
    ("transitions shape", lambda em, tr, kw: (em, tr[:2], kw), ValueError, "transitions must have shape"),
    ("transitions rank", lambda em, tr, kw: (em, tr[0], kw), ValueError,
     r"transitions must have shape \(3, 3\) or \(2, 3, 3\) or"),
    ("transitions dtype", lambda em, tr, kw: (em, tr.double(), kw), TypeError, "transitions has dtype torch.float64"),
    ("transitions device", lambda em, tr, kw: (em, tr.to("meta"), kw), ValueError, "transitions is on meta"),
    ("start shape", lambda em, tr, kw: (em, tr, {**kw, "start": kw["start"][:2]}), ValueError, "start must have shape"),
    ("end dtype", lambda em, tr, kw: (em, tr, {**kw, "end": kw["end"].long()}), TypeError, "end has dtype"),
    ("lengths float", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"].float()}), TypeError,
     "lengths must be an integer"),
    ("lengths bool", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"] > 0}), TypeError,
     "lengths must be an integer"),
    ("lengths shape", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"][:1]}), ValueError,
     "lengths must have shape"),
    ("lengths rank", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"][:, None]}), ValueError,
     "lengths must have 1 dimensions"),
    ("lengths negative", lambda em, tr, kw: (em, tr, {**kw, "lengths": torch.tensor([4, -1])}), ValueError,
     r"lengths must lie in \[0, seq_len = 4\]"),
    ("lengths too long", lambda em, tr, kw: (em, tr, {**kw, "lengths": torch.tensor([5, 1])}), ValueError,
     r"lengths must lie in \[0, seq_len = 4\]"),
    ("lengths device", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"].to("meta")}), ValueError,
     "lengths is on meta"),
    ("NaN emission", lambda em, tr, kw: (em.index_put((torch.tensor(1), torch.tensor(0), torch.tensor(2)),
                                                      torch.tensor(math.nan)), tr, kw),
     ValueError, r"^crfkit: emissions\[1\] contains NaN or \+inf within its length \(use -inf to forbid a tag\)$"),
    ("+inf emission", lambda em, tr, kw: (em.index_put((torch.tensor(0), torch.tensor(0), torch.tensor(0)),
                                                       torch.tensor(math.inf)), tr, kw),
     ValueError, r"^crfkit: emissions\[0\] contains NaN or \+inf within its length \(use -inf to forbid a tag\)$"),
    ("NaN transition", lambda em, tr, kw: (em, tr.index_put((torch.tensor(0), torch.tensor(1)),
                                                            torch.tensor(math.nan)), kw),
     ValueError, r"^crfkit: transitions contains NaN or \+inf \(use -inf to forbid a transition\)$"),
    ("+inf start", lambda em, tr, kw: (em, tr, {**kw, "start": torch.tensor([0.0, math.inf, 0.0])}), ValueError,
     r"^crfkit: start contains NaN or \+inf \(use -inf to forbid a first tag\)$"),
    ("NaN end", lambda em, tr, kw: (em, tr, {**kw, "end": torch.tensor([0.0, 0.0, math.nan])}), ValueError,
     r"^crfkit: end contains NaN or \+inf \(use -inf to forbid a last tag\)$"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_raises_a_clear_error(backend, op, case):
    _, mutate, exception, pattern = case
    em, tr, kw = mutate(*good())
    with pytest.raises(exception, match=pattern):
        OPS[op](em, tr, **kw)


@pytest.mark.parametrize("k,exception", [(0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError),
                                         ("3", TypeError)])
def test_bad_k(backend, k, exception):
    em, tr, kw = good()
    with pytest.raises(exception, match="k must be"):
        crfkit.kbest_viterbi(em, tr, k, **kw)


@pytest.mark.parametrize("tags,exception,pattern", [
    (torch.full((2, 4), 3), ValueError, r"tags within the lengths must lie in \[0, num_tags = 3\)"),
    (torch.full((2, 4), -1), ValueError, "tags within the lengths"),
    (torch.zeros(2, 4), TypeError, "tags must be an integer"),
    (torch.zeros(2, 5, dtype=torch.long), ValueError, "tags must have shape"),
    (torch.zeros(4, dtype=torch.long), ValueError, "tags must have shape"),
])
def test_bad_tags(backend, tags, exception, pattern):
    em, tr, kw = good()
    with pytest.raises(exception, match=pattern):
        crfkit.sequence_score(em, tr, tags, **kw)


def test_padding_tags_are_ignored(backend):
    em, tr, kw = good()
    kw["lengths"] = torch.tensor([4, 2])
    tags = torch.tensor([[0, 1, 2, 0], [1, 1, -100, -100]])  # -100: the usual ignore index
    fixed = tags.clamp(min=0)
    torch.testing.assert_close(crfkit.sequence_score(em, tr, tags, **kw), crfkit.sequence_score(em, tr, fixed, **kw))


def test_non_contiguous_and_expanded_inputs_work(backend):
    em, tr, kw = good()
    dense = [OPS[op](em, tr, **kw) for op in OPS]
    em_t = em.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not em_t.is_contiguous()
    tr_t = tr.t().contiguous().t()
    strided = [OPS[op](em_t, tr_t, **kw) for op in OPS]
    for a, b in zip(dense, strided):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(x, y)
    # One sentence's emissions broadcast over a batch (stride 0).
    expanded = em[:1].expand(5, 4, 3)
    out = crfkit.log_partition(expanded, tr, start=kw["start"], end=kw["end"])
    assert torch.equal(out, out[:1].expand(5))


def test_raw_ops_reject_bad_arguments_without_crashing():
    if "compiled" not in crfkit.backends.available():
        pytest.skip("extension not built")
    ops = torch.ops.crfkit
    em, tr, ln, s, e = random_crf(2, 4, 3)
    with pytest.raises(ValueError, match="lengths"):
        ops.log_partition(em, tr, torch.tensor([9, 1]), s, e)
    with pytest.raises(ValueError, match="lengths must be int64"):  # a dtype: ValueError (csrc/tensor.h)
        ops.viterbi(em, tr, ln.int(), s, e)
    with pytest.raises(ValueError, match="transitions must be"):
        ops.kbest_viterbi(em, tr[:2], 2, ln, s, e)
    with pytest.raises(ValueError, match="k must be at least 1"):
        ops.kbest_viterbi(em, tr, 0, ln, s, e)
    with pytest.raises(ValueError, match="float32 or float64"):
        ops.marginals(em.half(), tr.half(), ln, s.half(), e.half())
    with pytest.raises(ValueError, match="is not a tag index"):
        ops.sequence_score(em, tr, torch.full((2, 1, 4), 7), ln, s, e)
    # Any strides are fine for the raw ops too.
    torch.testing.assert_close(ops.log_partition(em.transpose(1, 2).contiguous().transpose(1, 2), tr, ln, s, e),
                               ops.log_partition(em, tr, ln, s, e))


# The ops that autograd and crfkit.distribution call internally are registered in torch.ops.crfkit
# too, so they are checked like the public ones: each wrong argument raises ValueError naming it,
# never a crash or a silent result. (A wrong dtype too: the stable ABI that crfkit._C is built
# against can raise ValueError and RuntimeError, not TypeError; csrc/tensor.h. The public
# functions raise TypeError for it.)
def _internal_op_calls():
    ops = torch.ops.crfkit
    B, L, T = 2, 4, 3
    em, tr, ln, s, e = random_crf(B, L, T)
    f64 = {"dtype": torch.float64}  # random_crf's dtype; the dtype cases pass float32 instead
    g, marginals, counts = torch.ones(B, **f64), torch.rand(B, L, T, **f64), torch.rand(B, T, T, **f64)
    tags, grad_scores = torch.zeros(B, 1, L, dtype=torch.long), torch.ones(B, 1, **f64)
    return {
        "backward: grad_log_z shape": (lambda: ops.log_partition_backward(torch.ones(3, **f64), em, tr, ln, s, e),
                                       ValueError, r"grad_log_z must be \(batch,\) = \[2\], got \[3\]"),
        "backward: grad_log_z dtype": (lambda: ops.log_partition_backward(g.float(), em, tr, ln, s, e),
                                       ValueError, r"grad_log_z must have the dtype of emissions"),
        "backward: lengths": (lambda: ops.log_partition_backward(g, em, tr, torch.tensor([9, 1]), s, e),
                              ValueError, r"lengths\[0\] = 9 is outside"),
        "with_marginals: NaN": (lambda: ops.log_partition_with_marginals(em * float("nan"), tr, ln, s, e),
                                ValueError, r"emissions\[0\] contains NaN"),
        "with_marginals: dtype": (
            lambda: ops.log_partition_with_marginals(em.half(), tr.half(), ln, s.half(), e.half()),
                                  ValueError, r"float32 or float64 emissions"),
        "from_marginals: marginals dims": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals[0], counts, ln),
            ValueError, r"marginals must be \(batch, seq_len, num_tags\), got 2 dimensions"),
        "from_marginals: marginals dtype": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals.long(), counts.long(), ln),
            ValueError, r"marginals must be float32 or float64"),
        "from_marginals: counts shape": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals, counts[:, :, :2], ln),
            ValueError, r"transition_counts must be \(batch, num_tags, num_tags\) = \[2, 3, 3\]"),
        "from_marginals: counts dtype": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals, counts.float(), ln),
            ValueError, r"transition_counts must have the dtype of marginals"),
        "from_marginals: grad_log_z shape": (
            lambda: ops.log_partition_backward_from_marginals(torch.ones(5, **f64), marginals, counts, ln),
            ValueError, r"grad_log_z must be \(batch,\)"),
        "from_marginals: lengths batch": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals, counts, ln[:1]),
            ValueError, r"lengths must be \(batch,\) = \(2,\), got \[1\]"),
        "from_marginals: lengths dtype": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals, counts, ln.int()),
            ValueError, r"lengths must be int64"),
        "from_marginals: lengths value": (
            lambda: ops.log_partition_backward_from_marginals(g, marginals, counts, torch.tensor([9, 1])),
            ValueError, r"lengths\[0\] = 9 is outside"),
        "transition_counts: transitions": (lambda: ops.expected_transition_counts(em, tr[:2], ln, s, e),
                                           ValueError, r"transitions must be \(num_tags, num_tags\)"),
        "sequence_score_backward: emissions dims": (
            lambda: ops.sequence_score_backward(grad_scores, em[0], tags, ln),
            ValueError, r"emissions must be \(batch, seq_len, num_tags\)"),
        "sequence_score_backward: grad shape": (
            lambda: ops.sequence_score_backward(torch.ones(3, 1, **f64), em, tags, ln),
            ValueError, r"grad_scores must be \(batch, num_sequences\) = \[2, 1\], got \[3, 1\]"),
        "sequence_score_backward: grad dtype": (
            lambda: ops.sequence_score_backward(grad_scores.float(), em, tags, ln),
            ValueError, r"grad_scores must have the dtype of emissions"),
        "sequence_score_backward: tags shape": (
            lambda: ops.sequence_score_backward(grad_scores, em, tags[:, 0], ln),
            ValueError, r"tags must be \(batch, num_sequences, seq_len\)"),
        "sequence_score_backward: tags dtype": (
            lambda: ops.sequence_score_backward(grad_scores, em, tags.float(), ln),
            ValueError, r"tags must be int64"),
        "sequence_score_backward: tag value": (
            lambda: ops.sequence_score_backward(grad_scores, em, torch.full((B, 1, L), -5), ln),
            ValueError, r"tags\[0, 0, 0\] = -5 is not a tag index"),
        "sequence_score_backward: lengths": (
            lambda: ops.sequence_score_backward(grad_scores, em, tags, torch.tensor([9, 1])),
            ValueError, r"lengths\[0\] = 9 is outside"),
    }


@pytest.mark.parametrize("case", list(_internal_op_calls()) if "compiled" in crfkit.backends.available() else [])
def test_internal_ops_reject_bad_arguments(case):
    call, error, message = _internal_op_calls()[case]
    with pytest.raises(error, match=message):
        call()


def test_lengths_from_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert crfkit.lengths_from_mask(mask).tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="left-aligned"):
        crfkit.lengths_from_mask(torch.tensor([[0, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize("decoder", ["viterbi", "kbest"])
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_raw_decoders_name_the_sentence_with_nan_in_either_kernel(monkeypatch, decoder, kernel):
    # The compiled decoders check emissions per sentence, within its length only, both when they
    # decode sentences side by side in SIMD lanes (CRFKIT_VITERBI_LANES=1) and one at a time (0).
    if "compiled" not in crfkit.backends.available():
        pytest.skip("extension not built")
    monkeypatch.setenv("CRFKIT_VITERBI_LANES", kernel)
    ops = torch.ops.crfkit
    def decode(em, tr, ln, s, e):
        return ops.viterbi(em, tr, ln, s, e) if decoder == "viterbi" else ops.kbest_viterbi(em, tr, 5, ln, s, e)

    em, tr, _, s, e = random_crf(20, 5, 9)
    ln = torch.full((20,), 5)
    ln[7] = 4
    em[7, 4, 1] = math.inf  # past the length of sentence 7: ignored
    scores, paths = decode(em, tr, ln, s, e)
    assert torch.isfinite(scores).all()
    with crfkit.use_backend("reference"):
        want_scores, want_paths = (crfkit.viterbi(em, tr, ln, s, e) if decoder == "viterbi"
                                   else crfkit.kbest_viterbi(em, tr, 5, ln, s, e)[:2])
    assert torch.equal(paths, want_paths) and torch.equal(scores, want_scores)
    em[13, 2, 4] = math.nan
    em[17, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"emissions\[13\] contains NaN or \+inf"):
        decode(em, tr, ln, s, e)


def _valid_argument_forms():
    """Valid arguments in the forms users pass them: (name, args, takes the fast path)."""
    torch.manual_seed(3)
    B, L, T = 3, 5, 4
    em, tr = torch.randn(B, L, T), torch.randn(T, T)
    st, en, ln = torch.randn(T), torch.randn(T), torch.tensor([5, 0, 2])
    return [
        ("all given", (em, tr, ln, st, en), True),
        ("no start / end", (em, tr, ln, None, None), True),
        ("no lengths", (em, tr, None, st, en), True),
        ("parameters", (em, torch.nn.Parameter(tr), ln, torch.nn.Parameter(st), torch.nn.Parameter(en)), True),
        ("float64", (em.double(), tr.double(), ln, st.double(), en.double()), True),
        ("B = 0", (em[:0], tr, ln[:0], st, en), True),
        ("non-contiguous emissions", (em.transpose(0, 1).contiguous().transpose(0, 1), tr, ln, st, en), False),
        ("int32 lengths", (em, tr, ln.int(), st, en), False),
        ("float16 emissions", (em.half(), tr, ln, st, en), False),
        ("float32 parameters, float64 emissions", (em.double(), tr, ln, st, en), None),  # raises
    ]


@pytest.mark.parametrize("name, args, fast", _valid_argument_forms(), ids=lambda v: v if isinstance(v, str) else "")
def test_fast_argument_path_agrees_with_the_checked_one(name, args, fast):
    # prepare skips its conversions when the arguments need none (already_prepared); what it
    # returns then must be what the full checked path returns, and it must actually be taken
    # for the usual call (or the per-call saving it exists for is gone).
    ready = _arguments.already_prepared(*args)
    if fast is None:  # invalid: no fast answer, and the checked path raises
        assert ready is None
        with pytest.raises(TypeError, match="transitions has dtype torch.float32"):
            _arguments.prepare_checked(*args)
        return
    assert (ready is not None) == fast
    checked = _arguments.prepare_checked(*args)
    for got, want in zip(_arguments.prepare(*args), checked):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)


@pytest.mark.parametrize("lengths", [[5, 0, 6], [5, -1, 2]])
def test_fast_argument_path_leaves_bad_lengths_to_the_checked_one(lengths):
    em, tr = torch.randn(3, 5, 4), torch.randn(4, 4)
    assert _arguments.already_prepared(em, tr, torch.tensor(lengths), None, None) is None
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, seq_len = 5\]"):
        _arguments.prepare(em, tr, torch.tensor(lengths), None, None)


@pytest.mark.parametrize("op", ["log_partition", "viterbi", "kbest_viterbi"])
def test_outputs_record_a_backward_only_when_asked(op):
    # The compiled ops skip the autograd machinery when no score tensor requires grad or grad
    # mode is off (crfkit/backends/compiled.py _call); with grad on they must still record it.
    em = torch.randn(2, 4, 3, requires_grad=True)
    tr = torch.randn(3, 3)
    call = {"log_partition": lambda: crfkit.log_partition(em, tr),
            "viterbi": lambda: crfkit.viterbi(em, tr).scores,
            "kbest_viterbi": lambda: crfkit.kbest_viterbi(em, tr, 2).scores}[op]
    with torch.no_grad():
        assert not call().requires_grad
    out = call()
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert em.grad is not None and torch.isfinite(em.grad).all()
    if "compiled" not in crfkit.backends.available():
        return
    with torch.no_grad():
        raw = getattr(torch.ops.crfkit, op)(em, tr, *([2] if op == "kbest_viterbi" else []), torch.tensor([4, 2]),
                                           torch.zeros(3), torch.zeros(3))
    assert not any(x.requires_grad for x in (raw if isinstance(raw, tuple) else (raw,)))


# Where the compiled kernels check lengths and tags on the device (CUDA: compiled.py's
# VALUES_CHECKED_ON_DEVICE), the front end must not read them back, and the kernels' errors
# must still reach the caller. The CPU kernels check them as the CUDA ones do (same messages),
# so the CUDA arrangement is run here on the CPU by listing "cpu" as such a device.
@pytest.fixture
def values_checked_by_the_cpu_kernels(monkeypatch):
    if "compiled" not in crfkit.backends.available():
        pytest.skip("the compiled extension is not built")
    from crfkit.backends import compiled

    def no_host_read(*args):
        raise AssertionError("the front end read lengths back although the kernels check them")

    monkeypatch.setattr(compiled, "VALUES_CHECKED_ON_DEVICE", ("cpu",))
    monkeypatch.setattr(_arguments, "length_range", no_host_read)
    with crfkit.use_backend("compiled"):
        yield


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("lengths", [[4, -1], [5, 1]])
def test_lengths_checked_on_the_device_still_raise(values_checked_by_the_cpu_kernels, op, lengths):
    em, tr, kw = good()
    kw["lengths"] = torch.tensor(lengths)
    with pytest.raises(ValueError, match=r"lengths\[[01]\] = (-1|5) is outside \[0, seq_len = 4\]"):
        OPS[op](em, tr, **kw)


def test_tags_checked_on_the_device_still_raise(values_checked_by_the_cpu_kernels):
    em, tr, kw = good()
    kw["lengths"] = torch.tensor([4, 2])
    tags = torch.tensor([[0, 1, 2, 0], [1, 3, -100, -100]])  # 3 is not a tag; -100 is padding
    with pytest.raises(ValueError, match=r"tags\[1, 0, 1\] = 3 is not a tag index in \[0, 3\)"):
        crfkit.sequence_score(em, tr, tags, **kw)
    tags[1, 1] = 2
    expected = crfkit.reference.sequence_score(em, tr, tags.clamp(min=0), kw["lengths"], kw["start"], kw["end"])
    torch.testing.assert_close(crfkit.sequence_score(em, tr, tags, **kw), expected)


def test_expected_counts_check_lengths_for_the_reference(monkeypatch):
    # expected_transition_counts on a device without its kernel takes the reference, which does
    # not check the lengths: where the front end left them to the kernels, the backend checks them
    # itself.
    if "compiled" not in crfkit.backends.available():
        pytest.skip("the compiled extension is not built")
    from crfkit.backends import compiled

    monkeypatch.setattr(compiled, "VALUES_CHECKED_ON_DEVICE", ("cpu",))
    monkeypatch.setitem(compiled._KERNELS, ("expected_transition_counts", "CPU"), False)
    em, tr, kw = good()
    kw["lengths"] = torch.tensor([5, 1])
    with crfkit.use_backend("compiled"), pytest.raises(ValueError, match=r"lengths must lie in \[0, seq_len = 4\]"):
        crfkit.expected_transition_counts(em.requires_grad_(), tr, **kw)


def test_only_cuda_kernels_take_over_the_value_checks():
    if "compiled" not in crfkit.backends.available():
        pytest.skip("the compiled extension is not built")
    from crfkit.backends import compiled

    assert compiled.VALUES_CHECKED_ON_DEVICE == (("cuda",) if crfkit.backend_info()["cuda_kernels"] else ())
    assert not _arguments.values_checked_on_device(torch.zeros(1, dtype=torch.long))
