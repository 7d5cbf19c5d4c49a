"""The engine on a CUDA GPU in one command: decode attention against SDPA on a contiguous cache (with two
candidates: a split by block, and flex_attention reading the pool in place through a block mask made from the
block table), one decode step eager against its captured CUDA graph, the host side of a step, and end to end
against Hugging Face's generate with a static cache (compiled, CUDA graphs) and a dynamic one, with where our
run's time goes by kind of step. GPT-2 small's shape (12 x 768, vocabulary 50,257), random weights, bf16, greedy.

    python bench/gpu.py [--out out/gpu.md] [--sections tests,step,e2e,attention,hf_equal,host,after_hf]
    python bench/gpu.py --sections attention,e2e_flex --out out/gpu_flex.md  # flex: a process of its own

e2e runs ours beside async scheduling, then HF; e2e_flex runs ours beside the two flex candidates, compiling flex
for each batch bucket, and must not follow HF's compile in one process (an illegal memory access once did).

Writes its tables to --out as it goes (a run cut short keeps what it measured). Needs transformers for e2e and
hf_equal. The tests section runs the suite's CUDA tests first: python -m pytest -q tests -k cuda

Ours is ext.ServingEngine with compile="graph", as the candidates subclass it: `generate.py --compile graph`
builds PagedEngine with the CUDA extension alone (ext.engine_class), the same tokens with the other extensions idle.
"""

import argparse
import functools
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.async_step import AsyncPagedEngine
from engine import PlanEntry, Sampler
from ext import ServingEngine
from ext.cuda import GraphBatch
from harness.serving import cuda_defaults
from model import GPT, GPTConfig, attend
from paged import BlockAllocator, blocks_for, compiled_gather_attend, gather_kv
from sequence import Request

CONFIG = dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, gelu="tanh")
OUT = []


def say(line="", out=None):
    print(line, flush=True)
    OUT.append(line)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(OUT) + "\n")


def gpt2_small(dtype):
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG)).to("cuda", dtype).eval()


