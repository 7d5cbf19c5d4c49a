"""The engine on a CUDA GPU in one command, each section's tables written to --out DIR (DIR/SECTION.md) line by
line as they are measured, so that a run cut short keeps what it measured. The sections, in the order they run:
    tests       the suite's CUDA tests, python -m pytest -q tests -k cuda (-n 4 where pytest-xdist is installed)
    hf_equal    float32 greedy: ours with graphs (its defaults, and flex in every bucket) against HF's
                GPT2LMHeadModel (dynamic cache), token for token
    e2e         end to end, 256 requests: ours with graphs, HF's static cache (compiled: CUDA graphs) and its
                dynamic cache, alternated; then where one more run of ours spends its time, by kind of step
    best        ours and HF's static cache on HF's best case: every prompt 128 tokens, 256 new each
    large       ours and HF's static cache on e2e's workload at GPT-2 large's shape (36 x 1280)
    candidates  end to end, e2e's workload: ours (its switches' defaults: async steps, flex from 64 rows) against
                its candidate pad_chunks=True (a step's prompt chunks in one padded call a layer), and flex in
                every bucket, alternated
    attention   decode attention, one layer: gather_attend, a split by block, flex_attention through a block mask,
                gather + SDPA, against SDPA over a contiguous cache
    profile     the best case's kernels, ours and HF's static cache, under torch.profiler (not in the default run)
    step        one decode step, eager against its captured graph (not in the default run)
    host        the host side of a step, bench/host_step.py (not in the default run)
GPT-2 small's shape (12 x 768, vocabulary 50,257), random weights, bf16, greedy. Ours is the engine
`generate.py` builds on CUDA (--compile auto is graph there), ext.engine_class(compile="graph").

    python3 bench/gpu.py --out DIR [--sections tests,hf_equal,e2e,best,large,candidates,attention] [--budget-s 500]
    python bench/gpu.py --dry-run [--out DIR]   # every section on the CPU at a tiny shape, in about a minute

With more than one section, each runs in a process of its own: a CUDA fault (an illegal memory access once
followed HF's compile in one process) ends only its section, and no section runs after HF's compile in its
process but e2e's own. --budget-s bounds the whole run: a section may take what is left less --reserve-s for
each section after it, and is stopped there (its file keeps what it measured); the last lines printed name the
sections to run again. docs/gpu.md has the command a GPU lease runs.

--dry-run runs the same code on the CPU at a tiny shape (2 layers x 32, a handful of requests and steps) with
what only CUDA has left out: no graphs captured (padded steps run eagerly), the wall clock for CUDA events,
flex_attention eager (ext/flex_decode.py's flex_attend), HF's static cache uncompiled (transformers compiles it
on CUDA only), and the pool sized to the workload instead of free GPU memory (harness/serving.py's cuda_defaults).
"""

import argparse
import functools
import importlib.util
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from engine import PlanEntry, Sampler
from ext import engine_class
from ext.cuda import GraphBatch
from ext.flex_decode import flex_attend, flex_block_mask
from harness.checkpoints import to_transformers
from harness.serving import cuda_defaults
from model import GPT, GPTConfig, attend, visible_keys
from paged import BlockAllocator, blocks_for, compiled_gather_attend, gather_kv
from sequence import Request

