"""torch.jit.script on crfkit.CRF and on the pytorch-crf compat CRF.

The scripted modules (crfkit/_scripting.py: the compiled ops called directly) must give what the
eager modules give, which tests/test_compat.py and tests/test_nn.py check against torchcrf and
brute force; here the scripted results are also checked against brute-force enumeration on tiny
sizes, so that a scripted path that agreed with a broken eager one would still fail. The
pytorch-crf part follows the cases of pytorch-crf's own TorchScript tests (tests/test_crf.py of
kmkurn/pytorch-crf: TestTorchScriptForward, TestTorchScriptDecode).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import crfkit
from crfkit import backends
from crfkit.compat.pytorch_crf import CRF as CompatCRF
from crfkit.constraints import allowed_transitions

from brute_force import all_sequences, log_partition as brute_log_partition

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # torch 2.13 deprecates TorchScript (in favour of torch.export); these tests are about it.
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning"),
]
needs_compiled = pytest.mark.skipif("compiled" not in backends.available(),
                                    reason="torch.jit.script of the CRF layers needs crfkit's compiled extension")
REDUCTIONS = ("none", "sum", "mean", "token_mean")
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def left_aligned_mask(lengths, L, dtype=torch.bool):
    return (torch.arange(L) < torch.as_tensor(lengths).unsqueeze(1)).to(dtype)


def brute_log_likelihoods(emissions, tags, lengths, transitions, start, end):
    """log P(tags[b, :n] | x_b) for each sentence by enumeration: emissions (B, L, T) float64."""
    out = []
    for b, n in enumerate(lengths.tolist()):
        seqs = all_sequences(emissions[b], transitions, start, end, n)
        score = dict((seq, s) for s, seq in seqs)[tuple(tags[b, :n].tolist())]
        out.append(score - brute_log_partition(seqs))
    return torch.tensor(out, dtype=torch.float64)


def brute_best_paths(emissions, lengths, transitions, start, end):
    return [list(all_sequences(emissions[b], transitions, start, end, n)[0][1]) for b, n in enumerate(lengths.tolist())]


def reduce(values, reduction, lengths):
    if reduction == "none":
        return values
    if reduction == "sum":
        return values.sum()
    if reduction == "mean":
        return values.mean()
    return values.sum() / lengths.sum()


# ---------------------------------------------------------------------------------------------
# The pytorch-crf compat CRF (its layout: sequence first unless batch_first)


def compat_pair(T=5, batch_first=False, seed=0, dtype=torch.float64):
    """(eager, scripted) compat CRFs with the same parameters, drawn away from the small init."""
    torch.manual_seed(seed)
    crf = CompatCRF(T, batch_first=batch_first)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    crf = crf.to(dtype)
    return crf, torch.jit.script(crf)


def compat_batch(crf, L=3, B=2, lengths=None, seed=1):
    """emissions, tags and a uint8 mask as pytorch-crf's tests make them, in the CRF's layout."""
    g = torch.Generator().manual_seed(seed)
    emissions = torch.randn(B, L, crf.num_tags, generator=g, dtype=torch.float64).to(crf.transitions.dtype)
    tags = torch.randint(0, crf.num_tags, (B, L), generator=g)
    mask = left_aligned_mask([L] * B if lengths is None else lengths, L, torch.uint8)
    if not crf.batch_first:
        emissions, tags, mask = emissions.transpose(0, 1), tags.transpose(0, 1), mask.transpose(0, 1)
    return emissions, tags, mask


def compat_brute(crf, emissions, tags, mask):
    """Brute-force log-likelihoods (B,) and best paths of the compat CRF's inputs."""
    if not crf.batch_first:
        emissions, tags, mask = emissions.transpose(0, 1), tags.transpose(0, 1), mask.transpose(0, 1)
    lengths = mask.long().sum(1)
    params = [p.detach().double() for p in (crf.transitions, crf.start_transitions, crf.end_transitions)]
    emissions = emissions.double()
    return (brute_log_likelihoods(emissions, tags, lengths, *params), brute_best_paths(emissions, lengths, *params),
            lengths)


@needs_compiled
def test_compat_is_scriptable_with_decode():
    scripted = torch.jit.script(CompatCRF(5))
    assert isinstance(scripted, torch.jit.ScriptModule)
    assert hasattr(scripted, "decode")


