"""The host side of an engine step: what the scheduler, the batch, staging, sampling and bookkeeping cost, with
the forward timed apart, at 256 running sequences. The model is too small to cost anything (1 layer, 32 wide,
a 256-token vocabulary), so what remains is the part that a GPU step's graph replay cannot hide.

    python bench/host_step.py [--device cpu|cuda] [--repeats 3] [--num-requests 256]

256 requests of 16-512 random prompt tokens and 16-256 new tokens (seed 3), max_batch 256, token budget
4,096, compile off (graphs on CUDA would hide the forward's launches, not the host side). On CUDA the forward
is timed to its last launch, not to its end: the host side is then the step's wall time less that. The engine
is the bare PagedEngine, as `generate.py --paged --compile off` builds it for these requests.
"""

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model import GPT, GPTConfig
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request


def host_step_ms(device, num_requests=256, max_batch=256):
    """-> (steps, ms a step, forward ms a step, host ms a step, steps that ran 256 sequences' decodes)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, vocab_size=256, n_layer=1, n_head=1, n_embd=32)).eval().to(device)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 512))] for _ in range(num_requests)]
    news = [rng.randint(16, 256) for _ in range(num_requests)]
    num_blocks = sum(blocks_for(len(p) + n, 16) for p, n in zip(prompts, news))
    engine = PagedEngine(model, num_blocks=num_blocks, max_batch=max_batch, token_budget=4096, compile="off")
    forward_s = []
    forward = engine.forward

    def timed_forward(batch):
        start = time.perf_counter()
        logits = forward(batch)
        forward_s.append(time.perf_counter() - start)
        return logits

    engine.forward = timed_forward
    start = time.perf_counter()
    engine.run([Request(p, n) for p, n in zip(prompts, news)])
    wall_s = time.perf_counter() - start
    steps = len(forward_s)
    return steps, wall_s / steps * 1e3, sum(forward_s) / steps * 1e3, (wall_s - sum(forward_s)) / steps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=256, help="running at once, up to 256")
    args = p.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    name = f"{cpu}, {torch.cuda.get_device_name() if args.device == 'cuda' else 'no GPU'}"
    print(
        f"$ python bench/host_step.py --device {args.device} --repeats {args.repeats} "
        f"--num-requests {args.num_requests}"
    )
    print(f"{name}, torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    host_step_ms(args.device, min(32, args.num_requests))  # warm: first calls pay one-time setup
    hosts = []
    for i in range(args.repeats):
        steps, step_ms, forward_ms, host_ms = host_step_ms(args.device, args.num_requests)
        hosts.append(host_ms)
        print(f"run {i}: {steps} steps, {step_ms:.2f} ms a step: forward {forward_ms:.2f} ms, host {host_ms:.2f} ms")
    print(f"host side a step: median {statistics.median(hosts):.2f} ms ({min(hosts):.2f}-{max(hosts):.2f})")


if __name__ == "__main__":
    main()
