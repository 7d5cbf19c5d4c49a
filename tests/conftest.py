import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ext.compiled_steps import RowBatch
from ext.cuda import GraphBatch
from harness.contiguous import ContiguousEngine
from harness.metrics import Meter, kv_slots
from model import GPT, GPTConfig
from sequence import Request, SamplingParams

torch.set_num_threads(1)  # tests are many small ops; threads only add overhead on 2 cores


def tiny_gpt(seed=0, block_size=64, vocab_size=300, n_layer=2, n_head=2, n_embd=32, dtype=torch.float64):
    """A random GPT small enough that hundreds of engine runs fit in CI."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return GPT(config).eval().to(dtype)


@pytest.fixture(scope="package")
def model():
    return tiny_gpt()


@pytest.fixture(scope="package")
def ckpt(tmp_path_factory):
    """A float32 tiny_gpt saved as a nanoGPT checkpoint, for the command line's tests."""
    from test_model import save_nanogpt_ckpt

    path = tmp_path_factory.mktemp("cli") / "ckpt.pt"
    save_nanogpt_ckpt(tiny_gpt(dtype=torch.float32), path)
    return str(path)


def make_requests(prompts, news, temperature=0.0, top_k=None):
    return [
        Request(p, n, SamplingParams(temperature=temperature, top_k=top_k, seed=1000 + i))
        for i, (p, n) in enumerate(zip(prompts, news))
    ]


