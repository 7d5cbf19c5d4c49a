"""Serve prompts with a nanoGPT checkpoint, on the contiguous baseline or the paged engine, and run the
experiments that compare them on one seeded workload.

    python generate.py --paged                       # the shipped tiny Shakespeare model (models/)
    python generate.py --paged --prompt "ROMEO:" --num-samples 4
    python generate.py --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --plot out/mixed.png
    python generate.py --compare --kv-budget 4096 --num-requests 150 --sweep-rates 10,20,40 --plot out/sweep.png
    python generate.py --export-hf out/hf           # the checkpoint as a Hugging Face GPT-2, for transformers and vLLM
"""

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

from contiguous import ContiguousEngine
from scheduler import PagedEngine, Request, blocks_for
from train_tiny import HelpFormatter, export_hf, get_tokenizer, load_checkpoint, shakespeare

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "tiny-shakespeare.pt")


class Meter:
    """What the experiments read of an engine, recorded from outside it (the engine keeps no measurements):
    each step's seconds (plan to sampled tokens), running sequences, keys attended and KV slots; prefill
    tokens; admitted and prefix-cached tokens; preemptions. It wraps four of the engine's methods."""

    def __init__(self, engine):
        self.engine, self.steps, self.step_start = engine, [], None
        self.prefill_tokens = self.admitted_tokens = self.cached_tokens = self.num_preemptions = 0
        schedule, sample = engine.schedule, engine.sample
        admit, preempt = getattr(engine, "admit", None), getattr(engine, "preempt", None)

        def planned():
            plan = schedule()
            self.step_start = engine.clock.now()
            self.prefill_tokens += sum(n for s, n in plan if s.status == "prefilling")
            self.plan = plan
            return plan

        def sampled(*args):
            tokens = sample(*args)
            keys = sum(s.num_computed for s, _ in self.plan)
            seconds = engine.clock.now() - self.step_start
            self.steps.append(dict(seconds=seconds, running=len(engine.running), keys=keys, **kv_slots(engine)))
            return tokens

        def admitted(s):
            group = admit(s)
            self.admitted_tokens += sum(len(x.tokens) for x in group)
            self.cached_tokens += sum(x.num_computed for x in group)
            return group

        def preempted(s):
            self.num_preemptions += 1
            preempt(s)

        engine.schedule, engine.sample = planned, sampled
        if admit:
            engine.admit, engine.preempt = admitted, preempted


def kv_slots(engine):
    """KV token slots: allocated, holding a token's K/V (once, however many sequences share it), and
    allocated ahead of the tokens to come (a paged prompt's blocks, a contiguous reservation)."""
    used = sum(s.num_computed for s in engine.running)
    if isinstance(engine, ContiguousEngine):  # unbudgeted, torch.cat holds just the tokens
        allocated = used if engine.kv_budget is None else engine.reserved
        return dict(allocated=allocated, used=used, ahead=allocated - used)
    bs, full, partial = engine.block_size, set(), {}
    for s in engine.running:  # a shared block is full, or the shared last block of forks that have not written
        k, n = divmod(s.num_computed, bs)
        full.update(s.block_table[:k])
        partial.update({s.block_table[k]: n} if n else {})
    used = len(full) * bs + sum(n for block, n in partial.items() if block not in full)
    allocated = (engine.allocator.num_blocks - engine.allocator.num_free()) * bs
    ahead = sum(len(s.block_table) - blocks_for(s.num_computed, bs) for s in engine.running) * bs
    return dict(allocated=allocated, used=used, ahead=ahead)


POOL_STATES = {  # a block's state after a step, its color in the picture
    "free": "#f4f4f4",
    "held by one sequence": "#4c72b0",
    "shared (reference count > 1)": "#dd8452",
    "cached, free (a prefix hit can revive it)": "#8fd18f",
    "copied on write this step": "#c44e52",
}
FREE, HELD, SHARED, CACHED, COPIED = range(len(POOL_STATES))


