"""How close the paged engine runs to the machine's floor on the README's mixed workload.

    python bench/floor.py [--repeats 3]

The floor replays the engine's own steps (the same tokens per request, the same logit rows) through the
same model, with attention over K/V that are already gathered: each step's decode rows get (S, L, H, D)
tensors and each chunk after cached tokens gets its own, made before the step is timed. So the floor is
the dense work plus the attention, without writing to or gathering from the pool, scheduling, building
the batch or sampling. Engine and floor alternate in one process; the ratio is taken per repeat.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from generate import workload  # noqa: E402
from model import attend  # noqa: E402
from paged import StepBatch  # noqa: E402
from scheduler import Request, Scheduler  # noqa: E402
from train_tiny import get_tokenizer, load_checkpoint  # noqa: E402


class FloorBatch(StepBatch):
    """A step whose earlier K/V already sit gathered in dense tensors: nothing is written or read back."""

    def __init__(self, starts, lens, ready, config):
        super().__init__(starts, lens, "cpu", ready)
        H, D, S = config.n_head, config.n_embd // config.n_head, self.num_single
        L = int(self.kv_lens[:S].max()) if S else 0
        self.single = [(torch.randn(S, L, H, D), torch.randn(S, L, H, D)) for _ in range(config.n_layer)]
        self.cached = {i: [(torch.randn(1, end, H, D), torch.randn(1, end, H, D)) for _ in range(config.n_layer)]
                       for i, end in enumerate(self.kv_lens.tolist()) if i >= S and starts[i] > 0}

    def store(self, layer, k, v):
        pass

    def attend_single(self, layer, q):
        k, v = self.single[layer]
        return attend(q[:, None], k, v, self.single_pos)[:, 0]

    def cached_kv(self, layer, i):
        return self.cached[i][layer]


def run_engine(model, prompts, news, steps=None):
    """Serve the workload as `generate.py --paged` does -> seconds; appends (starts, lens, ready) of each step to `steps`."""
    requests = [Request(p, n, 0.8, 200, seed=1337 + i) for i, (p, n) in enumerate(zip(prompts, news))]
    engine = Scheduler(model, sum(-(-(len(p) + n - 1) // 16) for p, n in zip(prompts, news)))
    make_batch = engine.make_batch

    def record(plan, ready):
        if steps is not None:
            steps.append(([r.num_computed for r, _ in plan], [n for _, n in plan], ready))
        return make_batch(plan, ready)
    engine.make_batch = record
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start


@torch.no_grad()
def run_floor(model, steps):
    seconds = 0.0
    for starts, lens, ready in steps:
        batch = FloorBatch(starts, lens, ready, model.config)
        idx = torch.randint(0, model.config.vocab_size, (sum(lens),))
        start = time.perf_counter()
        model(idx, cache=batch)
        seconds += time.perf_counter() - start
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ckpt", default="out/ckpt.pt")
    args = p.parse_args()
    model = load_checkpoint(args.ckpt)
    wl = argparse.Namespace(seed=1, prompt_len=(8, 192), new_tokens=(8, 64), shared_prefix=0, num_requests=128)
    prompts, news = workload(get_tokenizer(model.config.vocab_size), wl)
    steps = []
    run_engine(model, prompts, news, steps)  # warm-up, and the steps to replay
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}; "
          f"{len(steps)} steps, README mixed workload (128 requests, prompts 8-192, 8-64 new, seed 1)")
    engine_s, floor_s = [], []
    for _ in range(args.repeats):
        engine_s.append(run_engine(model, prompts, news))
        floor_s.append(run_floor(model, steps))
    ratios = [e / f for e, f in zip(engine_s, floor_s)]
    for name, xs, unit in [("engine", engine_s, "s"), ("floor", floor_s, "s"), ("engine / floor", ratios, "x")]:
        print(f"{name:<15} median {statistics.median(xs):.3f}{unit}  (min {min(xs):.3f}, max {max(xs):.3f})")


if __name__ == "__main__":
    main()