@needs_compiled
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("masked", ["ragged", "all_ones", "none"])
def test_compat_scripted_forward_equals_eager_and_brute_force(batch_first, reduction, masked):
    crf, scripted = compat_pair(batch_first=batch_first)
    emissions, tags, mask = compat_batch(crf, L=4, B=3, lengths=[4, 2, 1] if masked == "ragged" else None)
    given = None if masked == "none" else mask
    expected = crf(emissions, tags, mask=given, reduction=reduction)
    got = scripted(emissions, tags, mask=given, reduction=reduction)
    assert torch.equal(got, expected)
    brute, _, lengths = compat_brute(crf, emissions, tags, mask)
    torch.testing.assert_close(got, reduce(brute, reduction, lengths), rtol=1e-12, atol=1e-12)


@needs_compiled
def test_compat_scripted_default_reduction_is_sum_and_batched():
    crf, scripted = compat_pair()
    emissions, tags, mask = compat_batch(crf, L=3, B=10)
    brute, _, _ = compat_brute(crf, emissions, tags, mask)
    torch.testing.assert_close(scripted(emissions, tags), brute.sum(), rtol=1e-12, atol=1e-12)
    assert torch.equal(scripted(emissions, tags), crf(emissions, tags))


@needs_compiled
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masked", [True, False])
def test_compat_scripted_decode_equals_eager_and_brute_force(batch_first, masked):
    crf, scripted = compat_pair(batch_first=batch_first, seed=3)
    emissions, _, mask = compat_batch(crf, L=4, B=3, lengths=[4, 3, 1] if masked else None, seed=4)
    given = mask if masked else None
    got = scripted.decode(emissions, mask=given)
    assert got == crf.decode(emissions, mask=given)
    assert got == compat_brute(crf, emissions, torch.zeros_like(mask, dtype=torch.long), mask)[1]


@needs_compiled
def test_compat_scripted_batch_first_matches_sequence_first():
    """pytorch-crf's test_batch_first: the same parameters in both layouts give the same results."""
    crf, scripted = compat_pair(batch_first=False)
    crf_bf = CompatCRF(5, batch_first=True).double()
    crf_bf.load_state_dict(crf.state_dict())
    scripted_bf = torch.jit.script(crf_bf)
    emissions, tags, _ = compat_batch(crf, L=3, B=2)
    assert torch.equal(scripted_bf(emissions.transpose(0, 1), tags.transpose(0, 1)), scripted(emissions, tags))
    assert scripted_bf.decode(emissions.transpose(0, 1)) == scripted.decode(emissions)


@needs_compiled
def test_compat_scripted_gradients_equal_eager():
    crf, scripted = compat_pair(batch_first=True)
    emissions, tags, mask = compat_batch(crf, L=5, B=4, lengths=[5, 3, 2, 1])
    grads = []
    for module in (crf, scripted):
        module.zero_grad()
        x = emissions.clone().requires_grad_()
        (-module(x, tags, mask=mask, reduction="token_mean")).backward()
        grads.append([x.grad] + [p.grad for p in module.parameters()])
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_compiled
def test_compat_scripted_promotes_dtypes_as_eager():
    """float64 emissions with float32 parameters give float64 (torchcrf's promotion), and half
    emissions are computed in float32, in both modes."""
    crf, scripted = compat_pair(batch_first=True, dtype=torch.float32)
    emissions, tags, mask = compat_batch(crf, L=4, B=2, lengths=[4, 2])
    for x in (emissions.double(), emissions.half(), emissions.bfloat16()):
        expected = crf(x, tags, mask=mask)
        got = scripted(x, tags, mask=mask)
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)
        assert scripted.decode(x, mask=mask) == crf.decode(x, mask=mask)


@needs_compiled
@pytest.mark.parametrize("call, message", [
    (lambda s, e, t, m: s(e[0], t, mask=m), "emissions must have 3 dimensions"),
    (lambda s, e, t, m: s(e[..., :3], t, mask=m), "emissions must have num_tags = 5"),
    (lambda s, e, t, m: s(e, t[:2], mask=m), "tags must have the shape of emissions' first two dimensions"),
    (lambda s, e, t, m: s(e, t, mask=m[:2]), "mask must have the shape of emissions' first two dimensions"),
    (lambda s, e, t, m: s(e, t, mask=m, reduction="avg"), "reduction must be one of"),
    (lambda s, e, t, m: s.decode(e[:0]), "emissions must have at least one time step"),
])
def test_compat_scripted_bad_input_names_the_argument(call, message):
    crf, scripted = compat_pair()
    emissions, tags, mask = compat_batch(crf, L=3, B=2)
    with pytest.raises(torch.jit.Error, match=message):
        call(scripted, emissions, tags, mask)
    with pytest.raises(ValueError, match=message):  # the eager module says the same
        call(crf, emissions, tags, mask)


