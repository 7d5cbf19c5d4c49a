"""Sampled decode against greedy at batch 64 with GPT-2's vocabulary, each sampling setting, and what sample() costs.

    python bench/sampling.py [--repeats 3] [--shapes tiny,gpt2] [--num-requests 64] [--new-tokens 128]
                             [--compile auto|kernel] [--logit-scale 1]

Each shape is a random-weight GPT with GPT-2's padded 50,304-id vocabulary (50,257 real ids): "tiny" is the
shipped model's 4 layers x 128, where the lm_head and sampling are most of a decode step; "gpt2" is GPT-2
small's 12 x 768. The workload is the one bench/floor.py samples on: 64 prompts of 16 tokens cut from the
held-out plays, 128 new tokens each, all at once, one PagedEngine with its defaults. Each repeat runs,
alternated in one process after a warm-up of each: greedy; temperature 0.8 with top-k 200 (the "top-k" path);
top-p 0.9 alone; min-p 0.05 alone; top-k 200 with logprobs=5 on every row (the engine composed with
ext/logprobs.py, whose top ids come from an exact two-level selection, two_level_topk). With --compile kernel
every engine runs ext/cpu_kernel.py's C kernels: decode attention, every row's draw and logprobs' scores
through ext/sample.c (docs/floor_and_sampling.md). Ratios are taken per repeat; sample() is timed around the
engine's own call, per step, median over the run. Random weights give nearly flat logits, so top-p 0.9 keeps most of
the vocabulary here: the worst case for a sort. --logit-scale F multiplies the final norm's weight by F, and so
every logit row's spread: F = 14 gives the tiny shape's rows about 3 nats of entropy at temperature 0.8 (a trained
GPT-2 small loses ~3.1 nats a token, nanoGPT's README says), where top-p keeps ~80 ids and min-p a few (the median
kept, and the entropy, are printed). With --num-requests below 16 (nothing compiles), --new-tokens 16 and --repeats
1, a check that the script runs: no figures.
"""

import argparse
import gc
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import engine_class
from harness.checkpoints import get_tokenizer
from harness.serving import workload
from harness.tuning import prepare
from model import GPT, GPTConfig
from paged import blocks_for
from sequence import Request, SamplingParams

SHAPES = {"tiny": (4, 4, 128), "gpt2": (12, 12, 768)}  # n_layer, n_head, n_embd


RUNS = {  # name: (SamplingParams' settings besides the seed, whether with ext/logprobs.py)
    "greedy": (dict(), False),
    "top-k": (dict(temperature=0.8, top_k=200), False),
    "top-p": (dict(temperature=0.8, top_p=0.9), False),
    "min-p": (dict(temperature=0.8, min_p=0.05), False),
    "logprobs": (dict(temperature=0.8, top_k=200, logprobs=5), True),
}


def run(model, prompts, news, settings, logprobs, compile):
    """-> (output tok/s, median ms per sample() call, the outputs)"""
    requests = [Request(p, n, SamplingParams(**settings, seed=1337 + i)) for i, (p, n) in enumerate(zip(prompts, news))]
    num_blocks = sum(blocks_for(len(p) + n - 1, 16) for p, n in zip(prompts, news))
    cls = engine_class(logprobs=logprobs, compile=compile)  # the bare PagedEngine where it asks for neither
    engine = cls(model, num_blocks=num_blocks, vocab_size=50257, compile=compile)
    sample, times = engine.sample, []

    def timed_sample(*args):
        start = time.perf_counter()
        tokens = sample(*args).cpu()  # on the host, as the step then reads them
        times.append(time.perf_counter() - start)
        return tokens

    engine.sample = timed_sample  # this engine's own call, timed with its tokens' transfer to the host
    # the runs before left garbage (a logprobs run, ~50,000 entries): collected here, not on this run's clock,
    # where it cost the run after a logprobs run ~10% (2026-11-28)
    gc.collect()
    start = time.perf_counter()
    engine.run(requests)
    seconds = time.perf_counter() - start
    return (
        sum(len(r.generated) for r in requests) / seconds,
        1000 * statistics.median(times),
        [r.generated for r in requests],
    )


def kept_ids(model, prompts, top_p=0.9, min_p=0.05, temperature=0.8):
    """At the prompts' last tokens, medians: the ids that top-p and min-p keep, and the entropy (nats)."""
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([p]))[0][0, -1, :50257] for p in prompts]) / temperature
    p = logits.softmax(-1).sort(-1, descending=True).values
    top_p_kept = ((p.cumsum(-1) - p) < top_p).sum(-1).float().median()
    min_p_kept = (p >= min_p * p[:, :1]).sum(-1).float().median()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).median()
    return int(top_p_kept), int(min_p_kept), float(entropy)


def fmt(xs, unit=""):
    return f"{statistics.median(xs):,.2f}{unit} ({min(xs):,.2f}-{max(xs):,.2f})"


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", default="tiny,gpt2")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--compile", default="auto", choices=["auto", "kernel"], help="every engine's compile mode")
    p.add_argument("--logit-scale", type=float, default=1.0, help="the final norm's weight times this: peaked rows")
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
        with torch.no_grad():
            model.transformer.ln_f.weight.mul_(args.logit_scale)
        prepare(model)
        for how in RUNS.values():  # warm-up: the compiled decode attention, the allocator
            run(model, [p[:8] for p in prompts], [8] * len(prompts), *how, args.compile)
        results = {name: [] for name in RUNS}
        for _ in range(args.repeats):
            for name, how in RUNS.items():
                results[name].append(run(model, prompts, news, *how, args.compile))
        rate, ms = ({n: [x[i] for x in results[n]] for n in RUNS} for i in (0, 1))
        top_p_kept, min_p_kept, entropy = kept_ids(model, prompts)
        print(
            f"-- {shape} ({n_layer} x {n_embd}, vocabulary 50,304): {len(prompts)} prompts of 16, {news[0]} new, "
            f"all at once; logit scale {args.logit_scale:g}: entropy {entropy:.2f} nats, top-p 0.9 keeps {top_p_kept:,} "
            f"ids, min-p 0.05 {min_p_kept:,} (medians); compile {args.compile!r}"
        )
        print(f"{'':10} {'tok/s':>30} {'/ greedy':>18} {'/ top-k':>18} {'sample() ms/step':>22}")
        for name in RUNS:
            per_greedy = fmt([a / b for a, b in zip(rate[name], rate["greedy"])], "x")
            per_top_k = fmt([a / b for a, b in zip(rate[name], rate["top-k"])], "x")
            print(f"{name:10} {fmt(rate[name]):>30} {per_greedy:>18} {per_top_k:>18} {fmt(ms[name]):>22}")
        same = sum(a == b for a, b in zip(results["top-k"][-1][2], results["logprobs"][-1][2]))
        print(f"logprobs: the same sampled outputs as top-k's: {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