# the run's shape: GPT-2 small's on a GPU, a tiny one for --dry-run
GPU = dict(
    config=dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, gelu="tanh"),
    requests=256,  # end to end: prompts of 16-512 random ids, 16-256 new tokens each
    prompt=(16, 512),
    new=(16, 256),
    best=dict(prompt=(128, 128), new=(256, 256)),  # HF's best case: every prompt 128 tokens, 256 new each
    large=dict(n_layer=36, n_head=20, n_embd=1280),  # GPT-2 large's shape, random weights
    repeats=3,
    equal=(16, 64),  # hf_equal: 16 prompts, at most 64 new tokens each
    attention=[(B, L) for B in (1, 16, 64, 256) for L in (1024, 4096)],
    heads=(12, 64),
    steps=[(1, 256), (16, 256), (64, 256), (256, 256), (64, 1000), (256, 1000)],
    host_requests=256,
    copy=2**30,  # elements of the copy that measures bandwidth: 2 GB in bf16
)
DRY = dict(
    config=dict(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=32, gelu="tanh"),
    requests=6,
    prompt=(4, 24),
    new=(2, 8),
    best=dict(prompt=(8, 8), new=(6, 6)),
    large=dict(n_layer=3, n_head=2, n_embd=48),
    repeats=2,
    equal=(3, 8),
    attention=[(1, 32), (3, 64)],
    heads=(2, 8),
    steps=[(1, 16), (3, 40)],
    host_requests=4,
    copy=2**16,
)
SHAPE = GPU
DEVICE = torch.device("cuda")
OURS_FIRST = False  # e2e: all of ours' runs before HF's compile (--ours-first)
FILE = None  # the running section's file: say() rewrites it with every line
LINES = []


def say(line=""):
    print(line, flush=True)
    LINES.append(line)
    if FILE:
        with open(FILE, "w") as f:
            f.write("\n".join(LINES) + "\n")


def on_cuda():
    return DEVICE.type == "cuda"


def sync():
    if on_cuda():
        torch.cuda.synchronize()


def free_cached_memory():
    if on_cuda():
        torch.cuda.empty_cache()


def gpt_model(dtype, **shape):
    """The run's model, random weights; shape: config fields that differ (SHAPE["large"])."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SHAPE["config"], **shape})).to(DEVICE, dtype).eval()


def ours(model, sizes, **switches):
    """The engine `generate.py` builds on CUDA (--compile auto is graph there; blocks of 16), with switches."""
    return engine_class(compile="graph")(model, block_size=16, compile="graph", **sizes, **switches)


def time_ms(fn, iters=20):
    """Mean milliseconds of fn() over iters calls, after 3 untimed: between CUDA events on CUDA, else by the wall
    clock."""
    for _ in range(3):
        fn()
    if not on_cuda():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth():
    """TB/s of a device-to-device copy, bytes read and written: the ceiling a memory-bound step meets."""
    a = torch.empty(SHAPE["copy"], dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / time_ms(lambda: b.copy_(a)) / 1e9


def gather_attend_split(q, k_pool, v_pool, block_table, kv_len):
    """A candidate, not in the engine: gather_attend with each block's softmax apart, then combined (flash
    decoding's split of the keys), so that each (row, block, head) reduces its own keys and values."""
    D = q.shape[-1]
    W, block_size = block_table.shape[1], k_pool.shape[1]
    keys = k_pool[block_table].float()  # (B, W, block_size, H, D)
    scores = (q[:, None, None].float() * keys).sum(-1) * D**-0.5  # (B, W, block_size, H)
    position = torch.arange(W * block_size, device=q.device).view(W, block_size)
    scores = scores.masked_fill((position >= kv_len[:, None, None])[..., None], float("-inf"))
    block_max = scores.amax(2).clamp(min=-1e30)  # (B, W, H): a block past the keys has no finite score
    p = (scores - block_max[:, :, None]).exp()  # (B, W, block_size, H)
    block_out = (p[..., None] * v_pool[block_table].float()).sum(2)  # (B, W, H, D)
    weight = (block_max - block_max.amax(1, keepdim=True)).exp()  # (B, W, H)
    out = (weight[..., None] * block_out).sum(1) / (weight * p.sum(2)).sum(1)[..., None]
    return out.to(q.dtype)


@functools.cache
def compiled_split():
    return torch.compile(gather_attend_split)


