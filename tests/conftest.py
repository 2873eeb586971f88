import os
import sys

import pytest
import torch

import crfkit
from crfkit import backends

sys.path.insert(0, os.path.dirname(__file__))


def _backends_to_test():
    """Every backend that loads here; the suite runs once per backend. CRFKIT_TEST_BACKENDS
    (comma-separated names, e.g. "compiled") narrows that: the sanitizer and debug builds
    (tools/sanitize.sh) test the C++ kernels, and the other backends run no C++ code."""
    chosen = [name.strip() for name in os.environ.get("CRFKIT_TEST_BACKENDS", "").split(",") if name.strip()]
    if not chosen:
        return backends.available()
    for name in chosen:
        with crfkit.use_backend(name):  # raises, naming the backend and why, when it cannot load
            pass
    return tuple(chosen)


BACKENDS = _backends_to_test()


def pytest_configure(config):
    # In CI a missing extension must fail the run, not quietly test the reference alone.
    if os.environ.get("CI") and "compiled" not in BACKENDS:
        raise pytest.UsageError(f"CI: the compiled backend did not load: {backends.backend_info()['unavailable']}")


@pytest.fixture(params=BACKENDS)
def backend(request):
    with crfkit.use_backend(request.param):
        yield request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny tensors: a second intra-op thread only adds
    synchronisation, which costs seconds on a shared, busy CPU. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_crf(B, L, T, dtype=torch.float64, scale=1.0, ragged=True, seed=None, integer=False):
    """Random CRF inputs: emissions (B, L, T), transitions (T, T), lengths (B,), start, end (T,).
    lengths are ragged (including 0 and L when B allows) unless ragged=False."""
    g = torch.Generator().manual_seed(seed if seed is not None else 1234 + 97 * B + 13 * L + T)
    def draw(*shape):
        if integer:
            return torch.randint(-1, 2, shape, generator=g).to(dtype)
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    emissions, transitions, start, end = draw(B, L, T), draw(T, T), draw(T), draw(T)
    if ragged and B > 0:
        lengths = torch.randint(0, L + 1, (B,), generator=g)
        lengths[0] = L
        if B > 2:
            lengths[1] = 0
    else:
        lengths = torch.full((B,), L, dtype=torch.long)
    return emissions, transitions, lengths, start, end


def check_compile_matches_eager(em, tr, ln, s, e, context):
    """torch.compile(fullgraph=True) of log Z and k-best (forward and backward) gives what eager
    mode gives, with both run inside `context` (a backend or device context manager)."""
    def loss_and_decode(em, tr, s, e):
        log_z = crfkit.log_partition(em, tr, ln, s, e)
        best = crfkit.kbest_viterbi(em, tr, 3, ln, s, e)
        return log_z.sum() - best.scores[:, 0].sum(), best.paths

    with context:
        compiled = torch.compile(loss_and_decode, fullgraph=True, backend="aot_eager")
        params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        loss, paths = compiled(*params)
        loss.backward()
        eager_params = [x.clone().requires_grad_() for x in (em, tr, s, e)]
        eager_loss, eager_paths = loss_and_decode(*eager_params)
        eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    assert torch.equal(paths, eager_paths)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a.grad, b.grad)