class PoolMap:
    """The block pool over a run, recorded from outside the paged engine as Meter is: after every step, each
    block's state, and the steps at which sequences were admitted and preempted. It wraps the engine's step,
    admit, preempt and reserve_slot; draw() makes the picture: one row per block, one column per step.

        pool_map = PoolMap(engine); engine.run(requests); pool_map.draw("pool.png")"""

    def __init__(self, engine):
        self.engine, self.states, self.admitted, self.preempted, self.copied = engine, [], [], [], []
        step, admit, preempt, reserve_slot = engine.step, engine.admit, engine.preempt, engine.reserve_slot

        def stepped():
            result = step()
            self.record()
            return result

        def admitted(s):
            group = admit(s)
            self.admitted += [len(self.states)] * len(group)
            return group

        def preempted(s):
            self.preempted.append(len(self.states))
            preempt(s)

        def reserved(s):  # a copy on write replaces a block of s's table in place
            before = list(s.block_table)
            reserve_slot(s)
            if len(s.block_table) == len(before):
                self.copied += [new for old, new in zip(before, s.block_table) if old != new]

        engine.step, engine.admit, engine.preempt, engine.reserve_slot = stepped, admitted, preempted, reserved

    def record(self):
        allocator = self.engine.allocator
        ref_count = np.array(allocator.ref_count)
        states = np.where(ref_count > 1, SHARED, np.where(ref_count == 1, HELD, FREE)).astype(np.int8)
        states[list(allocator.cached)] = CACHED
        # a copy is held by the sequence that made it, and by its forks if a beam step forked it; a beam that
        # died in the step let go of its copy
        states[[block for block in self.copied if ref_count[block] > 0]] = COPIED
        self.states.append(states)
        self.copied = []

    def draw(self, path, title=""):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        grid = np.stack(self.states, axis=1)  # (num_blocks, steps)
        steps = np.arange(grid.shape[1])
        fig, (events, pool) = plt.subplots(
            2, 1, figsize=(12, 6.5), sharex=True, gridspec_kw=dict(height_ratios=[1, 5], hspace=0.05)
        )
        admitted = np.bincount(self.admitted, minlength=len(steps))  # each happened inside a recorded step
        preempted = np.bincount(self.preempted, minlength=len(steps))
        events.bar(steps, admitted, width=1.0, color="#55a868", label=f"admitted ({len(self.admitted)})")
        events.bar(steps, -preempted, width=1.0, color="#c44e52", label=f"preempted ({len(self.preempted)})")
        events.axhline(0, color="black", linewidth=0.5)
        events.set(ylabel="sequences")
        events.yaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))
        events.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{abs(y):g}"))  # preemptions point down
        events.legend(loc="upper right", fontsize=8)
        colors = ListedColormap(list(POOL_STATES.values()))
        pool.imshow(grid, cmap=colors, vmin=-0.5, vmax=len(POOL_STATES) - 0.5, aspect="auto", interpolation="nearest")
        pool.set(xlabel="step", ylabel="block")
        patches = [Patch(color=c, label=name) for name, c in POOL_STATES.items()]
        pool.legend(handles=patches, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
        events.set_title(title or f"the block pool: {grid.shape[0]} blocks over {grid.shape[1]} steps")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)


LABELS = {
    "contiguous": "contiguous",
    "contiguous_max": "contiguous, reserve max",
    "paged": "paged",
    "contiguous_pow2": "contiguous, reserve pow2",
    "contiguous_oracle": "contiguous, reserve oracle",
    "paged_prefix": "paged + prefix cache",
}
TABLE_KEYS = [
    "same_output_pct",
    "output_tokens",
    "wall_s",
    "output_tok_s",
    "ttft_ms_mean",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "latency_ms_mean",
    "latency_ms_p50",
    "latency_ms_p90",
    "latency_ms_p99",
    "normalized_latency_ms",
    "request_rate",
    "steps",
    "prefill_tokens",
    "prefix_hit_rate",
    "preemptions",
    "running_peak",
    "running_mean",
    "kv_budget_slots",
    "kv_used_pct_mean",
    "kv_slots_allocated_peak",
    "kv_slots_used_peak",
    "kv_waste_pct",
    "kv_ahead_pct",
    "num_blocks",
    "block_size",
]


