"""Sampled decode against greedy at batch 64 with GPT-2's vocabulary, and what sample() costs per step.

    python bench/sampling.py [--repeats 3] [--shapes tiny,gpt2] [--num-requests 64] [--new-tokens 128]

Each shape is a random-weight GPT with GPT-2's padded 50,304-id vocabulary (50,257 real ids): "tiny" is
the shipped model's 4 layers x 128, where the lm_head and sampling are most of a decode step; "gpt2" is
GPT-2 small's 12 x 768. The workload is the one bench/floor.py samples on: 64 prompts of 16 tokens cut
from the held-out plays, 128 new tokens each, all at once, one PagedEngine with its defaults. Greedy and
sampled (temperature 0.8, top-k 200, a seed per request) alternate in one process after a warm-up of each;
the ratio is taken per repeat. sample() is timed around the engine's own call, per step, median over the run.

A third run per repeat, "sampled, two-level top-k", swaps torch.topk for an exact two-level selection
while the engine samples (two_level_topk below): measured, not in the engine
(docs/floor_and_sampling.md). The last repeat's sampled outputs of the two are compared. With --num-requests
below 16 (nothing compiles), --new-tokens 16 and --repeats 1, a check that the script runs: no figures.
"""

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness.checkpoints import get_tokenizer
from harness.serving import workload
from harness.tuning import prepare
from model import GPT, GPTConfig
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, SamplingParams

SHAPES = {"tiny": (4, 4, 128), "gpt2": (12, 12, 768)}  # n_layer, n_head, n_embd


def two_level_topk(x, k, *args, **kwargs):
    """x.topk(k) for a (R, V) CPU row block, exact: group c holds columns c, c + C, c + 2C, ... (C = V // 16),
    and the k best of a row lie in the k groups with the largest maxima (any element outside them has k
    group maxima above it). The last V % 16 columns are candidates outright."""
    if args or kwargs or x.dim() != 2 or x.shape[1] // 16 < k:
        return TORCH_TOPK(x, k, *args, **kwargs)
    R, V = x.shape
    C = V // 16
    best_groups = TORCH_TOPK(x[:, : 16 * C].unflatten(1, (16, C)).amax(1), k, sorted=False).indices  # (R, k)
    cols = (best_groups[:, None] + C * torch.arange(16)[:, None]).flatten(1)  # (R, 16 k)
    cols = torch.cat([cols, torch.arange(16 * C, V).expand(R, -1)], 1)
    values, best = TORCH_TOPK(x.gather(1, cols), k)
    return torch.return_types.topk((values, cols.gather(1, best)))


TORCH_TOPK = torch.Tensor.topk


def run(model, prompts, news, temperature, two_level=False):
    """-> (output tok/s, median ms per sample() call, the outputs)"""
    requests = [
        Request(p, n, SamplingParams(temperature=temperature, top_k=200 if temperature else None, seed=1337 + i))
        for i, (p, n) in enumerate(zip(prompts, news))
    ]
    num_blocks = sum(blocks_for(len(p) + n - 1, 16) for p, n in zip(prompts, news))
    engine = PagedEngine(model, num_blocks=num_blocks, vocab_size=50257)
    sample, times = engine.sample, []

    def timed_sample(*args):
        start = time.perf_counter()
        tokens = sample(*args).cpu()  # on the host, as the step then reads them
        times.append(time.perf_counter() - start)
        return tokens

    engine.sample = timed_sample  # this engine's own call, timed with its tokens' transfer to the host
    torch.Tensor.topk = two_level_topk if two_level else TORCH_TOPK
    try:
        start = time.perf_counter()
        engine.run(requests)
        seconds = time.perf_counter() - start
    finally:
        torch.Tensor.topk = TORCH_TOPK
    return (
        sum(len(r.generated) for r in requests) / seconds,
        1000 * statistics.median(times),
        [r.generated for r in requests],
    )


def fmt(xs, unit=""):
    return f"{statistics.median(xs):,.2f}{unit} ({min(xs):,.2f}-{max(xs):,.2f})"


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", default="tiny,gpt2")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    return p


def main():
    args = parser().parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    wl = SimpleNamespace(
        seed=3,
        prompt_len=(16, 16),
        new_tokens=(args.new_tokens, args.new_tokens),
        shared_prefix=0,
        num_requests=args.num_requests,
    )
    prompts, news = workload(get_tokenizer(50257), wl)
    for shape in args.shapes.split(","):
        n_layer, n_head, n_embd = SHAPES[shape]
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=1024, vocab_size=50304, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).eval()
        prepare(model)
        runs = {"greedy": (0.0, False), "sampled": (0.8, False), "two-level": (0.8, True)}
        for temperature, two_level in runs.values():  # warm-up: the compiled decode attention, the allocator
            run(model, [p[:8] for p in prompts], [8] * len(prompts), temperature, two_level)
        results = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (temperature, two_level) in runs.items():
                results[name].append(run(model, prompts, news, temperature, two_level))
        (greedy, greedy_ms, _), (sampled, sampled_ms, outputs), (two, two_ms, two_outputs) = (
            [list(x) for x in zip(*results[n])] for n in runs
        )
        print(
            f"-- {shape} ({n_layer} x {n_embd}, vocabulary 50,304): {len(prompts)} prompts of 16, {news[0]} new, "
            "all at once"
        )
        print(f"greedy                        {fmt(greedy, ' tok/s')}")
        print(f"sampled (0.8, top-k 200)      {fmt(sampled, ' tok/s')}")
        print(f"sampled / greedy, per repeat  {fmt([s / g for s, g in zip(sampled, greedy)], 'x')}")
        print(f"sample() per step, greedy     {fmt(greedy_ms, ' ms')}")
        print(f"sample() per step, sampled    {fmt(sampled_ms, ' ms')}")
        print(f"sampled, two-level top-k      {fmt(two, ' tok/s')}")
        print(f"  / greedy, per repeat        {fmt([s / g for s, g in zip(two, greedy)], 'x')}")
        print(f"  sample() per step           {fmt(two_ms, ' ms')}")
        same = sum(a == b for a, b in zip(outputs[-1], two_outputs[-1]))
        print(f"  same sampled outputs as torch.topk: {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