def attention_row(B, L, block_size=16):
    """One layer's decode attention at batch B and context L, five ways -> a cell for each, "ms, TB/s", each
    way's output checked against SDPA's; then the flex candidate's block mask, built once a step, in ms."""
    H, D = SHAPE["heads"]
    W = L // block_size
    k_pool = torch.randn(B * W + 1, block_size, H, D, device=DEVICE, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(B * W, device=DEVICE).view(B, W)
    kv_len = torch.full((B,), L, device=DEVICE)
    q = torch.randn(B, H, D, device=DEVICE, dtype=torch.bfloat16)
    for t in (q, table, kv_len, k_pool, v_pool):  # as the engine marks them
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(table, 1)
    k, v = (gather_kv(pool, table).transpose(1, 2).contiguous() for pool in (k_pool, v_pool))  # (B, H, L, D)
    mask = flex_block_mask(table, kv_len, len(k_pool), block_size)
    flex_inputs = [t.detach() for t in (q, k_pool, v_pool)]  # new tensor objects: static, not marked dynamic

    def eager():  # the engine's eager path: whole blocks gathered (copies), then SDPA
        keys, values = gather_kv(k_pool, table), gather_kv(v_pool, table)  # (B, L, H, D)
        return attend(q[:, None], keys, values, visible_keys(keys, kv_len[:, None] - 1))[:, 0]

    ways = (
        lambda: compiled_gather_attend()(q, k_pool, v_pool, table, kv_len),
        lambda: compiled_split()(q, k_pool, v_pool, table, kv_len),
        lambda: flex_attend(DEVICE)(*flex_inputs, mask),  # compiled on CUDA, as decode_attention="flex" runs it
        eager,
        lambda: F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0],
    )
    want = ways[-1]().float()
    cells = []
    for way in ways:
        try:
            error = (way().float() - want).abs().max().item()
        except Exception as e:  # noqa: BLE001 -- a candidate that does not compile leaves the others' figures
            cells.append(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
            continue
        if not error < 0.05:  # a wrong way is not timed, and the others still are
            cells.append(f"wrong: max error {error:.3g}")
            continue
        ms = time_ms(way)
        cells.append(f"{ms:.3f}, {2 * B * L * H * D * 2 / ms / 1e9:.2f}")
    mask_ms = time_ms(lambda: flex_block_mask(table, kv_len, len(k_pool), block_size))
    return cells + [f"{mask_ms:.3f}"]


def attention_table():
    """Decode attention, one layer (bf16, blocks of 16 in random order): the engine's compiled gather_attend, a
    split-by-block candidate, decode_attention="flex" reading the pool in place, and eager gather + SDPA, against
    SDPA over a contiguous cache; K+V bytes / time."""
    ways = "gather_attend (compiled) | split by block (compiled) | flex paged (compiled) | gather + SDPA (eager)"
    say(f"| B | L | {ways} | SDPA contiguous: ms, TB/s each | flex mask ms |")
    say("|---|---|---|---|---|---|---|---|")
    for B, L in SHAPE["attention"]:
        say(f"| {B} | {L} | {' | '.join(attention_row(B, L))} |")
        free_cached_memory()


def decode_batch(engine, B, L, rng):
    """B sequences at context L on shuffled blocks of the engine's pool -> a decode-only step's batch."""
    W = blocks_for(L + 1, engine.block_size)
    blocks = rng.sample(range(engine.allocator.num_blocks), B * W)
    plan, samplers = [], []
    for i in range(B):
        s = Request([rng.randrange(SHAPE["config"]["vocab_size"]) for _ in range(L + 1)], 2).sequences[0]
        s.row, s.num_computed, s.block_table = i, L, blocks[i * W : (i + 1) * W]
        engine.block_tables[i, :W] = torch.tensor(s.block_table)
        plan.append(PlanEntry(s, 1))
        samplers.append(Sampler(s, i))
    return engine.make_batch(plan, samplers)


@torch.no_grad()
def step_row(engine, batch, B, L, weights, bandwidth):
    def eager():
        return engine.model(batch.idx, batch=batch)[0][:B].argmax(-1)

    def graph():
        return engine.forward(batch)[:B].argmax(-1)

    same = torch.equal(eager(), graph())
    eager_ms, graph_ms = time_ms(eager), time_ms(graph)
    c = SHAPE["config"]
    moved = weights + 2 * c["n_layer"] * B * (L + 1) * c["n_embd"] * 2
    bound_ms = moved / bandwidth / 1e9
    return (
        f"| {B} | {L} | {batch.padded_shape} | {eager_ms:.2f} | {graph_ms:.2f} | {eager_ms / graph_ms:.1f}x | "
        f"{moved / 1e9:.2f} | {moved / graph_ms / 1e9:.2f} | {graph_ms / bound_ms:.1f}x | {same} |"
    )


def step_table():
    """One decode step (forward + argmax), bf16, eager against its captured graph."""
    bandwidth = copy_bandwidth()
    say(f"device-to-device copy: {bandwidth:.2f} TB/s (read + write)")
    model = gpt_model(torch.bfloat16)
    rows = SHAPE["steps"]
    num_blocks = max(B * blocks_for(L + 1, 16) for B, L in rows) + 8
    start = time.perf_counter()
    engine = ours(model, dict(num_blocks=num_blocks, max_batch=max(B for B, _ in rows), token_budget=4096))
    say(f"captured {len(engine.graphs)} graphs (batches {engine.graph_batches}) in {time.perf_counter() - start:.1f} s")
    weights = sum(p.numel() for p in model.parameters()) * 2
    header = "| B | L | shape | eager ms | graph ms | speedup | GB moved | graph TB/s | graph / memory bound "
    say(header + "| same tokens |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    for B, L in rows:
        say(step_row(engine, decode_batch(engine, B, L, rng), B, L, weights, bandwidth))


def workload(seed, n=None, prompt=None, new=None):
    """n requests (the shape's count): prompts of random ids and new-token counts, seeded; prompt and new: the
    ranges of their lengths (the shape's)."""
    rng = random.Random(seed)
    vocab = SHAPE["config"]["vocab_size"]
    n = n or SHAPE["requests"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*(prompt or SHAPE["prompt"])))] for _ in range(n)]
    return prompts, [rng.randint(*(new or SHAPE["new"])) for _ in range(n)]