def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default; Hyndman and Fan's type 7), used for
    every percentile here: with two values, p90 lies 90% of the way from the smaller to the larger."""
    return float(np.percentile(values, p)) if values else None


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def metrics(meter, wall_s, rate, kv_budget):
    engine, reqs, stats = meter.engine, meter.engine.finished, meter.steps
    out = sum(len(s.generated) for r in reqs for s in returned(r))
    ttft = [(r.first_token_at - r.arrival) * 1000 for r in reqs]
    latency = [(r.done_at - r.arrival) * 1000 for r in reqs]  # end to end, from arrival to the last token
    tpot = [(r.done_at - r.first_token_at) * 1000 / (len(r.generated) - 1) for r in reqs if len(r.generated) > 1]
    peak = max(stats, key=lambda s: s["allocated"])
    m = dict(
        output_tokens=out,
        wall_s=wall_s,
        output_tok_s=out / wall_s,
        ttft_ms_mean=mean(ttft),
        ttft_ms_p90=percentile(ttft, 90),
        ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_mean=mean(tpot),  # None (not applicable) when no request made a second token
        latency_ms_mean=mean(latency),
        latency_ms_p50=percentile(latency, 50),
        latency_ms_p90=percentile(latency, 90),
        latency_ms_p99=percentile(latency, 99),
        normalized_latency_ms=mean(t / len(r.generated) for t, r in zip(latency, reqs)),
        request_rate=rate,
        steps=len(stats),
        prefill_tokens=meter.prefill_tokens,
        preemptions=meter.num_preemptions,
        running_peak=max(s["running"] for s in stats),
        running_mean=mean(s["running"] for s in stats),
        kv_budget_slots=kv_budget,
        kv_used_pct_mean=100 * mean(s["used"] / (kv_budget or max(1, s["allocated"])) for s in stats),
        kv_slots_allocated_peak=peak["allocated"],
        kv_slots_used_peak=peak["used"],
        # at peak allocation: unfilled tails of last blocks (fragmentation), and blocks held ahead of prefill
        kv_waste_pct=100 * (peak["allocated"] - peak["used"] - peak["ahead"]) / max(1, peak["allocated"]),
        kv_ahead_pct=100 * peak["ahead"] / max(1, peak["allocated"]),
        prefix_hit_rate=None,
    )
    if isinstance(engine, PagedEngine):
        m.update(
            num_blocks=engine.allocator.num_blocks,
            block_size=engine.block_size,
            prefix_hit_rate=meter.cached_tokens / max(1, meter.admitted_tokens),
        )
    return m


def cell(v):
    if v is None:
        return "—"
    if isinstance(v, int) or math.isinf(v):
        return f"{v:,}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.2f}"


def table(runs):
    """One column per run, then each run's speed relative to the first."""
    names = list(runs)
    width = max(len(LABELS[n]) for n in names) + 2
    rows = [f"{'metric':<24}" + "".join(f"{LABELS[n]:>{width}}" for n in names)]
    rows += [f"{k:<24}" + "".join(f"{cell(runs[n].get(k)):>{width}}" for n in names) for k in TABLE_KEYS]
    first = runs[names[0]]["output_tok_s"]
    rows += (
        [
            f"output tok/s relative to {LABELS[names[0]]}: "
            + ", ".join(f"{LABELS[n]} {runs[n]['output_tok_s'] / first:.2f}x" for n in names[1:])
        ]
        if len(names) > 1
        else []
    )
    return "\n".join(rows)


def fail(message):
    sys.exit(f"error: {message}")


def workload(enc, args):
    """Prompts cut from the held-out plays, seeded; each request generates exactly its drawn count."""
    rng = random.Random(args.seed)
    val = enc.encode_ordinary(shakespeare()[1])
    (lo, hi), shared = args.prompt_len, args.shared_prefix
    if shared >= hi:
        fail(
            f"--shared-prefix {shared} must be shorter than the --prompt-len maximum {hi}: every prompt has a token of its own"
        )
    if shared + hi >= len(val):
        fail(
            f"--shared-prefix {shared} + --prompt-len maximum {hi} do not fit in the {len(val):,} tokens of held-out text"
        )
    prompts, news = [], []
    for _ in range(args.num_requests):
        start = rng.randrange(shared, len(val) - hi)
        prompts.append(val[:shared] + val[start : start + max(1, rng.randint(lo, hi) - shared)])
        news.append(rng.randint(*args.new_tokens))
    return prompts, news