def check_invariants(engine):
    """Every block is exactly one of: clean, cached (free with a hash), or held by as many block
    tables as its reference count says; each running sequence's block table covers its K/V, and each
    swapped-out sequence's blocks in the swap space cover its K/V (check_swap_space)."""
    alloc = engine.allocator
    holders = [0] * alloc.num_blocks
    for r in engine.running:
        assert len(set(r.block_table)) == len(r.block_table), f"block table repeats a block: {r.block_table}"
        assert r.num_computed <= len(r.block_table) * engine.block_size, "block table does not cover the K/V"
        for block in r.block_table:
            holders[block] += 1
    swapped = getattr(engine, "swapped", {})  # the swap extension's (ext/swap.py)
    for r in engine.waiting:
        if swapped.get(r):  # swapped out: its K/V are in the swap space, and it holds no block of the pool
            assert len(swapped[r]) == -(-r.num_computed // engine.block_size), "the swap space does not hold its K/V"
            assert not r.block_table and r.row is None, "a swapped-out sequence holds blocks or a row"
            continue
        assert not r.block_table and r.num_computed == 0 and r.row is None, "a waiting request holds blocks or a row"
    if hasattr(engine, "swap_space"):
        check_swap_space(engine)
    rows = [r.row for r in engine.running]
    assert sorted(rows + engine.free_rows) == list(range(engine.max_batch)), "a row is lost or held twice"
    bs = engine.block_size
    for r in engine.running:  # the persistent table mirrors each block table, and never names padding's block
        assert engine.block_tables[r.row, : len(r.block_table)].tolist() == r.block_table
        assert alloc.num_blocks not in r.block_table
        # no block past its tokens: speculation's rejected slots went back at once
        assert len(r.block_table) <= -(-len(r.tokens) // bs), "a sequence holds a block past its tokens"
        for k, block in enumerate(r.block_table):  # a block in the prefix cache holds the tokens it is found by
            if block in alloc.hash_of:
                cached_tokens = alloc.by_hash[alloc.hash_of[block]][1]
                assert cached_tokens == tuple(r.tokens[k * bs : (k + 1) * bs]), f"block {block} is cached as others"
    clean, cached = set(alloc.clean), set(alloc.cached_free)
    assert len(clean) == len(alloc.clean), "a block is twice on the clean stack"
    for block in range(alloc.num_blocks):
        states = (block in clean) + (block in cached) + (holders[block] > 0)
        assert states == 1, f"block {block} is in {states} states (clean / cached / held)"
        assert alloc.ref_count[block] == holders[block], (
            f"block {block}: ref_count {alloc.ref_count[block]}, {holders[block]} holders"
        )
        assert block not in clean or block not in alloc.hash_of, f"clean block {block} keeps a hash"
    assert cached <= set(alloc.hash_of), "a cached block has no hash"
    assert all(alloc.hash_of[b] == h and alloc.by_hash[h][0] == b for h, (b, _) in alloc.by_hash.items())
    assert len(alloc.by_hash) == len(alloc.hash_of)
    # slots holding K/V, each counted once however many sequences share its block
    written = {(r.block_table[p // bs], p % bs) for r in engine.running for p in range(r.num_computed)}
    assert kv_slots(engine)["used"] == len(written)


def check_swap_space(engine):
    """Every block of the swap space is free exactly once or held by exactly one swapped-out sequence, and none
    leaks; running sequences hold none."""
    held = [block for r in engine.waiting for block in engine.swapped.get(r, [])]
    assert not any(engine.swapped.get(r) for r in engine.running), "a running sequence holds swap blocks"
    assert len(set(held)) == len(held), "a swap block is held twice"
    free = engine.free_swap
    assert len(set(free)) == len(free), "a swap block is free twice"
    assert not set(free) & set(held), "a swap block is free and held"
    assert len(free) + len(held) == engine.swap_space.shape[2], "a swap block leaked"


def check_writes(engine):
    """Wrap the engine's make_batch so that every step asserts that each block it writes is written by one
    sequence, and held by no other that could have read it: a block shared by forks is never written
    (copy-on-write copies it first), and one shared from the prefix cache while a prompt computes it
    (PagedEngine.schedule) is held besides only by prompts of this step that start past it, and read it
    after each layer writes it."""
    make_batch = engine.make_batch

    def checked(plan, samplers):
        batch = make_batch(plan, samplers)
        bs, num_blocks = engine.block_size, engine.allocator.num_blocks
        writers = {}  # block -> the sequences whose new tokens go in it
        for s, n in plan:
            for position in range(s.num_computed, s.num_computed + n):
                writers.setdefault(s.block_table[position // bs], set()).add(s)
        written = set((batch.slots // bs).tolist())
        # a padded step's padding writes the padding block, block num_blocks, which no sequence holds
        assert written <= set(range(num_blocks + isinstance(batch, (GraphBatch, RowBatch))))
        planned = {s for s, _ in plan}
        for block in written - {num_blocks}:
            assert len(writers[block]) == 1, f"block {block} is written by {len(writers[block])} sequences"
            readers = [x for x in engine.running if block in x.block_table and x not in writers[block]]
            for x in readers:
                past = x.num_computed >= (x.block_table.index(block) + 1) * bs
                assert x in planned and past, f"block {block} is written while another sequence holds it"
            assert engine.allocator.ref_count[block] == 1 + len(readers)
        return batch

    engine.make_batch = checked


def run_engine(engine, requests, arrivals=None, check=False):
    """Add each request at its arrival step (default: all at step 0) and step until all are done. The
    engine's measurements are in engine.meter."""
    engine.meter = getattr(engine, "meter", None) or Meter(engine)
    if check and hasattr(engine, "allocator"):
        check_writes(engine)
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, range(len(requests))))
    step = 0
    while pending or engine.waiting or engine.running:
        while pending and pending[0][0] <= step:
            engine.add(requests[pending.pop(0)[1]])
        if engine.waiting or engine.running:
            engine.step()
            if check:
                check_invariants(engine)
        step += 1
        assert step < 100_000, "engine made no progress"
    return [r.generated for r in requests]


def baseline(model, prompts, news, temperature=0.0, top_k=None, max_batch=4):
    return run_engine(ContiguousEngine(model, max_batch=max_batch), make_requests(prompts, news, temperature, top_k))