def engine_sizes(model, prompts, news):
    """On CUDA, its defaults (256 sequences, 4,096 tokens a step, a pool in free memory as large as the workload
    needs); on a CPU (--dry-run), a few batch buckets and prompts in chunks."""
    needed = sum(blocks_for(len(p) + n, 16) for p, n in zip(prompts, news))
    if on_cuda():
        return cuda_defaults(model, 16, needed)
    return dict(max_batch=4, token_budget=32, num_blocks=needed)


def hf_model(model, dtype):
    import transformers

    say(f"transformers {transformers.__version__}")
    return to_transformers(model).to(DEVICE, dtype).eval()


@torch.no_grad()
def run_hf(hf, prompts, news, **kw):
    """One left-padded batch run to the longest request -> (seconds, each output cut to its own count)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
    sync()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news), pad_token_id=0,
                      do_sample=False, **kw)  # fmt: skip
    sync()
    return time.perf_counter() - start, [out[i, width : width + m].tolist() for i, m in enumerate(news)]


def run_ours(engine, prompts, news):
    """The requests on an idle engine whose prefix cache is emptied first: a run of the same prompts must not
    find the last run's blocks -> (seconds, the outputs)."""
    engine.allocator = BlockAllocator(engine.allocator.num_blocks, engine.block_size)  # nothing holds a block
    requests = [Request(p, m) for p, m in zip(prompts, news)]
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start, [r.generated for r in requests]


def time_steps(engine):
    """Time each step of the engine's runs from now on, in phases -> the list of (kind, phases) it fills, one a
    step: kind "graph" where the step replayed a captured graph, else "eager"; phases in ms: before the forward
    (plan, batch, staging), the forward's launch, sampling (with the wait for the device: the tokens come back to
    the host), and the rest (bookkeeping), summing to the step's wall time."""
    steps, marks = [], {}
    step, forward, sample = engine.step, engine.forward, engine.sample

    def timed_forward(batch):
        marks["kind"] = "graph" if isinstance(batch, GraphBatch) and len(batch.idx) in engine.graphs else "eager"
        marks["forward"] = time.perf_counter()
        logits = forward(batch)
        marks["launched"] = time.perf_counter()
        return logits

    def timed_sample(*args):
        marks["sample"] = time.perf_counter()
        tokens = sample(*args)
        if tokens.is_cuda:  # the wait for the device; the tokens stay there (async steps read them there)
            torch.cuda.synchronize()
        marks["sampled"] = time.perf_counter()
        return tokens

    def timed_step():
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        m = marks
        phases = m["forward"] - start, m["launched"] - m["forward"], m["sampled"] - m["sample"]
        steps.append((m["kind"], [1e3 * t for t in (*phases, end - start - sum(phases))]))

    engine.forward, engine.sample, engine.step = timed_forward, timed_sample, timed_step
    return steps