def arrivals(n, rate, seed):
    """Poisson arrivals, in seconds from the start: exponential gaps, seeded. Rate inf: all at 0."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        times.append(t)
    return times


def make_engine(model, kind, args, prompts, news, vocab_size):
    if kind.startswith("contiguous"):
        return ContiguousEngine(model, args.max_batch, vocab_size, args.kv_budget, kind.partition("_")[2] or "max")
    num_blocks = args.kv_budget // args.block_size if args.kv_budget else args.num_blocks
    if not num_blocks:  # default: a pool that holds every sequence at once
        width = max(args.num_samples, args.num_beams)
        num_blocks = sum(blocks_for(len(p) + n - 1, args.block_size) for p, n in zip(prompts, news)) * width
    return PagedEngine(
        model,
        num_blocks,
        args.block_size,
        args.token_budget,
        args.max_batch,
        kind == "paged_prefix",
        args.compile,
        vocab_size=vocab_size,
    )


def warm_up(engine, num_sequences):
    """Compile the paged engine's decode attention before anything is timed, if its steps will use it,
    with a line that counts the seconds: the first compile on a machine takes ~20 s on a CPU, and
    inductor's on-disk cache (under /tmp/torchinductor_$USER) brings later ones to a few seconds. It
    serves one-token prompts through `engine`, which is then spent: time a fresh one."""
    if (
        not isinstance(engine, PagedEngine)
        or engine.compile == "off"
        or min(engine.max_running, num_sequences) < engine.compile_from
    ):
        return
    what = f"compiling decode attention (torch.compile, {engine.device.type}, {engine.k_pool.dtype})"
    start, done = time.time(), threading.Event()

    def tick():  # on a terminal, the seconds so far on one line
        while not done.wait(1.0):
            print(f"\r{what}: {time.time() - start:.0f} s", end="", flush=True)

    if not sys.stdout.isatty():
        print(f"{what} ...", flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    if sys.stdout.isatty():
        ticker.start()
    engine.run([Request([0], 1) for _ in range(max(2, engine.compile_from))])  # one step of one-token rows
    done.set()
    print(f"\r{what}: done in {time.time() - start:.1f} s", flush=True)


def make_requests(args, prompts, news):
    return [
        Request(
            p,
            n,
            args.temperature,
            args.top_k,
            seed=args.seed + i * args.num_samples,
            n=args.num_samples,
            num_beams=args.num_beams,
            length_penalty=args.length_penalty,
            eos=args.eos,
        )
        for i, (p, n) in enumerate(zip(prompts, news))
    ]


def arrive(engine, requests, times):
    """Add each request to the engine at its arrival (clock seconds) and step it until all are done; an
    idle engine sleeps until the next arrival. Yields after every step."""
    pending = sorted(zip(times, range(len(requests))))[::-1]  # the next arrival last
    while pending or engine.waiting or engine.running:
        while pending and pending[-1][0] <= engine.clock.now():
            at, i = pending.pop()
            engine.add(requests[i], at)
        if engine.waiting or engine.running:
            engine.step()
            yield
        else:
            engine.clock.sleep(max(0.0, pending[-1][0] - engine.clock.now()))


def serve(engine, requests, args, rate):
    """Run one engine over the requests, arriving at `rate` -> its metrics and its steps."""
    meter, start = Meter(engine), engine.clock.now()
    for _ in arrive(engine, requests, [start + t for t in arrivals(len(requests), rate, args.seed)]):
        pass
    wall_s = engine.clock.now() - start  # every step ends in a host transfer
    return metrics(meter, wall_s, rate, args.kv_budget), meter.steps


def plot(all_stats, sweep, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep:  # the rate sweep: the paper's Fig. 12 (latency) and Fig. 13 (batch size) axes
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in sweep[0]["runs"]:
            rates = [point["request_rate"] for point in sweep]
            axes[0].plot(
                rates, [point["runs"][name]["normalized_latency_ms"] for point in sweep], "o-", label=LABELS[name]
            )
            axes[1].plot(rates, [point["runs"][name]["running_mean"] for point in sweep], "o-", label=LABELS[name])
        panels = [
            ("normalized latency", "request rate (req/s)", "ms per output token"),
            ("mean batch size", "request rate (req/s)", "requests running at once"),
        ]
    else:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for name, stats in all_stats.items():
            axes[0].plot([s["allocated"] for s in stats], label=LABELS[name])
            axes[1].plot([s["running"] for s in stats], label=LABELS[name])
            axes[2].scatter([s["keys"] for s in stats], [1000 * s["seconds"] for s in stats], s=6, label=LABELS[name])
        axes[2].set_yscale("log")  # a whole-batch prefill step would flatten the rest
        panels = [
            ("KV slots allocated", "step", "slots"),
            ("running requests", "step", "requests"),
            ("step time vs context in batch", "keys attended in the step", "ms"),
        ]
    for ax, (name, x, y) in zip(axes, panels):
        ax.set(title=name, xlabel=x, ylabel=y)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def number_type(least=None, above=None, kind=int, allow_inf=False):
    """An argparse type: a finite number (or inf where allowed) at least `least` or above `above`."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) or (allow_inf and value == math.inf)):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (least is not None and not value >= least) or (above is not None and not value > above):
            raise argparse.ArgumentTypeError(
                f"{text} is below {least}" if least is not None else f"{text} must be above {above}"
            )
        return value

    return parse