# ---------------------------------------------------------------------------------------------
# crfkit.CRF (batch first, forward = negative log-likelihood)


def crfkit_crf(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "constrained":
        crf = crfkit.CRF(len(LABELS), constraints=allowed_transitions(LABELS, "BIO"))
    elif kind == "no_start_end":
        crf = crfkit.CRF(len(LABELS), include_start_end=False)
    else:
        crf = crfkit.CRF(len(LABELS))
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    return crf.double()


def crfkit_batch(B=4, L=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    emissions = torch.randn(B, L, len(LABELS), generator=g, dtype=torch.float64)
    lengths = torch.tensor([L, 0, 2, 1][:B])
    # O, B-PER and B-LOC only, and one I-PER after its B-PER: allowed under BIO, so that every
    # sentence's likelihood is finite (brute force lists the allowed sequences only).
    tags = torch.tensor([0, 1, 3])[torch.randint(0, 3, (B, L), generator=g)]
    tags[0, :2] = torch.tensor([1, 2])
    return emissions, tags, lengths


def crfkit_brute(crf, emissions, tags, lengths):
    transitions, start, end = (x.detach() if x is not None else torch.zeros(crf.num_tags, dtype=torch.float64)
                               for x in crf.constrained_parameters())
    return (brute_log_likelihoods(emissions, tags, lengths, transitions, start, end),
            brute_best_paths(emissions, lengths, transitions, start, end))


KINDS = ["plain", "constrained", "no_start_end"]


@needs_compiled
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("given", ["lengths", "mask", "neither"])
def test_crf_scripted_nll_equals_eager_and_brute_force(kind, reduction, given):
    crf = crfkit_crf(kind)
    scripted = torch.jit.script(crf)
    emissions, tags, lengths = crfkit_batch()
    if given == "neither":
        lengths = torch.full((4,), 4)
    kwargs = {"lengths": {"lengths": lengths}, "mask": {"mask": left_aligned_mask(lengths, 4)}, "neither": {}}[given]
    expected = crf(emissions, tags, reduction=reduction, **kwargs)
    got = scripted(emissions, tags, reduction=reduction, **kwargs)
    assert torch.equal(got, expected)
    assert torch.equal(scripted.nll(emissions, tags, reduction=reduction, **kwargs), expected)
    brute = -crfkit_brute(crf, emissions, tags, lengths)[0]
    if reduction == "token_mean":
        want = brute.sum() / lengths.sum()
    else:
        want = reduce(brute, reduction, lengths)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_compiled
@pytest.mark.parametrize("kind", KINDS)
def test_crf_scripted_decode_kbest_marginals_log_partition_equal_eager(kind):
    crf = crfkit_crf(kind, seed=5)
    scripted = torch.jit.script(crf)
    emissions, tags, lengths = crfkit_batch(seed=6)
    best = scripted.decode(emissions, lengths)
    expected = crf.decode(emissions, lengths)
    assert (best.scores.tolist(), best.paths.tolist()) == (expected.scores.tolist(), expected.paths.tolist())
    brute_paths = crfkit_brute(crf, emissions, tags, lengths)[1]
    assert [row[:n] for row, n in zip(best.paths.tolist(), lengths.tolist())] == brute_paths
    mask_best = scripted.decode(emissions, mask=left_aligned_mask(lengths, 4))
    assert torch.equal(mask_best.paths, expected.paths)
    with torch.no_grad():
        kbest, kbest_eager = scripted.kbest(emissions, 3, lengths), crf.kbest(emissions, 3, lengths)
    assert kbest._fields == ("scores", "paths", "log_probs")
    for got, want in zip(kbest, kbest_eager):
        assert torch.equal(got, want)
    assert torch.equal(scripted.marginals(emissions, lengths), crf.marginals(emissions, lengths))
    assert torch.equal(scripted.log_partition(emissions, lengths), crf.log_partition(emissions, lengths))
    assert torch.equal(scripted.log_likelihood(emissions, tags, lengths), crf.log_likelihood(emissions, tags, lengths))


@needs_compiled
def test_crf_scripted_kbest_with_gradient_equals_eager():
    crf = crfkit_crf("constrained", seed=7)
    scripted = torch.jit.script(crf)
    emissions, _, lengths = crfkit_batch(seed=8)
    grads = []
    for module in (crf, scripted):
        module.zero_grad()
        x = emissions.clone().requires_grad_()
        result = module.kbest(x, 2, lengths)
        result.log_probs[:, 0].exp().sum().backward()
        grads.append((result.scores.detach(), result.log_probs.detach(), x.grad, module.transitions.grad))
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_compiled
def test_crf_scripted_gradients_equal_eager():
    crf = crfkit_crf("constrained", seed=9)
    scripted = torch.jit.script(crf)
    emissions, tags, lengths = crfkit_batch(seed=10)
    grads = []
    for module in (crf, scripted):
        module.zero_grad()
        x = emissions.clone().requires_grad_()
        module(x, tags, lengths=lengths).backward()
        (module.marginals(x, lengths) * torch.linspace(-1, 1, x.numel()).view_as(x)).sum().backward()
        grads.append([x.grad] + [p.grad for p in module.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_compiled
@pytest.mark.parametrize("call, message", [
    (lambda s, e, t, ln: s(e, t, reduction="avg"), "reduction must be one of"),
    (lambda s, e, t, ln: s(e, t, lengths=ln, mask=ln > 0), "give lengths or mask, not both"),
    (lambda s, e, t, ln: s.decode(e, mask=torch.ones(4, 3, dtype=torch.bool)),
     r"mask must have shape \(batch, seq_len"),
    (lambda s, e, t, ln: s.decode(e[..., :3]), "emissions must have num_tags = 5"),
    (lambda s, e, t, ln: s.decode(e, ln + 1), r"lengths must lie in \[0, seq_len = 4\]"),
    (lambda s, e, t, ln: s.decode(e, ln.double()), "lengths must be an integer tensor"),
    (lambda s, e, t, ln: s.decode(e.float()), "transitions has dtype torch.float64 but emissions has torch.float32"),
    (lambda s, e, t, ln: s(e, t + 5, lengths=ln), r"tags within the lengths must lie in \[0, num_tags = 5\)"),
    (lambda s, e, t, ln: s.kbest(e, 0, ln), "k must be a positive int"),
])
def test_crf_scripted_bad_input_names_the_argument(call, message):
    crf = crfkit_crf("plain")
    scripted = torch.jit.script(crf)
    emissions, tags, lengths = crfkit_batch()
    with pytest.raises(torch.jit.Error, match=message):
        call(scripted, emissions, tags, lengths)
    with pytest.raises((ValueError, TypeError), match=message):  # the eager module says the same
        call(crf, emissions, tags, lengths)


# ---------------------------------------------------------------------------------------------
# Saving, loading, and scripting without the compiled extension


@needs_compiled
def test_save_and_load_round_trip(tmp_path):
    crf = crfkit_crf("constrained", seed=11)
    compat, compat_scripted = compat_pair(batch_first=True, seed=12)
    torch.jit.script(crf).save(str(tmp_path / "crf.pt"))
    compat_scripted.save(str(tmp_path / "compat.pt"))
    loaded, loaded_compat = torch.jit.load(str(tmp_path / "crf.pt")), torch.jit.load(str(tmp_path / "compat.pt"))
    emissions, tags, lengths = crfkit_batch(seed=13)
    assert torch.equal(loaded(emissions, tags, lengths=lengths), crf(emissions, tags, lengths=lengths))
    assert torch.equal(loaded.decode(emissions, lengths).paths, crf.decode(emissions, lengths).paths)
    mask = left_aligned_mask([4, 1, 2, 1], 4)
    assert torch.equal(loaded_compat(emissions, tags, mask), compat(emissions, tags, mask))
    assert loaded_compat.decode(emissions, mask) == compat.decode(emissions, mask)


@needs_compiled
def test_a_saved_scripted_crf_runs_without_the_crfkit_package(tmp_path):
    """A saved TorchScript CRF needs only torch and crfkit's op library: a child process that
    cannot import crfkit loads the library, then the module, and decodes as the eager CRF."""
    crf = crfkit_crf("constrained", seed=14)
    torch.jit.script(crf).save(str(tmp_path / "crf.pt"))
    emissions, _, lengths = crfkit_batch(seed=15)
    torch.save({"emissions": emissions, "lengths": lengths}, str(tmp_path / "inputs.pt"))
    child = textwrap.dedent(f"""
        import sys
        class NoCrfkit:  # stands for an environment where only torch is installed
            def find_spec(self, name, path=None, target=None):
                if name == "crfkit" or name.startswith("crfkit."):
                    raise ModuleNotFoundError("crfkit is hidden in this process")
        sys.meta_path.insert(0, NoCrfkit())
        try:
            import crfkit  # noqa: F401
            raise SystemExit("crfkit could be imported")
        except ModuleNotFoundError:
            pass
        import torch
        torch.ops.load_library({backends.backend_info()["extension"]!r})
        module = torch.jit.load({str(tmp_path / "crf.pt")!r})
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        print(module.decode(inputs["emissions"], inputs["lengths"]).paths.tolist())
        assert not [name for name in sys.modules if name.split(".")[0] == "crfkit"]
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-I", "-c", child], capture_output=True, text=True, cwd=str(tmp_path),
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(crf.decode(emissions, lengths).paths.tolist())


def test_scripting_without_the_compiled_extension_says_so(monkeypatch):
    monkeypatch.setattr(backends, "available", lambda: ("reference",))
    for layer, name in ((crfkit.CRF(3), "crfkit.CRF"), (CompatCRF(3), "crfkit.compat.pytorch_crf.CRF")):
        with pytest.raises(RuntimeError, match=rf"torch.jit.script\({name}\) needs crfkit's compiled backend"):
            torch.jit.script(layer)


@needs_compiled
def test_a_model_holding_the_crfs_scripts_as_a_whole():
    """The usual pytorch-crf set-up: a tagger module with a CRF attribute, scripted as a whole,
    calls the CRF's forward and decode from its own methods."""
    from typing import List

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, len(LABELS)).double()
            self.crf = CompatCRF(len(LABELS), batch_first=True).double()
            self.layer = crfkit.CRF(len(LABELS), constraints=allowed_transitions(LABELS, "BIO")).double()

        def forward(self, x: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            emissions = self.linear(x)
            return -self.crf(emissions, tags, mask=mask) + self.layer(emissions, tags, mask=mask)

        @torch.jit.export
        def tag(self, x: torch.Tensor, mask: torch.Tensor) -> List[List[int]]:
            return self.crf.decode(self.linear(x), mask=mask)

        @torch.jit.export
        def paths(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layer.decode(self.linear(x), mask=mask).paths

    torch.manual_seed(16)
    model = Tagger()
    scripted = torch.jit.script(model)
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    mask = left_aligned_mask([4, 2, 3], 4)
    tags = torch.tensor([0, 1, 3])[torch.randint(0, 3, (3, 4))]
    assert torch.equal(scripted(x, tags, mask), model(x, tags, mask))
    assert scripted.tag(x, mask) == model.crf.decode(model.linear(x), mask=mask)
    assert torch.equal(scripted.paths(x, mask), model.layer.decode(model.linear(x), mask=mask).paths)


@needs_compiled
def test_crf_scripted_refuses_a_mask_with_holes_that_the_eager_module_decodes():
    crf = crfkit_crf("plain")
    scripted = torch.jit.script(crf)
    emissions, _, _ = crfkit_batch()
    holes = torch.tensor([[True, False, True, False]] * emissions.shape[0])
    with pytest.raises(torch.jit.Error, match="mask must be left-aligned .* the eager module takes masks with holes"):
        scripted.decode(emissions, mask=holes)
    paths = crf.decode(emissions, mask=holes).paths
    compact = crf.decode(emissions[:, [0, 2]]).paths  # the two real positions, joined
    assert torch.equal(paths[:, [0, 2]], compact) and bool((paths[:, [1, 3]] == -1).all())


@needs_compiled
def test_compat_scripted_refuses_a_mask_with_holes_that_the_eager_module_takes():
    crf, scripted = compat_pair()
    emissions, tags, mask = compat_batch(crf, L=3, B=2)
    holes = torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.uint8)
    with pytest.raises(torch.jit.Error, match="mask must be left-aligned"):
        scripted(emissions, tags, holes)
    assert torch.isfinite(crf(emissions, tags, holes))
    off = torch.zeros_like(mask)  # every sentence empty: log-likelihood 0, in both
    assert float(scripted(emissions, tags, off).detach()) == float(crf(emissions, tags, off).detach()) == 0.0