def breakdown_table(steps):
    """Where a run's time went, by kind of step (time_steps)."""
    total = sum(sum(phases) for _, phases in steps)
    say("| steps | count | ms | share | ms a step | before the forward | forward launch | sampling + wait | rest |")
    say("|---|---|---|---|---|---|---|---|---|")
    for kind in ("eager", "graph"):
        rows = [phases for k, phases in steps if k == kind]
        if rows:
            ms = sum(map(sum, rows))
            each = " | ".join(f"{sum(column) / len(rows):.2f}" for column in zip(*rows))
            say(f"| {kind} | {len(rows)} | {ms:,.0f} | {ms / total:.0%} | {ms / len(rows):.2f} | {each} |")


def alternate(systems, useful):
    """{name: a run -> (seconds, outputs)}: each in turn, the shape's repeats times, each run's tok/s said as it
    ends -> {name: [(seconds, outputs) of each run]}. A system whose run fails drops out, its traceback said."""
    runs = {name: [] for name in systems}
    for i in range(SHAPE["repeats"]):  # alternated, so that a drift in the machine's speed touches each alike
        for name, run in systems.items():
            if name not in runs:
                continue
            try:
                seconds, outputs = run()
            except Exception:  # noqa: BLE001 -- the others' rows stay
                del runs[name]
                say(f"{name}, run {i + 1} failed:\n```\n{traceback.format_exc()}```")
                continue
            runs[name].append((seconds, outputs))
            say(f"{name}, run {i + 1}: {useful / seconds:,.0f} tok/s")
    return runs


def same_tokens(runs, bf16=True):
    """Each system's first outputs against ours' first, request by request."""
    if "ours" not in runs:
        return
    mine = runs["ours"][0][1]
    for name, name_runs in runs.items():
        same = sum(a == b for a, b in zip(name_runs[0][1], mine))
        say(f"{name}: the same tokens as ours in {same} of {len(mine)} requests{' (bf16)' if bf16 else ''}")


def rows_table(runs, useful):
    """{name: [(seconds, outputs) of each run]} -> a table of useful tok/s, and ours' time against each, run by run."""
    say(f"\n| system | tok/s (median of {SHAPE['repeats']}, min-max) | ours / this |")
    say("|---|---|---|")
    mine = [seconds for seconds, _ in runs.get("ours", [])]
    for name, name_runs in runs.items():
        seconds = [s for s, _ in name_runs]
        tok_s = sorted(useful / s for s in seconds)
        ratios = sorted(b / a for a, b in zip(mine, seconds))
        ratio = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else "-"
        say(f"| {name} | {statistics.median(tok_s):,.0f} ({tok_s[0]:,.0f}-{tok_s[-1]:,.0f}) | {ratio} |")


