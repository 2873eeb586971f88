"""Wrong input raises a clear exception that names the argument; nothing crashes, hangs or
returns NaN. Non-contiguous and expanded tensors are not wrong: they must work."""
import math

import pytest
import torch

import crfkit
from conftest import random_crf

OPS = {
    "log_partition": lambda em, tr, **kw: crfkit.log_partition(em, tr, **kw),
    "marginals": lambda em, tr, **kw: crfkit.marginals(em, tr, **kw),
    "viterbi": lambda em, tr, **kw: crfkit.viterbi(em, tr, **kw),
    "kbest_viterbi": lambda em, tr, **kw: crfkit.kbest_viterbi(em, tr, 3, **kw),
    "sequence_score": lambda em, tr, **kw: crfkit.sequence_score(em, tr, torch.zeros(2, 4, dtype=torch.long), **kw),
    "expected_transition_counts": lambda em, tr, **kw: crfkit.expected_transition_counts(em, tr, **kw),
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
    ("no tags", lambda em, tr, kw: (em[:, :, :0], tr[:0, :0], {**kw, "start": None, "end": None}), ValueError, "at least one tag"),
    ("transitions missing", lambda em, tr, kw: (em, None, kw), TypeError, "transitions is required"),
    ("transitions shape", lambda em, tr, kw: (em, tr[:2], kw), ValueError, "transitions must have shape"),
    ("transitions rank", lambda em, tr, kw: (em, tr[0], kw), ValueError, "transitions must have 2 dimensions"),
    ("transitions dtype", lambda em, tr, kw: (em, tr.double(), kw), TypeError, "transitions has dtype torch.float64"),
    ("transitions device", lambda em, tr, kw: (em, tr.to("meta"), kw), ValueError, "transitions is on meta"),
    ("start shape", lambda em, tr, kw: (em, tr, {**kw, "start": kw["start"][:2]}), ValueError, "start must have shape"),
    ("end dtype", lambda em, tr, kw: (em, tr, {**kw, "end": kw["end"].long()}), TypeError, "end has dtype"),
    ("lengths float", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"].float()}), TypeError, "lengths must be an integer"),
    ("lengths bool", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"] > 0}), TypeError, "lengths must be an integer"),
    ("lengths shape", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"][:1]}), ValueError, "lengths must have shape"),
    ("lengths rank", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"][:, None]}), ValueError, "lengths must have 1 dimensions"),
    ("lengths negative", lambda em, tr, kw: (em, tr, {**kw, "lengths": torch.tensor([4, -1])}), ValueError, r"lengths must lie in \[0, seq_len = 4\]"),
    ("lengths too long", lambda em, tr, kw: (em, tr, {**kw, "lengths": torch.tensor([5, 1])}), ValueError, r"lengths must lie in \[0, seq_len = 4\]"),
    ("lengths device", lambda em, tr, kw: (em, tr, {**kw, "lengths": kw["lengths"].to("meta")}), ValueError, "lengths is on meta"),
    ("NaN emission", lambda em, tr, kw: (em.index_put((torch.tensor(1), torch.tensor(0), torch.tensor(2)), torch.tensor(math.nan)), tr, kw), ValueError, "emissions.*NaN or \\+inf"),
    ("+inf emission", lambda em, tr, kw: (em.index_put((torch.tensor(0), torch.tensor(0), torch.tensor(0)), torch.tensor(math.inf)), tr, kw), ValueError, "emissions.*NaN or \\+inf"),
    ("NaN transition", lambda em, tr, kw: (em, tr.index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(math.nan)), kw), ValueError, "transitions contains NaN or \\+inf"),
    ("+inf start", lambda em, tr, kw: (em, tr, {**kw, "start": torch.tensor([0.0, math.inf, 0.0])}), ValueError, "start contains NaN or \\+inf"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_raises_a_clear_error(backend, op, case):
    _, mutate, exception, pattern = case
    em, tr, kw = mutate(*good())
    with pytest.raises(exception, match=pattern):
        OPS[op](em, tr, **kw)


@pytest.mark.parametrize("k,exception", [(0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError)])
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
        ops.log_partition(em, tr, s, e, torch.tensor([9, 1]))
    with pytest.raises(TypeError, match="lengths must be int64"):
        ops.viterbi(em, tr, s, e, ln.int())
    with pytest.raises(ValueError, match="transitions must be"):
        ops.kbest_viterbi(em, tr[:2], s, e, ln, 2)
    with pytest.raises(ValueError, match="k must be at least 1"):
        ops.kbest_viterbi(em, tr, s, e, ln, 0)
    with pytest.raises(TypeError, match="float32 or float64"):
        ops.marginals(em.half(), tr.half(), s.half(), e.half(), ln)
    with pytest.raises(ValueError, match="is not a tag index"):
        ops.sequence_score(em, tr, s, e, ln, torch.full((2, 1, 4), 7))
    # Any strides are fine for the raw ops too.
    torch.testing.assert_close(ops.log_partition(em.transpose(1, 2).contiguous().transpose(1, 2), tr, s, e, ln),
                               ops.log_partition(em, tr, s, e, ln))


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
    decode = (lambda *args: ops.viterbi(*args)) if decoder == "viterbi" else (lambda *args: ops.kbest_viterbi(*args, 5))
    em, tr, _, s, e = random_crf(20, 5, 9)
    ln = torch.full((20,), 5)
    ln[7] = 4
    em[7, 4, 1] = math.inf  # past the length of sentence 7: ignored
    scores, paths = decode(em, tr, s, e, ln)
    assert torch.isfinite(scores).all()
    with crfkit.use_backend("reference"):
        want_paths, want_scores = (crfkit.viterbi(em, tr, ln, s, e) if decoder == "viterbi"
                                   else crfkit.kbest_viterbi(em, tr, 5, ln, s, e)[:2])
    assert torch.equal(paths, want_paths) and torch.equal(scores, want_scores)
    em[13, 2, 4] = math.nan
    em[17, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"emissions\[13\] contains NaN or \+inf"):
        decode(em, tr, s, e, ln)