def time_ms(fn, iters=20):
    """Mean milliseconds of fn() over iters calls, after 3 untimed, between CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth():
    """TB/s of a device-to-device copy of 2 GB, bytes read and written: the ceiling a memory-bound step meets."""
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
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


def flex_block_mask(block_table, kv_len, num_pool_blocks, block_size):
    """A candidate, not in the engine: flex_attention's block mask for decode rows that read the pool in place,
    flattened to slots (num_pool_blocks * block_size keys) -> BlockMask. Row b's key blocks are its own blocks,
    all through mask_mod, which is exact on its own (it finds each slot's place in the row's sequence), as eager
    flex_attention applies it to every key. No block is marked whole: flex's decoding kernel then splits each
    row's own blocks among its programs (with whole blocks it splits the pool's length, KV_LEN, and a row's
    blocks all fall to one), and it needs whole and partial index tables of one shape.
    block_table: (B, W), its entries past a row's blocks stale or padding; kv_len: (B,). Built once a step."""
    B, W = block_table.shape
    logical = torch.arange(W, device=block_table.device)
    num_blocks = -(-kv_len // block_size)  # (B,)
    held = logical < num_blocks[:, None]  # (B, W)
    table = torch.where(held, block_table.long(), num_pool_blocks - 1)  # stale entries: the padding block
    # (B, pool blocks + 1): each block's index in row b, or -1; entries past a row's blocks land in the extra
    # column, so that none overwrites a block the row holds (a padding row holds the padding block)
    place = torch.full((B, num_pool_blocks + 1), -1, device=block_table.device, dtype=torch.long)
    place.scatter_(1, torch.where(held, table, num_pool_blocks), logical.expand(B, W).contiguous())

    def visible(b, h, q_idx, kv_idx):
        j = place[b, kv_idx // block_size]
        return (j >= 0) & (j * block_size + kv_idx % block_size < kv_len[b])

    return BlockMask.from_kv_blocks(
        num_blocks.int().view(B, 1, 1),
        table.int().view(B, 1, 1, W),
        BLOCK_SIZE=(128, block_size),
        mask_mod=visible,
        seq_lengths=(1, num_pool_blocks * block_size),
        compute_q_blocks=False,
    )


def flex_paged_attend(q, k_pool, v_pool, block_mask):
    """The candidate's attention, one layer: q (B, H, D), pools (num_pool_blocks, block_size, H, D) -> (B, H, D)."""
    k, v = (pool.flatten(0, 1).transpose(0, 1)[None] for pool in (k_pool, v_pool))  # (1, H, slots, D): no copy
    return flex_attention(q[:, :, None], k, v, block_mask=block_mask)[:, :, 0]


@functools.cache
def compiled_flex():
    """Static shapes: flex_attention's decoding kernel needs the batch and heads fixed (else its general one)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_paged_attend, dynamic=False)


class FlexBatch(GraphBatch):
    """The flex candidate in a whole step: a padded decode-only step (a graph's) attends through flex_attention,
    its block mask built at the first layer from the graph's fixed inputs, so a captured graph builds it too."""

    def attend_one_token(self, layer, q):
        if layer == 0:
            num_pool_blocks, block_size = self.k_pool.shape[1:3]
            self.block_mask = flex_block_mask(self.one_token_table, self.one_token_len, num_pool_blocks, block_size)
        return compiled_flex()(q, self.k_pool[layer], self.v_pool[layer], self.block_mask)


class FlexEngine(ServingEngine):
    """The engine with FlexBatch in its padded (graph) steps; every other step attends as the engine's own."""

    graph_batch_class = FlexBatch


class AsyncFlexEngine(AsyncPagedEngine):
    graph_batch_class = FlexBatch


def attention_row(B, L, H=12, D=64, block_size=16):
    """One layer's decode attention at batch B and context L, five ways -> a cell for each, "ms, TB/s", each
    way's output checked against SDPA's; then the flex candidate's block mask, built once a step, in ms."""
    W = L // block_size
    k_pool = torch.randn(B * W + 1, block_size, H, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(B * W, device="cuda").view(B, W)
    kv_len = torch.full((B,), L, device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    for t in (q, table, kv_len, k_pool, v_pool):  # as the engine marks them
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(table, 1)
    k, v = (gather_kv(pool, table).transpose(1, 2).contiguous() for pool in (k_pool, v_pool))  # (B, H, L, D)
    mask = flex_block_mask(table, kv_len, len(k_pool), block_size)
    flex_inputs = [t.detach() for t in (q, k_pool, v_pool)]  # new tensor objects: static, not marked dynamic
    ways = (
        lambda: compiled_gather_attend()(q, k_pool, v_pool, table, kv_len),
        lambda: compiled_split()(q, k_pool, v_pool, table, kv_len),
        lambda: compiled_flex()(*flex_inputs, mask),
        lambda: attend(q[:, None], gather_kv(k_pool, table), gather_kv(v_pool, table), kv_len[:, None] - 1)[:, 0],
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


def attention_table(out):
    """Decode attention, one layer (12 heads x 64, bf16, blocks of 16 in random order): the engine's compiled
    gather_attend, a split-by-block candidate, a flex_attention candidate reading the pool in place, and eager
    gather + SDPA, against SDPA over a contiguous cache; K+V bytes / time."""
    ways = "gather_attend (compiled) | split by block (compiled) | flex paged (compiled) | gather + SDPA (eager)"
    say(f"| B | L | {ways} | SDPA contiguous: ms, TB/s each | flex mask ms |", out)
    say("|---|---|---|---|---|---|---|---|", out)
    for B in (1, 16, 64, 256):
        for L in (1024, 4096):
            say(f"| {B} | {L} | {' | '.join(attention_row(B, L))} |", out)
            torch.cuda.empty_cache()


def decode_batch(engine, B, L, rng):
    """B sequences at context L on shuffled blocks of the engine's pool -> a decode-only step's batch."""
    W = blocks_for(L + 1, engine.block_size)
    blocks = rng.sample(range(engine.allocator.num_blocks), B * W)
    plan, samplers = [], []
    for i in range(B):
        s = Request([rng.randrange(50257) for _ in range(L + 1)], 2).sequences[0]
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
    moved = weights + 2 * CONFIG["n_layer"] * B * (L + 1) * CONFIG["n_embd"] * 2
    bound_ms = moved / bandwidth / 1e9
    return (
        f"| {B} | {L} | {batch.padded_shape} | {eager_ms:.2f} | {graph_ms:.2f} | {eager_ms / graph_ms:.1f}x | "
        f"{moved / 1e9:.2f} | {moved / graph_ms / 1e9:.2f} | {graph_ms / bound_ms:.1f}x | {same} |"
    )


def step_table(out, bandwidth):
    """One decode step (forward + argmax) at GPT-2 small's shape, eager against its captured graph."""
    model = gpt2_small(torch.bfloat16)
    start = time.perf_counter()
    engine = ServingEngine(model, num_blocks=256 * 63 + 8, max_batch=256, token_budget=4096, compile="graph")
    say(
        f"captured {len(engine.graphs)} graphs (batches {engine.graph_batches}) in {time.perf_counter() - start:.1f} s",
        out,
    )
    weights = sum(p.numel() for p in model.parameters()) * 2
    say(
        "| B | L | shape | eager ms | graph ms | speedup | GB moved | graph TB/s | graph / memory bound "
        "| same tokens |",
        out,
    )
    say("|---|---|---|---|---|---|---|---|---|---|", out)
    rng = random.Random(0)
    for B, L in ((1, 256), (16, 256), (64, 256), (256, 256), (64, 1000), (256, 1000)):
        say(step_row(engine, decode_batch(engine, B, L, rng), B, L, weights, bandwidth), out)
    del engine
    torch.cuda.empty_cache()


def workload(seed, n=256):
    rng = random.Random(seed)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    return prompts, [rng.randint(16, 256) for _ in range(n)]


def hf_model(model, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    c = CONFIG
    config = GPT2Config(vocab_size=c["vocab_size"], n_positions=c["block_size"], n_embd=c["n_embd"],
                        n_layer=c["n_layer"], n_head=c["n_head"], activation_function="gelu_new",
                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    hf = GPT2LMHeadModel(config)
    state = {k: v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v
             for k, v in model.state_dict().items()}  # fmt: skip
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None  # like ours, generate exactly the asked-for count
    return hf.to("cuda", dtype).eval()


@torch.no_grad()
def run_hf(hf, prompts, news, **kw):
    """One left-padded batch run to the longest request -> (seconds, each output cut to its own count)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news), pad_token_id=0,
                      do_sample=False, **kw)  # fmt: skip
    torch.cuda.synchronize()
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
        tokens = sample(*args).cpu()  # the wait for the device: the step then reads them on the host
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


def breakdown_table(steps, out):
    """Where a run's time went, by kind of step (time_steps)."""
    total = sum(sum(phases) for _, phases in steps)
    say(
        "| steps | count | ms | share | ms a step | before the forward | forward launch | sampling + wait | rest |", out
    )
    say("|---|---|---|---|---|---|---|---|---|", out)
    for kind in ("eager", "graph"):
        rows = [phases for k, phases in steps if k == kind]
        if rows:
            ms = sum(map(sum, rows))
            each = " | ".join(f"{sum(column) / len(rows):.2f}" for column in zip(*rows))
            say(f"| {kind} | {len(rows)} | {ms:,.0f} | {ms / total:.0%} | {ms / len(rows):.2f} | {each} |", out)


# candidates beside ours end to end: name -> engine class. The flex ones compile
# flex for each of the 20 batch buckets, so they run in a section of their own (e2e_flex)
ASYNC = {"ours, async scheduling": AsyncPagedEngine}
FLEX = {"ours, flex decode attention": FlexEngine, "ours, async scheduling + flex": AsyncFlexEngine}


def e2e_table(out, candidates, with_hf=True, repeats=3):
    """256 requests of 16-512 random prompt tokens and 16-256 new (seed 1), bf16, greedy, warm; useful tokens/s:
    ours and the candidates, alternated; then where ours' time goes, and HF static and dynamic."""
    model = gpt2_small(torch.bfloat16)
    prompts, news = workload(1)
    warm_prompts, warm_news = workload(2)
    defaults = cuda_defaults(model, 16, sum(blocks_for(len(p) + n, 16) for p, n in zip(prompts, news)))
    engines = {}  # name -> engine
    for name, engine_class in {"ours": ServingEngine, **candidates}.items():
        try:  # a candidate that fails to compile or capture leaves the other rows
            start = time.perf_counter()
            engines[name] = engine_class(model, block_size=16, compile="graph", **defaults)
            captured = f"{len(engines[name].graphs)} graphs captured in {time.perf_counter() - start:.1f} s"
            say(f"{name}: {f'{defaults}, ' if name == 'ours' else ''}{captured}", out)
            run_ours(engines[name], warm_prompts, warm_news)
        except Exception:  # noqa: BLE001
            engines.pop(name, None)
            say(f"{name}:\n```\n{traceback.format_exc()}```", out)
    if "ours" not in engines:
        return
    # NOTE: ours runs first, then HF. Alternated, our run after HF's compiled static cache (torch.compile,
    # reduce-overhead) failed with an illegal memory access (H200, 2026-11-26)
    runs = {name: [] for name in engines}
    for _ in range(repeats):  # alternated, so that a drift in the machine's speed touches each alike
        for name, engine in list(engines.items()):
            try:
                runs[name].append(run_ours(engine, prompts, news))
            except Exception:  # noqa: BLE001
                del engines[name], runs[name]
                say(f"{name}:\n```\n{traceback.format_exc()}```", out)
    for name in runs:
        same = sum(a == b for a, b in zip(runs[name][0][1], runs["ours"][0][1]))
        say(f"{name}: the same tokens as ours in {same} of {len(prompts)} requests (bf16)", out)
    rows = {name: [seconds for seconds, _ in name_runs] for name, name_runs in runs.items()}
    rows_table(rows, sum(news), out)  # now: a run cut short in what follows keeps it
    if with_hf:
        engine = engines["ours"]
        steps = time_steps(engine)
        run_ours(engine, prompts, news)
        say("\nWhere one more run of ours spent its time (each step timed in phases on the host):\n", out)
        breakdown_table(steps, out)
        say("", out)
        del engine.step, engine.forward, engine.sample  # time_steps' wrappers: its class's methods again
        KEPT.update(engine=engine, prompts=prompts, news=news, outputs=runs["ours"][0][1])  # for after_hf
        del engine
    del engines
    torch.cuda.empty_cache()
    if with_hf:
        say("", out)
        rows_table({"ours": rows["ours"], **hf_rows(model, prompts, news, repeats, out)}, sum(news), out)


def rows_table(rows, useful, out):
    """{name: seconds of each run} -> a table of useful tok/s and ours' time against each, run by run."""
    say(f"| system | tok/s (median of {len(rows['ours'])}, min-max) | ours / this |", out)
    say("|---|---|---|", out)
    for name, seconds in rows.items():
        tok_s = sorted(useful / s for s in seconds)
        ratios = sorted(b / a for a, b in zip(rows["ours"], seconds))
        say(
            f"| {name} | {statistics.median(tok_s):,.0f} ({tok_s[0]:,.0f}-{tok_s[-1]:,.0f}) | "
            f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |",
            out,
        )


KEPT = {}  # ours' engine from e2e, built before HF's compile, for after_hf


def after_hf(out):
    """Ours again on its engine from e2e, built before HF's compiled static cache ran in this process: the order
    in which our run once failed with an illegal memory access (H200, 2026-11-26). Run it last in a process,
    as such a fault ends CUDA for the rest of it."""
    if not KEPT:
        say("no engine of ours from e2e in this process: run e2e first", out)
        return
    seconds, outputs = run_ours(KEPT["engine"], KEPT["prompts"], KEPT["news"])
    same = sum(a == b for a, b in zip(outputs, KEPT["outputs"]))
    say(
        f"ours after HF's compile, on its engine from before it: {sum(KEPT['news']) / seconds:,.0f} tok/s, no "
        f"fault, the same tokens as before in {same} of {len(outputs)} requests",
        out,
    )


def hf_rows(model, prompts, news, repeats, out):
    """HF's generate with a static cache (compiled) and a dynamic one -> {name: seconds of each run}."""
    hf = hf_model(model, torch.bfloat16)
    start = time.perf_counter()
    run_hf(hf, prompts, news, cache_implementation="static")  # the timed shapes: nothing compiles while timed
    say(f"HF static cache: warm-up (compiles) {time.perf_counter() - start:.1f} s", out)
    rows = {"HF static": [run_hf(hf, prompts, news, cache_implementation="static")[0] for _ in range(repeats)]}
    run_hf(hf, prompts, news)
    rows["HF dynamic"] = [run_hf(hf, prompts, news)[0] for _ in range(repeats)]
    return rows


def hf_equal(out):
    """float32 greedy: ours (graphs) and HF (dynamic cache) give the same tokens on 16 prompts."""
    model = gpt2_small(torch.float32)
    prompts, news = workload(3, 16)
    news = [min(n, 64) for n in news]
    engine = ServingEngine(model, num_blocks=1024, max_batch=16, token_budget=1024, compile="graph")
    ours = run_ours(engine, prompts, news)[1]
    theirs = run_hf(hf_model(model, torch.float32), prompts, news)[1]
    say(
        f"float32 greedy, 16 prompts of 16-512 tokens, up to 64 new: {sum(a == b for a, b in zip(ours, theirs))}/16 "
        "outputs equal to HF's",
        out,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/gpu.md")
    p.add_argument("--sections", default="tests,step,e2e,attention,hf_equal,host,after_hf")
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sections = args.sections.split(",")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine does
    bandwidth = copy_bandwidth()
    say(f"$ python bench/gpu.py --sections {args.sections}", args.out)
    say(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
        f"device-to-device copy {bandwidth:.2f} TB/s (read + write)",
        args.out,
    )
    for name in sections:
        say(f"\n## {TITLES[name]}\n", args.out)
        try:
            SECTIONS[name](args.out, bandwidth)
        except Exception:  # noqa: BLE001 -- one section's failure keeps the others' figures
            say("```\n" + traceback.format_exc() + "```", args.out)


def cuda_tests(out, bandwidth):
    """The test suite's CUDA tests, their summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", "cuda"]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    lines = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True).stdout.strip().splitlines()
    say(f"$ python -m pytest -q tests -k cuda\n{lines[-1] if lines else '(no output)'}", out)


def host_table(out, bandwidth):
    from bench.host_step import host_step_ms

    for device in ("cpu", "cuda"):
        host_step_ms(device, 32)
        runs = [host_step_ms(device)[1:] for _ in range(3)]
        say(f"{device}: " + "; ".join(f"{a:.2f} ms a step, forward {b:.2f}, host {c:.2f}" for a, b, c in runs), out)


TITLES = dict(
    tests="The CUDA tests",
    attention="Decode attention, one layer",
    step="One decode step, eager against its CUDA graph",
    e2e="End to end: 256 requests, prompts 16-512, 16-256 new, bf16, greedy",
    e2e_flex="End to end with flex decode attention, the same workload (run it before HF's compile: not after e2e)",
    after_hf="Ours after HF's compiled static cache, on an engine built before it",
    hf_equal="Tokens against HF, float32",
    host="The host side of a step, 256 sequences (bench/host_step.py)",
)
SECTIONS = dict(
    tests=cuda_tests,
    attention=lambda out, bandwidth: attention_table(out),
    step=step_table,
    e2e=lambda out, bandwidth: e2e_table(out, ASYNC),
    e2e_flex=lambda out, bandwidth: e2e_table(out, FLEX, with_hf=False),
    after_hf=lambda out, bandwidth: after_hf(out),
    hf_equal=lambda out, bandwidth: hf_equal(out),
    host=host_table,
)


if __name__ == "__main__":
    main()