def span(text):
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def rates(text):
    return [number_type(above=0, kind=float)(r) for r in text.split(",")]


def parser():
    """Every flag, with its default and its help."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.error = lambda message: fail(message)  # one line, no usage dump
    p.add_argument(
        "--ckpt",
        default=SHIPPED,
        help="a nanoGPT ckpt.pt, or a Hugging Face GPT-2 folder (config.json and "
        "model.safetensors); the default ships with the code, python train_tiny.py remakes it in out/",
    )
    p.add_argument("--prompt", action="append", help="a prompt; repeatable (default: four speaker names)")
    p.add_argument("--prompts", help="a UTF-8 file with one prompt per line, \\n for a newline")
    p.add_argument(
        "--num-samples",
        type=number_type(1),
        default=1,
        help="samples per prompt: one prefill, then forks that share its blocks; sample i is seeded seed + i",
    )
    p.add_argument(
        "--num-beams",
        type=number_type(1),
        default=1,
        help="beam search with this many beams (greedy, as transformers' num_beams); prints the best",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end a sequence at <|endoftext|> (kept as its last token), as transformers and vLLM do; "
        "by default it runs to --max-new-tokens, as nanoGPT's sample.py",
    )
    p.add_argument(
        "--length-penalty",
        type=number_type(kind=float),
        default=1.0,
        help="beam scores are divided by (new tokens) ** this, as transformers' length_penalty",
    )
    p.add_argument("--max-new-tokens", type=number_type(1), help="tokens generated per prompt (default: 100)")
    p.add_argument(
        "--temperature",
        type=number_type(0.0, kind=float),
        help="0 means greedy; with --num-beams it must be 0 (default: 0.8)",
    )
    p.add_argument(
        "--top-k", type=number_type(1), help="sample among the k likeliest tokens; none with --num-beams (default: 200)"
    )
    p.add_argument("--seed", type=int, default=1337, help="seeds sampling, the workload and arrivals")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float64"],
        help="model and KV dtype; float64 for exact equivalence checks",
    )
    p.add_argument("--max-batch", type=number_type(1), default=64, help="requests running at once")
    p.add_argument("--json", help="write requests and metrics to this file")
    p.add_argument("--metrics", action="store_true", help="print the metrics table after plain generation")
    p.add_argument("--paged", action="store_true", help="serve with the paged engine (default: contiguous)")
    p.add_argument("--block-size", type=number_type(1), default=16, help="token slots per KV block")
    p.add_argument("--num-blocks", type=number_type(1), help="KV blocks in the pool (default: every request at once)")
    p.add_argument(
        "--token-budget",
        type=number_type(1),
        default=512,
        help="tokens per paged step, decode + prefill chunks: larger cuts time to first token, and stalls decodes longer behind a chunk",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="paged without sharing prompt blocks")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="paged decode attention through torch.compile (inductor). auto: always on a GPU; on a CPU for "
        "steps of 16 or more decode rows (measured as fast or faster), after a one-time compile (~20 s, "
        "a few seconds once cached) shown before the run; off: gather blocks + SDPA",
    )
    p.add_argument("--kv-budget", type=number_type(1), help="KV token slots every design must live within")
    p.add_argument(
        "--reserve", choices=["max", "pow2", "oracle"], help="contiguous reservation under --kv-budget (default: max)"
    )
    p.add_argument(
        "--request-rate",
        type=number_type(above=0, kind=float, allow_inf=True),
        default=math.inf,
        help="Poisson arrivals per second; inf: all at once",
    )
    p.add_argument("--compare", action="store_true", help="every design on one workload: one table, one plot")
    p.add_argument(
        "--sweep-rates", type=rates, help="with --compare: comma-separated request rates, each run by every design"
    )
    p.add_argument("--num-requests", type=number_type(1), help="serve a seeded workload cut from held-out text")
    p.add_argument("--prompt-len", type=span, default=(16, 128), help="workload prompt tokens, MIN:MAX")
    p.add_argument("--new-tokens", type=span, default=(16, 128), help="workload new tokens, MIN:MAX")
    p.add_argument("--shared-prefix", type=number_type(0), default=0, help="tokens every workload prompt starts with")
    p.add_argument("--plot", help="draw the runs (or the sweep) to this image file")
    p.add_argument(
        "--pool-map", metavar="FILE", help="with --paged: draw every block's state at every step to this image file"
    )
    p.add_argument(
        "--export-hf",
        metavar="DIR",
        help="write --ckpt as a Hugging Face GPT-2 folder (safetensors, tokenizer) and exit",
    )
    return p


def parse_args(argv=None):
    """The flags, checked together: what needs what, what excludes what, and the paths written later."""
    args = parser().parse_args(argv)
    for flag, value, needs, present in [
        ("--reserve", args.reserve, "--kv-budget", args.kv_budget),
        ("--sweep-rates", args.sweep_rates, "--compare", args.compare),
        ("--num-blocks", args.num_blocks, "no --kv-budget", not args.kv_budget),
        ("--length-penalty", args.length_penalty != 1, "--num-beams", args.num_beams > 1),
        ("--pool-map", args.pool_map, "--paged, without --compare", args.paged and not args.compare),
    ]:
        if value and not present:
            fail(f"{flag} needs {needs}")
    if args.num_beams > 1 and (args.num_samples > 1 or args.temperature or args.top_k or args.stop_at_eos):
        fail(
            f"--num-beams {args.num_beams} is greedy beam search to --max-new-tokens: it takes no --num-samples, "
            "--temperature, --top-k or --stop-at-eos"
        )
    args.temperature = (0.0 if args.num_beams > 1 else 0.8) if args.temperature is None else args.temperature
    args.top_k = 200 if args.top_k is None and args.num_beams == 1 else args.top_k
    if args.kv_budget and args.kv_budget < args.block_size:
        fail(f"--kv-budget {args.kv_budget} slots hold no block of --block-size {args.block_size}")
    workload_run = args.num_requests or (args.compare and not (args.prompt or args.prompts))
    if workload_run and args.max_new_tokens:
        fail("--max-new-tokens is for your own prompts; a --num-requests workload draws --new-tokens MIN:MAX")
    args.max_new_tokens = args.max_new_tokens or 100
    args.num_requests = args.num_requests or (64 if workload_run else None)
    images = [("--plot", args.plot), ("--pool-map", args.pool_map)]
    for flag, path in [("--json", args.json)] + images:  # fail now, not after the whole run
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            fail(f"{flag} {path}: the folder {folder} does not exist or is not writable")
    for flag, path in images:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if path and os.path.splitext(path)[1][1:].lower() not in kinds:
            fail(f"{flag} {path}: the file name must end in one of .{', .'.join(sorted(kinds))}")
    return args


def read_prompts(args, enc):
    """The prompts as (texts, token lists, new-token counts), or exit with a one-line error."""
    if args.num_requests:
        prompts, news = workload(enc, args)
        return [enc.decode(p) for p in prompts], prompts, news
    texts = list(args.prompt or [])
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                texts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        except OSError as e:
            fail(f"cannot read --prompts file {args.prompts}: {e.strerror}")
        except UnicodeDecodeError as e:
            fail(f"--prompts file {args.prompts} is not UTF-8 text: {e.reason} at byte {e.start}")
        if not texts:
            fail(f"--prompts file {args.prompts} holds no prompt")
    texts = texts or ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "KING LEAR:\n"]
    prompts = [enc.encode(t, allowed_special={"<|endoftext|>"}) for t in texts]  # Engine.add checks each
    return texts, prompts, [args.max_new_tokens] * len(prompts)


def returned(r):
    """What a request gives back: its n samples, or its one sequence (the best beam; the JSON lists all)."""
    return r.sequences if r.n > 1 else r.sequences[:1]


def outputs(r):
    return [s.generated for s in returned(r)]


def request_json(texts, requests, enc):
    done = []
    for i, r in enumerate(requests):
        if r.status != "done":
            continue
        done.append(
            {
                "index": i,
                "prompt": texts[i],
                "prompt_tokens": r.prompt,
                "output_tokens": r.generated,
                "text": enc.decode(r.generated),
            }
        )
        if r.n > 1 or r.num_beams > 1:  # samples in order; beams best first, with HF's length-penalized score
            done[-1]["sequences"] = [
                dict(
                    output_tokens=s.generated,
                    text=enc.decode(s.generated),
                    seed=s.seed,
                    **(dict(score=s.score) if r.num_beams > 1 else {}),
                )
                for s in r.sequences
            ]
    return done


def load_model(args):
    try:
        model = load_checkpoint(args.ckpt, args.device).to(getattr(torch, args.dtype))
        return model, get_tokenizer(model.config.vocab_size)
    except ValueError as e:
        fail(e)


def choose_designs(args):
    """The engines to run: every design with --compare; else the one that --paged and --kv-budget name."""
    if args.compare:
        kinds = ["contiguous_max", "contiguous_pow2", "contiguous_oracle"] if args.kv_budget else ["contiguous"]
        return kinds + ["paged", "paged_prefix"]
    if args.paged:
        return ["paged" if args.no_prefix_cache else "paged_prefix"]
    return ["contiguous_" + (args.reserve or "max") if args.kv_budget else "contiguous"]


def run_designs(model, kinds, args, prompts, news, vocab_size, results):
    """Warm every design up untimed, then serve the workload with each, at each rate. results fills in as
    runs finish, so that an interrupt keeps them."""
    for kind in kinds:  # untimed: first calls pay one-time setup, which would bias the first design run
        engine = make_engine(model, kind, args, prompts, news, vocab_size)
        for r in make_requests(args, prompts, news):  # refuse what can never run before compiling anything
            engine.check(r)
        warm_up(engine, len(prompts) * max(args.num_samples, args.num_beams))
        make_engine(model, kind, args, prompts, news, vocab_size).run([Request(p[:16], 2) for p in prompts[:2]])
    for rate in args.sweep_rates or [args.request_rate]:
        results.runs = {}
        for kind in kinds:
            engine = make_engine(model, kind, args, prompts, news, vocab_size)
            results.requests = make_requests(args, prompts, news)
            results.pool_map = PoolMap(engine) if args.pool_map else None  # --paged: one design
            results.runs[kind], results.steps[kind] = serve(engine, results.requests, args, rate)
            if kind == kinds[0]:
                first = results.requests
            else:  # token for token against the first run, on the same workload
                same = sum(outputs(r) == outputs(f) for r, f in zip(results.requests, first))
                results.runs[kind]["same_output_pct"] = 100 * same / len(first)
        results.sweep.append({"request_rate": rate, "runs": results.runs})
        if args.sweep_rates:
            print(f"--- request rate {rate:g}/s\n{table(results.runs)}", flush=True)


def report(args, kinds, texts, prompts, results, enc):
    """Print the samples or the table, and write the JSON and the plot."""
    runs, requests = results.runs, results.requests
    workload_name = (
        f"{len(prompts)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.new_tokens[0]}-{args.new_tokens[1]} new"
        if args.num_requests
        else f"{len(prompts)} prompts"
    )
    if args.kv_budget:
        workload_name += f", KV budget {args.kv_budget:,} slots"
    if not args.num_requests and not args.compare:
        for i, r in enumerate(requests):
            for j, s in enumerate(returned(r)):
                which = f", sample {j} (seed {s.seed})" if r.n > 1 else ""
                which += f", best of {r.num_beams} beams (score {r.sequences[0].score:.4f})" if r.num_beams > 1 else ""
                print(f"--- request {i}{which}, {len(s.generated)} new tokens\n{texts[i]}{enc.decode(s.generated)}")
        m = runs[kinds[0]]
        print(
            f"--- {LABELS[kinds[0]]}: {m['output_tokens']:,} new tokens in {m['wall_s']:.2f} s, "
            f"{m['output_tok_s']:,.0f} tok/s ({args.device}, {args.dtype})"
        )
    if (args.num_requests or args.compare or args.metrics) and not args.sweep_rates:  # a sweep printed its tables
        print(f"--- {workload_name} on {args.device}, {args.dtype}\n{table(runs)}")
    if args.json:
        if args.sweep_rates:
            out = {"sweep": results.sweep}
        elif args.compare:
            out = {"runs": runs}
        else:
            out = {"metrics": runs[kinds[0]], "requests": request_json(texts, requests, enc)}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(results.steps, results.sweep if args.sweep_rates else None, args.plot, workload_name)
        print(f"plot written to {args.plot}")
    if args.pool_map:
        pool_map = results.pool_map
        num_blocks, steps = pool_map.engine.allocator.num_blocks, len(pool_map.states)
        pool_map.draw(args.pool_map, f"{workload_name}, {LABELS[kinds[0]]}: {num_blocks} blocks of {args.block_size}")
        print(f"pool map written to {args.pool_map}: {num_blocks} blocks over {steps} steps")


def main(argv=None):
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device} asked for, but this torch sees no CUDA GPU")
    if args.export_hf:  # no training on the way: exporting a checkpoint that is not there is an error
        try:
            export_hf(load_checkpoint(args.ckpt), args.export_hf)
        except ValueError as e:
            fail(e)
        print(
            f"exported {args.ckpt} to {args.export_hf}: config.json, model.safetensors, vocab.json, merges.txt, "
            "tokenizer_config.json"
        )
        return
    model, enc = load_model(args)
    args.eos = enc.eot_token if args.stop_at_eos else None
    texts, prompts, news = read_prompts(args, enc)
    kinds = choose_designs(args)
    if args.kv_budget:
        c = model.config  # one slot: one token's K and V in every layer and head
        slot_bytes = 2 * c.n_layer * c.n_embd * model.lm_head.weight.element_size()
        print(
            f"KV budget: {args.kv_budget:,} slots x {slot_bytes:,} bytes = {args.kv_budget * slot_bytes / 2**20:,.1f} MB"
        )
    results = SimpleNamespace(sweep=[], runs={}, steps={}, requests=[])
    try:
        run_designs(model, kinds, args, prompts, news, enc.n_vocab, results)
    except ValueError as e:
        fail(e)
    except KeyboardInterrupt:  # keep what finished: the runs done, and the requests done in this one
        done = request_json(texts, results.requests, enc)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"interrupted": True, "runs": results.runs, "requests": done}, f, indent=1)
        fail(
            f"interrupted: {len(done)} of {len(results.requests)} requests of this run had finished"
            + (f"; they and the finished runs are in {args.json}" if args.json else "")
        )
    report(args, kinds, texts, prompts, results, enc)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # during loading or training; once serving, main keeps what finished
        sys.exit("interrupted before any request was served")
