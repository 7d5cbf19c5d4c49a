"""How close the paged engine runs to the machine's floor on the README's mixed workload, and what its
step costs on the host before the forward starts.

    python bench/floor.py [--repeats 3] [--vocab-size 50304] [--num-requests 128]

The floor replays the engine's own steps (the same tokens per request, the same logit rows) through the
same model, with attention over K/V that are already gathered: each step's decode rows get (S, L, H, D)
tensors and each chunk after cached tokens gets its own, made before the step is timed. So the floor is
the dense work plus the attention, without writing to or gathering from the pool, scheduling, building
the batch or sampling. Engine and floor alternate in one process; the ratio is taken per repeat.

--vocab-size N swaps the checkpoint for random weights of its shape with an N-id vocabulary (50304:
GPT-2's, padded as nanoGPT does), where the lm_head and sampling weigh far more.

Host time: from a step's start (scheduling) to its forward's first op, per decode-only step, on two
workloads of 64 requests that hold few and many blocks; it should follow the requests, not the blocks.
Sampling: the sampled workload's time in sample() against the greedy argmax, per step.

The engine is the one `generate.py --paged` builds for these requests: the bare PagedEngine (scheduler.py).
--num-requests N shrinks every workload to N requests (the host and sampling ones to at most 64): with
--repeats 1 and a small N, a check that the script runs, whose figures mean nothing.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import engine as engine_py
from batch import StepBatch
from engine import PlanEntry, Sampler
from harness.checkpoints import get_tokenizer, load_checkpoint
from harness.serving import workload
from harness.tuning import prepare
from model import GPT, GPTConfig, attend, visible_keys
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, SamplingParams


class FloorBatch(StepBatch):
    """A step whose earlier K/V already sit gathered in dense tensors: nothing is written or read back."""

    def __init__(self, starts, lens, entries, config):
        plan = []
        for a, n in zip(starts, lens):  # a stand-in sequence: a + n tokens, a of them cached
            s = Request([0] * (a + n), 1).sequences[0]
            s.num_computed, s.row = a, 0
            plan.append(PlanEntry(s, n))
        super().__init__(plan, [Sampler(plan[i].sequence, i) for i in entries], torch.device("cpu"))
        H, D, S = config.n_head, config.n_embd // config.n_head, self.num_one_token
        L = int(self.kv_lens[:S].max()) if S else 0
        self.decode_pos = torch.from_numpy(self.kv_lens[:S, None] - 1)  # (S, 1): each one-token entry's position
        self.single = [(torch.randn(S, L, H, D), torch.randn(S, L, H, D)) for _ in range(config.n_layer)]
        self.cached = {
            i: [(torch.randn(1, end, H, D), torch.randn(1, end, H, D)) for _ in range(config.n_layer)]
            for i, end in enumerate(self.kv_lens.tolist())
            if i >= S and starts[i] > 0
        }

    def store(self, layer, k, v):
        pass

    def attend_one_token(self, layer, q):
        k, v = self.single[layer]
        return attend(q[:, None], k, v, visible_keys(k, self.decode_pos))[:, 0]

    def chunk_kv(self, layer, chunk):
        return self.cached[chunk.entry][layer]


class Probe:
    """Times what the engine does around its forward: host time per decode-only step, and sample()."""

    def __init__(self, engine):
        self.host, self.sampling, self.step_start, self.decode_only = [], [], None, False
        schedule, forward, sample = engine.schedule, engine.model.forward, engine_py.sample

        def timed_schedule():
            self.step_start = time.perf_counter()
            plan = schedule()
            self.decode_only = all(n == 1 for _, n in plan)
            return plan

        def timed_forward(*args, **kwargs):
            if self.decode_only:
                self.host.append(time.perf_counter() - self.step_start)
            return forward(*args, **kwargs)

        def timed_sample(*args, **kwargs):
            start = time.perf_counter()
            tokens = sample(*args, **kwargs)
            self.sampling.append(time.perf_counter() - start)
            return tokens

        engine.schedule, engine.model.forward, engine_py.sample = timed_schedule, timed_forward, timed_sample
        self.restore = lambda: setattr(engine_py, "sample", sample) or vars(engine.model).pop("forward")


def run_engine(model, prompts, news, steps=None, temperature=0.8, probe=False):
    """Serve the workload as `generate.py --paged` does -> seconds (and the Probe); appends (starts, lens,
    samplers) of each step to `steps`."""
    requests = [
        Request(p, n, SamplingParams(temperature=temperature, top_k=200, seed=1337 + i))
        for i, (p, n) in enumerate(zip(prompts, news))
    ]
    engine = PagedEngine(model, num_blocks=sum(blocks_for(len(p) + n - 1, 16) for p, n in zip(prompts, news)))
    make_batch = engine.make_batch

    def record(plan, samplers):
        if steps is not None:
            steps.append(([s.num_computed for s, _ in plan], [n for _, n in plan], [x.entry for x in samplers]))
        return make_batch(plan, samplers)

    engine.make_batch = record
    timer = Probe(engine) if probe else None
    start = time.perf_counter()
    engine.run(requests)
    seconds = time.perf_counter() - start
    if timer:
        timer.restore()
    return (seconds, timer) if probe else seconds


@torch.no_grad()
def run_floor(model, steps):
    seconds = 0.0
    for starts, lens, samplers in steps:
        batch = FloorBatch(starts, lens, samplers, model.config)
        start = time.perf_counter()
        model(batch.idx, batch=batch)
        seconds += time.perf_counter() - start
    return seconds


def summary(name, xs, unit, scale=1.0):
    xs = [x * scale for x in xs]
    return f"{name:<34} median {statistics.median(xs):8.3f}{unit}  (min {min(xs):.3f}, max {max(xs):.3f})"


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--ckpt",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "tiny-shakespeare.pt"),
    )
    p.add_argument("--vocab-size", type=int, help="random weights of the checkpoint's shape with this vocabulary")
    p.add_argument("--num-requests", type=int, default=128, help="the floor's requests (host and sampling: <= 64)")
    return p


def main():
    args = parser().parse_args()
    n, m = args.num_requests, min(args.num_requests, 64)
    model = load_checkpoint(args.ckpt)
    if args.vocab_size:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**vars(model.config), "vocab_size": args.vocab_size})).eval()
    prepare(model)  # as generate.py loads a model: engine and floor run the same linears
    c = model.config
    enc = get_tokenizer(c.vocab_size)
    wl = argparse.Namespace(seed=1, prompt_len=(8, 192), new_tokens=(8, 64), shared_prefix=0, num_requests=n)
    prompts, news = workload(enc, wl)
    steps = []
    run_engine(model, prompts, news, steps)  # warm-up, and the steps to replay
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}; model "
        f"{c.n_layer} x {c.n_embd}, vocabulary {c.vocab_size:,}{' (random weights)' if args.vocab_size else ''}"
    )
    print(
        f"-- engine against its floor: {len(steps)} steps, README mixed workload ({n} requests, prompts 8-192, "
        f"8-64 new, seed 1, temperature 0.8, top-k 200)"
    )
    engine_s, floor_s = [], []
    for _ in range(args.repeats):
        engine_s.append(run_engine(model, prompts, news))
        floor_s.append(run_floor(model, steps))
    ratios = [e / f for e, f in zip(engine_s, floor_s)]
    for name, xs, unit in [("engine", engine_s, "s"), ("floor", floor_s, "s"), ("engine / floor", ratios, "x")]:
        print(summary(name, xs, unit))

    print(f"-- host time per decode-only step, step start to the forward's first op ({m} requests, 32 new each)")
    few, many = [(16, 16), (190, 190)], {}
    for lo, hi in few:
        wl = argparse.Namespace(seed=2, prompt_len=(lo, hi), new_tokens=(32, 32), shared_prefix=0, num_requests=m)
        many[lo] = workload(enc, wl)
    host = {lo: [] for lo in many}
    for _ in range(args.repeats):
        for lo, (ps, ns) in many.items():
            host[lo].append(statistics.median(run_engine(model, ps, ns, probe=True)[1].host))
    for lo, xs in host.items():
        blocks = m * blocks_for(lo + 32, 16)
        print(summary(f"prompts of {lo}, ~{blocks:,} blocks held", xs, " ms", 1000))

    print(f"-- sampling against greedy: {m} prompts of 16 tokens, 128 new, max_batch 64")
    wl = argparse.Namespace(seed=3, prompt_len=(16, 16), new_tokens=(128, 128), shared_prefix=0, num_requests=m)
    ps, ns = workload(enc, wl)
    greedy, sampled, ratio, sample_ms, argmax_ms = [], [], [], [], []
    for _ in range(args.repeats):
        g, g_probe = run_engine(model, ps, ns, temperature=0.0, probe=True)
        s, s_probe = run_engine(model, ps, ns, temperature=0.8, probe=True)
        greedy.append(m * 128 / g)
        sampled.append(m * 128 / s)
        ratio.append(g / s)
        sample_ms.append(statistics.median(s_probe.sampling))
        argmax_ms.append(statistics.median(g_probe.sampling))
    print(summary("greedy", greedy, " tok/s"))
    print(summary("sampled (0.8, top-k 200)", sampled, " tok/s"))
    print(summary("sampled / greedy", ratio, "x"))
    print(summary("sample() per step, greedy", argmax_ms, " ms", 1000))
    print(summary("sample() per step, sampled", sample_ms, " ms", 1000))


if __name__ == "__main__":
    main()
