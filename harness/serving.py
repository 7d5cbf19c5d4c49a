"""Serving a workload: seeded prompts cut from held-out Shakespeare, Poisson arrivals, an engine built from
the command line's flags, warmed up untimed, then stepped as requests arrive, with a Meter listening."""

import contextlib
import math
import random
import statistics
import sys
import threading
import time
from types import SimpleNamespace

import torch

from ext import engine_class
from ext.logprobs import Logprobs
from harness.checkpoints import shakespeare
from harness.contiguous import ContiguousEngine
from harness.metrics import Meter, metrics
from harness.tuning import freeze_heap
from paged import blocks_for
from scheduler import PagedEngine
from sequence import Request, SamplingParams


def workload(enc, args):
    """Prompts cut from the held-out plays, seeded; each request generates exactly its drawn count. Raises
    ValueError, in one line, for a workload the text cannot hold."""
    rng = random.Random(args.seed)
    val = enc.encode_ordinary(shakespeare()[1])
    (lo, hi), shared = args.prompt_len, args.shared_prefix
    if shared >= hi:
        raise ValueError(
            f"--shared-prefix {shared} must be shorter than the --prompt-len maximum {hi}: every prompt has a token of its own"
        )
    if shared + hi >= len(val):
        raise ValueError(
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


def block_bytes(model, block_size):
    """One KV block: block_size tokens' K and V in every layer, in the model's dtype."""
    c = model.config
    return 2 * c.n_layer * block_size * c.n_embd * model.lm_head.weight.element_size()


def free_memory(device):
    """Bytes free on the device now: CUDA's own count; on a CPU, Linux's MemAvailable (None elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def cuda_defaults(model, block_size, blocks_needed):
    """On CUDA, as vLLM sizes itself: 256 sequences at once (its max_num_seqs), 4,096 tokens a step, and a pool
    in 90% of the GPU's free memory (its gpu_memory_utilization), no larger than the workload needs at once."""
    free = free_memory(model.lm_head.weight.device)
    return dict(
        max_batch=256,
        token_budget=4096,
        num_blocks=min(int(0.9 * free) // block_bytes(model, block_size), blocks_needed),
    )


def check_pool_memory(model, block_size, num_blocks):
    """A KV pool larger than the device's free memory is refused in one line (ValueError), before the allocation
    fails with a traceback or, on a CPU, the kernel's out-of-memory killer ends the process without a word."""
    device = model.lm_head.weight.device
    pool_bytes = (num_blocks + 1) * block_bytes(model, block_size)  # and the padding block
    free = free_memory(device)
    if free is not None and pool_bytes > free:
        raise ValueError(
            f"a KV pool of {num_blocks:,} blocks of {block_size:,} tokens takes {pool_bytes / 2**30:,.1f} GiB, but "
            f"{device.type} has {free / 2**30:,.1f} GiB free: lower --num-blocks or --block-size"
        )


def make_engine(model, kind, args, prompts, news, vocab_size):
    """The engine a design names, from the flags; on CUDA, what no flag sets comes from cuda_defaults."""
    max_batch = args.max_batch or 64
    if kind.startswith("contiguous"):
        return ContiguousEngine(
            model,
            max_batch=max_batch,
            vocab_size=vocab_size,
            kv_budget=args.kv_budget,
            reserve=kind.partition("_")[2] or "max",
            early_stopping=args.early_stopping,
        )
    width = max(args.num_samples, args.num_beams)
    # default: a pool that holds every sequence at once
    needed = sum(blocks_for(len(p) + n - 1, args.block_size) for p, n in zip(prompts, news)) * width
    sizes = dict(max_batch=max_batch, token_budget=args.token_budget or 512, num_blocks=needed)
    if model.lm_head.weight.is_cuda:
        sizes = {
            name: getattr(args, name) or value for name, value in cuda_defaults(model, args.block_size, needed).items()
        }
    if args.kv_budget:
        sizes["num_blocks"] = args.kv_budget // args.block_size
    elif args.num_blocks:
        sizes["num_blocks"] = args.num_blocks
    if model.lm_head.weight.is_cuda:
        print(f"on CUDA: max_batch {sizes['max_batch']}, token budget {sizes['token_budget']}, {sizes['num_blocks']:,} "
              "blocks (by default: 256, 4,096, at most 90% of free memory)", flush=True)  # fmt: skip
    compile = args.compile
    if model.lm_head.weight.is_cuda and compile == "auto":
        compile = "graph"  # the GPU path, as an H200 verified it: CUDA graphs, ~5x eager steps (docs/gpu.md)
    start = time.time()
    # exactly the extensions the flags ask for: a plain run is the bare PagedEngine (on a CPU)
    cls = engine_class(
        forks=width > 1,
        logprobs=args.logprobs is not None,
        swap=args.swap_blocks > 0,  # parse_args: none unless --preemption swap
        speculative=args.num_speculative_tokens != 0,
        compile=compile,
    )
    check_pool_memory(model, args.block_size, sizes["num_blocks"])
    extras = {}
    if width > 1:
        extras.update(early_stopping=args.early_stopping)
    if args.swap_blocks:
        extras.update(swap_blocks=args.swap_blocks)
    if args.num_speculative_tokens:
        extras.update(num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_max=args.prompt_lookup_max or 3)
    engine = cls(
        model,
        block_size=args.block_size,
        **sizes,
        prefix_cache=kind == "paged_prefix",
        compile=compile,
        vocab_size=vocab_size,
        **extras,
    )
    if getattr(engine, "graphs", None):
        shapes = f"batches {engine.graph_batches[0]}-{engine.graph_batches[-1]}"  # ext/cuda.py
        print(f"captured {len(engine.graphs)} CUDA graphs of decode steps ({shapes}) in {time.time() - start:.1f} s")
    return engine


def warm_up(engine, num_sequences):
    """Compile what the paged engine's steps will use before anything is timed, with a line that counts the
    seconds: its decode attention, its log-probabilities' scores, and with --compile step its small steps' graph.
    The first compile on a machine takes ~20 s on a CPU (~60 s for step, ~35 s cached), and inductor's on-disk
    cache (under /tmp/torchinductor_$USER) brings later ones of decode attention to a few seconds. It serves tiny prompts
    through `engine`, which is then spent: time a fresh one. Then the heap is frozen (harness.tuning.freeze_heap)."""
    runs = []
    if isinstance(engine, PagedEngine) and engine.compile != "off":
        if engine.compile == "step":  # a step of a two-token prompt, then one of its decode: the small steps' graph
            runs.append(("small steps, the whole forward", [Request([0, 0], 2)]))
        # one-token prompts (they fit any token budget) decoding together into their second blocks, as decode
        # attention compiles from 2 rows of 2 blocks
        rows = max(2, engine.compile_from)
        two_blocks = engine.block_size + 2 <= engine.window  # else no step ever reads two blocks
        room = engine.allocator.num_blocks >= 2 * rows + engine.watermark  # else the rows never decode together
        kernel = engine.compile == "kernel"  # the C kernel's decode attention is built with the engine
        if min(engine.max_batch, num_sequences) >= rows and two_blocks and room and not kernel:
            runs.append(("decode attention", [Request([0], engine.block_size + 1) for _ in range(rows)]))
        if isinstance(engine, Logprobs) and engine.device.type == "cpu":  # their scores compile at first use
            runs.append(("log-probabilities", [Request([0, 0], 2, SamplingParams(logprobs=1))]))
    for name, requests in runs:
        what = f"compiling {name} (torch.compile, {engine.device.type}, {engine.kv_pool[0].dtype})"
        with counting_seconds(what):
            engine.run(requests)
    freeze_heap()  # what start-up made, the compilers' graphs too, is never walked by the collector again


@contextlib.contextmanager
def counting_seconds(what):
    """On a terminal, the seconds so far on one line; then the total."""
    start, done = time.time(), threading.Event()

    def tick():
        while not done.wait(1.0):
            print(f"\r{what}: {time.time() - start:.0f} s", end="", flush=True)

    if not sys.stdout.isatty():
        print(f"{what} ...", flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    if sys.stdout.isatty():
        ticker.start()
    yield
    done.set()
    print(f"\r{what}: done in {time.time() - start:.1f} s", flush=True)


def make_requests(args, prompts, news):
    return [
        Request(
            p,
            n,
            SamplingParams(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                min_p=args.min_p,
                logprobs=args.logprobs,
                seed=args.seed + i * args.num_samples,
                n=args.num_samples,
                num_beams=args.num_beams,
                length_penalty=args.length_penalty,
                eos=args.eos,
            ),
        )
        for i, (p, n) in enumerate(zip(prompts, news))
    ]


def arrive(engine, meter, requests, times):
    """Add each request to the engine at its arrival (seconds on the meter's clock), which the meter notes, and
    step it until all are done; an idle engine sleeps until the next arrival. Yields after every step."""
    clock = meter.clock
    pending = sorted(zip(times, range(len(requests))))[::-1]  # the next arrival last
    while pending or engine.waiting or engine.running:
        while pending and pending[-1][0] <= clock.now():
            at, i = pending.pop()
            meter.arrival[requests[i]] = at  # it arrived then, perhaps while a step ran
            engine.add(requests[i])
        if engine.waiting or engine.running:
            engine.step()
            yield
        else:
            clock.sleep(max(0.0, pending[-1][0] - clock.now()))


def serve(engine, requests, args, rate):
    """Run one engine over the requests, arriving at `rate` -> its metrics and the Meter that heard it."""
    meter = Meter(engine)
    start = meter.clock.now()
    for _ in arrive(engine, meter, requests, [start + t for t in arrivals(len(requests), rate, args.seed)]):
        pass
    wall_s = meter.clock.now() - start  # every step ends in a host transfer
    return metrics(meter, wall_s, rate, args.kv_budget), meter


# The vLLM paper's two length mixes (its Fig. 11 gives their means), scaled by 1/4 so that ShareGPT's longest fit
# the shipped model's 256-token context: prompt and output lengths uniform in MIN:MAX, each mean a quarter of the
# paper's (whose distributions are long-tailed, not uniform)
LENGTH_MIXES = {
    "ShareGPT": ((8, 72), (16, 153)),  # means 40 and 84.5; the paper's 161.31 and 337.99
    "Alpaca": ((2, 8), (4, 25)),  # means 5 and 14.5; the paper's 19.31 and 58.45
}
# the microbenchmark's batch (the paper's Fig. 19a): this many sequences of this many prompt tokens, 2,048 in all
MICRO_SEQUENCES, MICRO_TOKENS = 16, 128


def run_args(args, block_size, mix="ShareGPT", **changes):
    """The flags of one run of a sweep: a length mix, at one block size."""
    prompt_len, new_tokens = LENGTH_MIXES[mix]
    changes = dict(prompt_len=prompt_len, new_tokens=new_tokens, block_size=block_size, **changes)
    return SimpleNamespace(**{**vars(args), **changes})


def serve_once(model, enc, run, kind):
    """Serve run's seeded workload with the paged engine, after an untimed warm-up of the same settings (first calls
    at new shapes pay one-time costs) -> its metrics, KV memory in MB too."""
    prompts, news = workload(enc, run)
    make_engine(model, kind, run, prompts, news, enc.n_vocab).run([Request(p[:16], 2) for p in prompts[:2]])
    engine = make_engine(model, kind, run, prompts, news, enc.n_vocab)
    m, _ = serve(engine, make_requests(run, prompts, news), run, run.request_rate)  # and the Meter
    slot_mb = engine.kv_pool[:, :, 0, 0].nbytes / 2**20  # one token's K and V in every layer
    m.update(
        kv_allocated_peak_mb=m["kv_slots_allocated_peak"] * slot_mb, kv_used_peak_mb=m["kv_slots_used_peak"] * slot_mb
    )
    return m


def sweep_block_sizes(model, enc, args, kind):
    """The paper's Sec. 7.2: both length mixes at every block size, at one request rate -> {mix: {block size:
    metrics}}, each run's line printed as it ends."""
    results = {}
    for mix in LENGTH_MIXES:
        results[mix] = {}
        for block_size in args.sweep_block_sizes:
            m = results[mix][block_size] = serve_once(model, enc, run_args(args, block_size, mix), kind)
            print(f"{mix} block size {block_size}: {m['normalized_latency_ms']:.2f} ms per output token", flush=True)
    return results


def time_preemption(model, enc, args, block_size, repeats=3):
    """The paper's Fig. 19a: MICRO_SEQUENCES sequences of MICRO_TOKENS prompt tokens are prefilled, preempted
    together and readmitted, their K/V swapped out and back in, or recomputed (no prefix cache, which would find
    them) -> the median of `repeats` of each time, in ms, for the whole batch."""
    run = SimpleNamespace(**{**vars(args), "prompt_len": (MICRO_TOKENS, MICRO_TOKENS), "num_requests": MICRO_SEQUENCES})
    prompts, _ = workload(enc, run)
    num_blocks = blocks_for(MICRO_TOKENS + 2, block_size) * MICRO_SEQUENCES
    times = dict(swap_out_ms=[], swap_in_ms=[], recompute_ms=[])
    for _ in range(repeats):
        for swap_blocks in (num_blocks, 0):
            engine = engine_class(swap=True)(
                model,
                num_blocks=num_blocks,
                block_size=block_size,
                token_budget=MICRO_SEQUENCES * (MICRO_TOKENS + 1),  # readmission is one step
                max_batch=MICRO_SEQUENCES,
                prefix_cache=False,
                compile="off",
                swap_blocks=swap_blocks,
            )
            meter = Meter(engine)
            for p in prompts:
                engine.add(Request(p, 3))
            engine.step()  # every prompt prefilled, and its first token drawn
            for s in engine.running[::-1]:  # newest first, so that the oldest heads the queue
                engine.preempt(s)
            engine.step()  # every sequence readmitted: swapped in, or recomputed
            if swap_blocks:
                times["swap_out_ms"].append(meter.swap_out_s * 1000)
                times["swap_in_ms"].append(meter.swap_in_s * 1000)
            else:
                times["recompute_ms"].append(meter.recompute_s * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def sweep_preemption(model, enc, args, kind):
    """The paper's Sec. 7.3 at every block size: the microbenchmark, and the ShareGPT mix under args.kv_budget
    with each preemption mode, the swap space as large as the pool -> one point per block size, each printed."""
    points = []
    for block_size in args.sweep_preemption:
        point = dict(block_size=block_size, **time_preemption(model, enc, args, block_size))
        for swap_blocks, mode in [(0, "recompute"), (args.kv_budget // block_size, "swap")]:
            point[mode] = serve_once(model, enc, run_args(args, block_size, swap_blocks=swap_blocks), kind)
        points.append(point)
        latency = ", ".join(f"{mode} {point[mode]['normalized_latency_ms']:.2f}" for mode in ("recompute", "swap"))
        swap = point["swap_out_ms"] + point["swap_in_ms"]
        print(
            f"block size {block_size}: swap out + in {swap:.2f} ms, recompute {point['recompute_ms']:.2f} ms; "
            f"ms per output token: {latency}",
            flush=True,
        )
    return points