def e2e_table(model_shape=None, lengths=None, dynamic=True):
    """Ours with graphs, HF's static cache (compiled on CUDA) and its dynamic cache, alternated, bf16, greedy, warm;
    useful tokens/s. Then where one more run of ours spends its time. model_shape: config fields that differ;
    lengths: dict(prompt=, new=) ranges (the shape's)."""
    model = gpt_model(torch.bfloat16, **(model_shape or {}))
    prompts, news = workload(1, **(lengths or {}))
    warm_prompts, warm_news = workload(2, **(lengths or {}))
    useful = sum(news)
    sizes = engine_sizes(model, prompts, news)
    start = time.perf_counter()
    engine = ours(model, sizes)
    say(f"ours: {sizes}, {len(engine.graphs)} graphs captured in {time.perf_counter() - start:.1f} s")
    say(f"ours' switches: async_steps {engine.async_steps}, flex decode attention from {engine.flex_from} rows")
    run_ours(engine, warm_prompts, warm_news)
    systems = {"ours": functools.partial(run_ours, engine, prompts, news)}
    runs = alternate(systems, useful) if OURS_FIRST else {}
    hf = hf_model(model, torch.bfloat16)
    start = time.perf_counter()
    run_hf(hf, prompts, news, cache_implementation="static")  # the timed shapes: nothing compiles while timed
    say(f"HF static cache: warm-up (compiles on CUDA) {time.perf_counter() - start:.1f} s")
    systems = {} if OURS_FIRST else systems
    systems["HF static"] = functools.partial(run_hf, hf, prompts, news, cache_implementation="static")
    if dynamic:
        run_hf(hf, prompts, news)
        systems["HF dynamic"] = functools.partial(run_hf, hf, prompts, news)
    # NOTE: alternated, ours' first timed run follows HF's compile (torch.compile, reduce-overhead), the order in
    # which ours once failed with an illegal memory access (H200, 2026-11-26); --ours-first runs ours first
    runs.update(alternate(systems, useful))
    same_tokens(runs)
    rows_table(runs, useful)
    if "ours" in runs and dynamic:
        steps = time_steps(engine)
        run_ours(engine, prompts, news)
        say("\nWhere one more run of ours spent its time (each step timed in phases on the host; the timing waits for")
        say("each step's tokens, so that async steps run in order here):\n")
        breakdown_table(steps)


def best_case_table():
    """e2e's systems on HF's best case: every prompt as long, every request as many new tokens."""
    e2e_table(lengths=SHAPE["best"], dynamic=False)


def large_table():
    """e2e's workload and systems at GPT-2 large's shape."""
    e2e_table(model_shape=SHAPE["large"], dynamic=False)


def profile_table():
    """One run of ours and one of HF's static cache on the best case, each under torch.profiler after a warm run:
    their kernels (ops on a CPU) by self time, and the run's wall time against the device's busy time."""
    from torch.profiler import ProfilerActivity, profile

    model = gpt_model(torch.bfloat16)
    prompts, news = workload(1, **SHAPE["best"])
    engine = ours(model, engine_sizes(model, prompts, news))
    hf = hf_model(model, torch.bfloat16)
    systems = {
        "ours": functools.partial(run_ours, engine, prompts, news),
        "HF static": functools.partial(run_hf, hf, prompts, news, cache_implementation="static"),
    }
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_cuda()
    key = "self_device_time_total" if on_cuda() else "self_cpu_time_total"
    for name, run in systems.items():
        run()  # warm: compiles and captures outside the profile
        with profile(activities=activities) as prof:
            seconds, _ = run()
        events = prof.key_averages()
        busy_ms = sum(getattr(e, key) for e in events) / 1e3
        say(f"\n### {name}: {sum(news) / seconds:,.0f} tok/s, {seconds * 1e3:,.0f} ms wall, {busy_ms:,.0f} ms {key}\n")
        say("```\n" + events.table(sort_by=key, row_limit=25, max_name_column_width=60) + "\n```")


CANDIDATES = {  # name -> the CUDA extension's switches
    "ours": {},  # the defaults: async steps, flex from FLEX_FROM_ROWS rows
    "ours, prompt chunks padded": dict(pad_chunks=True),  # a candidate, off by default
    "ours, flex in every bucket": dict(decode_attention="flex"),
}


