"""A BERT-base encoder + CRF training step on a GPU, with crfkit's CRF and with the peers'.

    python benchmarks/bench_gpu_training_step.py [--batch 32] [--seq-len 128] [--tags 9]
                                                 [--steps 20] [--rounds 3] [--out PATH]

One step: the encoder (transformers' BertModel, BERT-base configuration, randomly initialised:
no download) under bf16 autocast, a linear layer to the tag scores (float32), the CRF negative
log-likelihood of random gold tags with ragged lengths, backward, AdamW step. The CRF variants,
on the same model and batches, interleaved round by round:
  crfkit             crfkit.log_partition - crfkit.sequence_score (checked mode: each op reads
                     its status words back, one wait for the GPU per op)
  crfkit-deferred    the same inside crfkit.deferred_errors() (no read back; checked once per
                     round with crfkit.check_errors())
  pytorch-crf        torchcrf.CRF(batch_first=True), -crf(emissions, tags, mask, 'sum')
  torch-struct       LinearChainCRF(edge potentials).partition - the gold edges' sum
Reported: median ms per step over the rounds (CUDA events around --steps steps, after warm-up),
and the CRF alone (loss forward + backward from fixed emissions) the same way. Peers missing
are reported as such. Writes <out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def crf_losses(tags, lengths, num_tags):
    """{name: loss(emissions (B, L, T) float32, transitions, start, end) -> scalar}, the peers'
    CRFs made here (their parameters are the shared transitions / start / end)."""
    import crfkit

    mask = torch.arange(tags.shape[1], device=tags.device)[None] < lengths[:, None]
    losses = {}

    def crfkit_nll(em, tr, s, e):
        return (crfkit.log_partition(em, tr, lengths, s, e) - crfkit.sequence_score(em, tr, tags, lengths, s, e)).sum()

    losses["crfkit"] = crfkit_nll
    losses["crfkit-deferred"] = crfkit_nll  # run inside crfkit.deferred_errors()
    try:
        from torchcrf import CRF

        peer = CRF(num_tags, batch_first=True).to(tags.device)

        def pytorch_crf_nll(em, tr, s, e):
            peer.transitions, peer.start_transitions, peer.end_transitions = tr, s, e  # shared parameters
            return -peer(em, tags, mask, reduction="sum")

        losses["pytorch-crf"] = pytorch_crf_nll
    except ImportError as error:
        print(f"pytorch-crf: not installed ({error})")
    try:
        from torch_struct import LinearChainCRF

        B, L = tags.shape
        first = torch.zeros(B, L - 1, 1, 1, device=tags.device)
        first[:, 0] = 1.0
        last = torch.zeros(B, L - 1, 1, 1, device=tags.device)
        last[torch.arange(B), lengths - 2] = 1.0
        edge_mask = (torch.arange(L - 1, device=tags.device)[None] < (lengths[:, None] - 1)).float()
        b_index = torch.arange(B, device=tags.device)[:, None]
        n_index = torch.arange(L - 1, device=tags.device)[None]

        def torch_struct_nll(em, tr, s, e):
            # edge[b, n, j, i] = tr[i, j] + em[b, n+1, j] (+ em[b, 0, i] + s[i] at n = 0) (+ e[j] at the last edge)
            edge = (tr.t()[None, None] + em[:, 1:, :, None] + first * (em[:, :1, None, :] + s[None, None, None, :])
                    + last * e[None, None, :, None])
            log_z = LinearChainCRF(edge, lengths=lengths).partition
            gold = edge[b_index, n_index, tags[:, 1:], tags[:, :-1]]
            return (log_z - (gold * edge_mask).sum(1)).sum()

        losses["torch-struct"] = torch_struct_nll
    except ImportError as error:
        print(f"torch-struct: not installed ({error})")
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tags", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (BERT-base: 12)")
    parser.add_argument("--out", default="gpu_training_step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_training_step.py needs a CUDA GPU")
    import crfkit
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    device = torch.device("cuda")
    B, L, T = args.batch, args.seq_len, args.tags
    encoder = BertModel(BertConfig(num_hidden_layers=args.layers), add_pooling_layer=False).to(device)
    head = torch.nn.Linear(encoder.config.hidden_size, T).to(device)
    transitions = torch.nn.Parameter(torch.randn(T, T, device=device) * 0.1)
    start = torch.nn.Parameter(torch.zeros(T, device=device))
    end = torch.nn.Parameter(torch.zeros(T, device=device))
    params = [*encoder.parameters(), *head.parameters(), transitions, start, end]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    tokens = torch.randint(1000, encoder.config.vocab_size, (B, L), device=device)
    lengths = torch.randint(L // 4, L + 1, (B,), device=device)
    lengths[0] = L  # torch-struct needs one full-length sentence
    attention = (torch.arange(L, device=device)[None] < lengths[:, None]).long()
    tags = torch.randint(0, T, (B, L), device=device)
    losses = crf_losses(tags, lengths, T)

    def step(loss_fn):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = encoder(input_ids=tokens, attention_mask=attention).last_hidden_state
        emissions = head(hidden.float())
        loss_fn(emissions, transitions, start, end).backward()
        optimizer.step()

    fixed = torch.randn(B, L, T, device=device, requires_grad=True)

    def crf_only(loss_fn):
        loss_fn(fixed, transitions, start, end).backward()

    def timed(work, loss_fn, name):
        context = crfkit.deferred_errors() if name == "crfkit-deferred" else crfkit.deferred_errors(False)
        with context:
            for _ in range(3):
                work(loss_fn)  # warm-up
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(args.steps):
                work(loss_fn)
            finish.record()
            torch.cuda.synchronize()
        crfkit.check_errors()
        return begin.elapsed_time(finish) / args.steps

    times = {name: {"step": [], "crf": []} for name in losses}
    for _ in range(args.rounds):
        for name, loss_fn in losses.items():
            times[name]["step"].append(timed(step, loss_fn, name))
            times[name]["crf"].append(timed(crf_only, loss_fn, name))
    rows = {name: {part: statistics.median(values) for part, values in parts.items()} for name, parts in times.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "?"
    meta = dict(command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                date=datetime.datetime.now().isoformat(timespec="seconds"), git=commit,
                batch=B, seq_len=L, tags=T, layers=args.layers, steps=args.steps, rounds=args.rounds,
                params=sum(p.numel() for p in params))
    lines = [f"# A BERT-base + CRF training step on {meta['device']}", "",
             f"- command: `{meta['command']}`",
             f"- torch {meta['torch']} (CUDA {meta['cuda']}), git {commit}, {meta['date']}",
             f"- batch {B} x {L} tokens, {T} tags, {args.layers} encoder layers ({meta['params'] / 1e6:.0f}M "
             "parameters), bf16 autocast encoder, float32 CRF, AdamW",
             f"- median over {args.rounds} interleaved rounds of {args.steps} steps (CUDA events)", "",
             "| CRF | step ms | CRF alone ms (fwd + bwd) | CRF share of the step | step vs crfkit-deferred |",
             "|---|---|---|---|---|"]
    base = rows.get("crfkit-deferred", rows["crfkit"])["step"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['step']:.2f} | {row['crf']:.3f} | {100 * row['crf'] / row['step']:.1f}% | "
                     f"{row['step'] / base:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps(dict(meta, results=rows, raw=times), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
