"""Compiled against eager decode attention in the paged engine, on the CPU, on the README's workloads.

    python bench/compile_cpu.py [--repeats 3] [--rows all|small]

Each row builds a random-weight GPT of the shape named (GPT-2's padded 50,304-id vocabulary), a seeded
workload of Shakespeare prompts, and one PagedEngine per path (compile="off": gather_kv + SDPA; compile="on":
torch.compile(gather_attend)). Both paths warm up first (the compile is timed on its own and printed); the
timed runs then alternate eager, compiled in one process, greedy, all requests at once, and the ratio is
taken per repeat. Outputs are compared token for token.
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
from harness.serving import warm_up, workload
from harness.tuning import prepare
from model import GPT, GPTConfig
from scheduler import PagedEngine
from sequence import Request

ROWS = {  # name: (n_layer, n_embd, requests, prompt tokens, new tokens)
    "12x768, 64 req, 100-200 + 48": (12, 768, 64, (100, 200), (48, 48)),
    "12x768, 64 req, 150-250 + 128": (12, 768, 64, (150, 250), (128, 128)),
    "6x384, 64 req, 100-200 + 48": (6, 384, 64, (100, 200), (48, 48)),
    "12x768, 16 req, 600-700 + 256": (12, 768, 16, (600, 700), (256, 256)),
    "6x384, 16 req, 100-200 + 48": (6, 384, 16, (100, 200), (48, 48)),
}


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="all", help="all, or a comma-separated list of row numbers (1-based)")
    return p


def main():
    args = parser().parse_args()
    enc = get_tokenizer(50304)
    names = list(ROWS) if args.rows == "all" else [list(ROWS)[int(i) - 1] for i in args.rows.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name in names:
        n_layer, n_embd, num_requests, prompt_len, new_tokens = ROWS[name]
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(block_size=1024, vocab_size=50304, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd)
        ).eval()
        prepare(model)
        spec = SimpleNamespace(
            seed=1337, prompt_len=prompt_len, new_tokens=new_tokens, num_requests=num_requests, shared_prefix=0
        )
        prompts, news = workload(enc, spec)
        num_blocks = sum(-(-(len(p) + n - 1) // 16) for p, n in zip(prompts, news))
        engines = {
            mode: PagedEngine(model, num_blocks=num_blocks, max_batch=64, vocab_size=50257, compile=mode)
            for mode in ("off", "on")
        }
        start = time.time()
        warm_up(engines["on"], len(prompts))
        compile_s = time.time() - start
        for engine in engines.values():
            engine.run([Request(p[:32], 4) for p in prompts[:4]])
        speeds, outputs = {"off": [], "on": []}, {}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                engine = PagedEngine(model, num_blocks=num_blocks, max_batch=64, vocab_size=50257, compile=mode)
                requests = [Request(p, n) for p, n in zip(prompts, news)]
                start = time.perf_counter()
                engine.run(requests)
                speeds[mode].append(sum(news) / (time.perf_counter() - start))
                outputs.setdefault(mode, [r.generated for r in requests])
        ratios = [on / off for on, off in zip(speeds["on"], speeds["off"])]
        same = sum(a == b for a, b in zip(outputs["off"], outputs["on"]))
        fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
        print(
            f"{name}: eager {fmt(speeds['off'])} tok/s, compiled {fmt(speeds['on'])} tok/s, "
            f"compiled/eager {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
            f"warm-up {compile_s:.1f} s, same output {same}/{len(prompts)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