def candidates_table():
    """Ours against its candidates, alternated, on e2e's workload: useful tokens/s. Flex compiles its kernel for
    each batch bucket as the graphs are captured."""
    model = gpt_model(torch.bfloat16)
    prompts, news = workload(1)
    warm_prompts, warm_news = workload(2)
    sizes = engine_sizes(model, prompts, news)
    say(f"engines: {sizes}")
    systems = {}
    for name, switches in CANDIDATES.items():
        try:  # a candidate that fails to compile or capture leaves the other rows
            start = time.perf_counter()
            engine = ours(model, sizes, **switches)
            say(f"{name} {switches}: {len(engine.graphs)} graphs captured in {time.perf_counter() - start:.1f} s")
            run_ours(engine, warm_prompts, warm_news)
            systems[name] = functools.partial(run_ours, engine, prompts, news)
        except Exception:  # noqa: BLE001
            say(f"{name}:\n```\n{traceback.format_exc()}```")
    runs = alternate(systems, sum(news))
    same_tokens(runs)
    rows_table(runs, sum(news))


def hf_equal():
    """float32 greedy: ours (graphs, its defaults) and ours with flex in every bucket give HF's (dynamic cache)
    tokens."""
    model = gpt_model(torch.float32)
    n, most = SHAPE["equal"]
    prompts, news = workload(3, n)
    news = [min(m, most) for m in news]
    theirs = run_hf(hf_model(model, torch.float32), prompts, news)[1]
    lo, hi = SHAPE["prompt"]
    for name, switches in [("ours", {}), ("ours, flex in every bucket", dict(decode_attention="flex"))]:
        engine = ours(model, dict(num_blocks=1024, max_batch=16, token_budget=1024), **switches)
        mine = run_ours(engine, prompts, news)[1]
        equal = sum(a == b for a, b in zip(mine, theirs))
        say(f"{name}: float32 greedy, {n} prompts of {lo}-{hi} tokens, up to {most} new: {equal}/{n} equal to HF's")
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                say(f"request {i}: first differs at new token {first}")


def cuda_tests():
    """The test suite's CUDA tests, their output. Fails the section where pytest fails."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--disable-warnings", "-rfEs"]
    cmd += ["tests", "-k", "cuda"]
    if not importlib.util.find_spec("lm_eval"):  # the GPU image lacks it; the module has no CUDA test
        cmd += ["--ignore", "tests/test_scoring.py"]
    if importlib.util.find_spec("xdist"):  # the GPU image has pytest-xdist: compiles run side by side
        cmd += ["-n", "4"]
    say(f"$ python -m pytest {' '.join(cmd[3:])}\n```")
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).strip().splitlines():
        say(line)
    say("```")
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode}")


def host_table():
    """bench/host_step.py: a step's host side at many sequences, a model too small to cost anything."""
    from bench.host_step import host_step_ms

    n = SHAPE["host_requests"]
    say(f"{n} requests (16-512 prompt tokens, 16-256 new), max_batch 256, a 1-layer 32-wide model\n")
    say("| device | run | ms a step | forward ms | host ms |")
    say("|---|---|---|---|---|")
    for device in ("cpu", "cuda") if on_cuda() else ("cpu",):
        host_step_ms(device, min(32, n))  # warm: first calls pay one-time setup
        for i in range(SHAPE["repeats"]):
            step_ms, forward_ms, host_ms = host_step_ms(device, n)[1:]
            say(f"| {device} | {i + 1} | {step_ms:.2f} | {forward_ms:.2f} | {host_ms:.2f} |")


TITLES = dict(
    tests="The CUDA tests",
    hf_equal="Tokens against HF, float32",
    e2e="End to end: {requests} requests, prompts {prompt[0]}-{prompt[1]}, {new[0]}-{new[1]} new, bf16, greedy",
    best="End to end, HF's best case: {requests} requests, every prompt {best[prompt][0]} tokens, {best[new][0]} new, "
    "bf16",
    large="End to end at GPT-2 large's shape ({large[n_layer]} x {large[n_embd]}, random weights), e2e's workload",
    candidates="End to end, the switches: the defaults against prompt chunks padded, and flex everywhere",
    attention="Decode attention, one layer",
    profile="Where the best case's time goes: ours and HF's static cache under torch.profiler",
    step="One decode step, eager against its CUDA graph",
    host="The host side of a step (bench/host_step.py)",
)
SECTIONS = dict(
    tests=cuda_tests,
    hf_equal=hf_equal,
    e2e=e2e_table,
    best=best_case_table,
    large=large_table,
    candidates=candidates_table,
    attention=attention_table,
    profile=profile_table,
    step=step_table,
    host=host_table,
)
DEFAULT = "tests,hf_equal,e2e,best,large,candidates,attention"


