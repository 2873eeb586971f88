"""Host cost of torch's own autograd on a busy GPU (the floor under any custom op's fwd+bwd).

Run on the H100 as device call 2 (output: autograd_floor_call2.log). Reformatted for ruff after the
run; the logic is unchanged. Usage: python autograd_floor.py (needs a CUDA device).
"""

import time

import torch

device = "cuda"


def host_us(fn, n=50):
    """Mean host microseconds per call of fn while the GPU is kept busy, and whether it stayed busy."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    event = torch.cuda.Event()
    event.record()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n * 1e6
    busy = not event.query()
    torch.cuda.synchronize()
    return elapsed, busy


x = torch.randn(1, 128, 9, device=device, requires_grad=True)
w = torch.randn(9, device=device)
y = (x * w).sum()
cases = {
    "aten mul (no grad)": lambda: x.detach() * w,
    "aten mul leaf forward": lambda: x * w,
    "autograd.grad((x*w).sum(), x)": lambda: torch.autograd.grad((x * w).sum(), x),
    "backward only of (x*w).sum() retain": lambda: torch.autograd.grad(y, x, retain_graph=True),
    "logsumexp fwd+bwd": lambda: torch.autograd.grad(x.logsumexp(-1).sum(), x),
}
for name, fn in cases.items():
    for _ in range(5):
        fn()
    result = sorted(host_us(fn) for _ in range(3))[1]
    print(f"| {name} | {result[0]:.1f} | {result[1]} |")
