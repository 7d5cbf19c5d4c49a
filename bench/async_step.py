"""Async scheduling, vLLM V1's, as the CUDA extension's switch async_steps (ext/async_steps.py, on in the GPU
path): a step's sampled tokens stay on the device while the next step is planned, built and launched. This
serves the same requests (the shipped model, random prompts, greedy and sampled) on the engine with the switch
off and on, and prints each one's tok/s and whether their tokens are the same; on a CPU nothing overlaps, so
only the tokens say anything there. bench/gpu.py's candidates section times it end to end on a GPU.

    python bench/async_step.py [--num-requests 32] [--device cpu|cuda] [--compile off]

The engine is ext.ServingEngine, every extension in, as the tests' engine is.
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ext import ServingEngine
from harness.checkpoints import SHIPPED, load_checkpoint
from paged import blocks_for
from sequence import Request, SamplingParams


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", default="off", help="both engines' compile mode (graph: CUDA graphs)")
    args = p.parse_args()
    model = load_checkpoint(SHIPPED, args.device)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(args.num_requests)]
    news = [rng.randint(16, 64) for _ in prompts]
    num_blocks = sum(blocks_for(len(p) + n, 16) for p, n in zip(prompts, news))
    print(f"$ python bench/async_step.py --num-requests {args.num_requests} --device {args.device} "
          f"--compile {args.compile}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}; the shipped model, prompts of 16-128 random ids, 16-64 new, "
          "every other request sampled (0.8, top-k 200)")  # fmt: skip
    outputs = {}
    for async_steps in (False, True):
        requests = [
            Request(p, n, SamplingParams(temperature=0.8 * (i % 2), top_k=200, seed=i))
            for i, (p, n) in enumerate(zip(prompts, news))
        ]
        engine = ServingEngine(model, num_blocks=num_blocks, compile=args.compile, async_steps=async_steps)
        start = time.perf_counter()
        engine.run(requests)
        seconds = time.perf_counter() - start
        outputs[async_steps] = [r.generated for r in requests]
        print(f"async_steps={async_steps!s:<6} {sum(news) / seconds:>9,.0f} tok/s")
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    print(f"the same tokens in {same} of {len(prompts)} requests")


if __name__ == "__main__":
    main()