def run_section(name, args):
    """One section in this process, its lines to DIR/NAME.md -> whether it ran to its end."""
    global FILE
    FILE = os.path.join(args.out, f"{name}.md")
    LINES.clear()
    say(f"$ python bench/gpu.py --sections {name}{' --dry-run' if args.dry_run else ''}")
    machine = (
        torch.cuda.get_device_name() if on_cuda() else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    say(f"{machine}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    say(f"\n## {TITLES[name].format(**SHAPE)}{' (dry run: a tiny shape on the CPU)' if args.dry_run else ''}\n")
    start = time.perf_counter()
    try:
        SECTIONS[name]()
        ok = True
    except Exception:  # noqa: BLE001 -- the section's failure, in its file
        say("```\n" + traceback.format_exc() + "```")
        ok = False
    say(f"\n{name}: {'done' if ok else 'failed'} in {time.perf_counter() - start:.0f} s")
    free_cached_memory()
    return ok


def drive(args, sections):
    """Each section in a process of its own, within the budget -> whether every one ran to its end. Prints what
    each did and the command that runs the rest again."""
    start = time.perf_counter()
    outcome = {}
    for i, name in enumerate(sections):
        left = math.inf if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        limit = left - args.reserve_s * (len(sections) - i - 1)  # each later section keeps its reserve
        if limit < 20:  # too little to import, build and measure anything
            outcome[name] = f"skipped: {max(left, 0):.0f} s of the budget left"
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--sections", name, "--out", args.out]
        cmd += ["--dry-run"] * args.dry_run + ["--ours-first"] * args.ours_first
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, process_group=0)  # its own group: a stop ends pytest's process with it
        try:
            code = proc.wait(timeout=None if math.isinf(limit) else limit)
            outcome[name] = "done" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
            outcome[name] = f"stopped at its share of the budget, {limit:.0f} s"
        if code not in (0, 1):  # stopped, or a crash its own lines do not tell (a CUDA fault can abort)
            with open(os.path.join(args.out, f"{name}.md"), "a") as f:
                f.write(f"\n{name}: {outcome[name]}\n")
        outcome[name] += f" ({time.perf_counter() - began:.0f} s)"
    print(f"\n## Summary ({time.perf_counter() - start:.0f} s)\n", flush=True)
    for name, what in outcome.items():
        print(f"{name}: {what}", flush=True)
    again = [name for name, what in outcome.items() if not what.startswith("done")]
    if again:
        print(f"to run again: python3 bench/gpu.py --sections {','.join(again)} --out DIR", flush=True)
    return not again


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/gpu", help="the folder each section's lines go to, as SECTION.md")
    p.add_argument("--sections", help=f"in the order to run (default {DEFAULT}; --dry-run: all {','.join(SECTIONS)})")
    p.add_argument("--budget-s", type=float, help="seconds for the whole run (default: no limit)")
    p.add_argument("--reserve-s", type=float, default=45, help="seconds the budget keeps for each later section")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at a tiny shape")
    p.add_argument("--ours-first", action="store_true", help="e2e: ours' runs before HF's compile, not alternated")
    return p


def main():
    global SHAPE, DEVICE, OURS_FIRST
    p = parser()
    args = p.parse_args()
    sections = (args.sections or (",".join(SECTIONS) if args.dry_run else DEFAULT)).split(",")
    if not set(sections) <= set(SECTIONS):
        p.error(f"--sections: {', '.join(sorted(set(sections) - set(SECTIONS)))}: not one of {', '.join(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("torch sees no CUDA GPU here: --dry-run runs every section on the CPU")
    SHAPE, DEVICE = (DRY, torch.device("cpu")) if args.dry_run else (GPU, torch.device("cuda"))
    OURS_FIRST = args.ours_first
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine does
    if len(sections) > 1:
        return drive(args, sections)
    return run_section(sections[0], args)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
