"""Hashed prefix caching: sharing, chaining, reference counts and eviction."""

import random

from conftest import baseline, check_invariants, make_requests, run_engine

from ext import ServingEngine
from paged import BlockAllocator
from scheduler import PagedEngine
from sequence import Request, RequestStatus, SamplingParams, Sequence


def shared_prefix_workload():
    rng = random.Random(7)
    system = [rng.randrange(300) for _ in range(37)]  # a long prefix most requests share
    scene = [rng.randrange(300) for _ in range(9)]
    prompts = [system + [rng.randrange(300) for _ in range(rng.randint(1, 8))] for _ in range(8)]
    prompts += [
        system[:13] + scene + [rng.randrange(300) for _ in range(rng.randint(1, 5))] for _ in range(4)
    ]  # part only
    prompts += [system, system[:16]]  # entirely cached later; block-aligned at block size 4
    return prompts, [rng.randint(1, 12) for _ in prompts]


def test_outputs_identical_with_cache_on_off_and_on_the_baseline(model):
    prompts, news = shared_prefix_workload()
    want = baseline(model, prompts, news)
    for block_size, budget in [(4, 64), (4, 6), (3, 256)]:
        on = PagedEngine(model, num_blocks=300, block_size=block_size, token_budget=budget, max_batch=5)
        off = PagedEngine(
            model, num_blocks=300, block_size=block_size, token_budget=budget, max_batch=5, prefix_cache=False
        )
        assert run_engine(on, make_requests(prompts, news), check=True) == want
        assert run_engine(off, make_requests(prompts, news), check=True) == want
        assert on.meter.prefill_tokens < 0.5 * off.meter.prefill_tokens and on.meter.cached_tokens > 0
        assert off.meter.cached_tokens == 0


def test_identical_blocks_behind_different_prefixes_never_hit(model):
    """Block 1 of a and of b holds the same tokens behind different blocks 0. With b's block 0 cached too, b's
    lookup reaches block 1, where only the chain (block 0's hash inside block 1's) tells b's from a's."""
    prompts = [[1, 2, 3, 4, 9, 9, 9, 9, 5], [6, 7, 8, 1, 0, 0, 0, 0, 5], [6, 7, 8, 1, 9, 9, 9, 9, 5]]  # a, c, b
    a, b = (Request(prompts[i], 8).sequences[0] for i in (0, 2))
    alloc = BlockAllocator(8, block_size=4)
    for s, k in [(a, 0), (a, 1), (b, 0)]:
        alloc.register(alloc.allocate()[0], alloc.block_hash(s, k), alloc.block_tokens(s, k))
    assert alloc.block_tokens(a, 1) == alloc.block_tokens(b, 1)
    assert alloc.cached_prefix(b, 8) == [alloc.by_hash[alloc.block_hash(b, 0)][0]]  # not a's block 1
    # the engine: a caches both its blocks, c caches b's block 0, then b finds that block alone; sampled, so
    # that b's tokens show a's K/V in its block 1 (computed behind a's block 0)
    engine = PagedEngine(model, num_blocks=50, block_size=4, token_budget=64)
    one_by_one = [0, 10, 20]  # each done before the next arrives
    got = run_engine(engine, make_requests(prompts, [8] * 3, temperature=1.0), one_by_one)
    assert engine.meter.cached_tokens == 4
    assert got == baseline(model, prompts, [8] * 3, temperature=1.0)


def test_entirely_cached_prompt_still_computes_its_last_token(model):
    engine = PagedEngine(model, num_blocks=50, block_size=4, token_budget=64)
    prompt = list(range(10, 22))  # 12 tokens: block-aligned, 3 full blocks
    first, again = Request(prompt, 2), Request(prompt, 2)
    run_engine(engine, [first])
    computed_before = engine.meter.prefill_tokens
    run_engine(engine, [again])
    assert engine.meter.cached_tokens == 8  # two blocks served, the last block recomputed for its last token
    assert engine.meter.prefill_tokens - computed_before == 4
    assert again.generated == first.generated


def test_shared_block_survives_its_first_holder_and_pool_is_reclaimable_at_the_end(model):
    engine = PagedEngine(model, num_blocks=20, block_size=4, token_budget=64)
    prefix = list(range(30, 38))  # two full blocks
    run_engine(engine, [Request(prefix + [1], 1)])  # computes and caches the prefix, then lets go
    first, second = Request(prefix + [2], 3), Request(prefix + [3], 30)
    engine.add(first)
    engine.add(second)
    engine.step()
    shared = first.sequences[0].block_table[:2]
    assert second.sequences[0].block_table[:2] == shared and all(engine.allocator.ref_count[b] == 2 for b in shared)
    while first.status is not RequestStatus.DONE:
        engine.step()
        check_invariants(engine)
    assert second.sequences[0].block_table[:2] == shared and all(engine.allocator.ref_count[b] == 1 for b in shared)
    while engine.running:
        engine.step()
    assert engine.allocator.num_free() == 20 and set(shared) <= set(engine.allocator.cached_free)
    check_invariants(engine)


def test_eviction_takes_clean_blocks_first_then_least_recently_released():
    alloc = BlockAllocator(4, block_size=1)
    [a], [b] = alloc.allocate(), alloc.allocate()
    alloc.register(a, "hash-a", (1,))
    alloc.register(b, "hash-b", (2,))
    alloc.free([b])  # released first: least recently used
    alloc.free([a])
    assert alloc.allocate()[0] not in (a, b) and alloc.allocate()[0] not in (a, b)  # clean blocks first
    assert alloc.allocate() == [b] and "hash-b" not in alloc.by_hash  # then LRU, forgetting its hash
    assert alloc.by_hash["hash-a"] == (a, (1,))
    assert alloc.allocate() == [a]


def test_a_hash_collision_never_hits():
    """A cached block is found by its hash and must hold the looked-up tokens: blocks of another content that
    happen to share the hash are misses."""
    alloc = BlockAllocator(4, block_size=2)
    s, other = Request([1, 2, 3, 4, 5], 1).sequences[0], Request([7, 8, 3, 4, 5], 1).sequences[0]
    [block] = alloc.allocate()
    alloc.register(block, alloc.block_hash(s, 0), alloc.block_tokens(other, 0))  # s's hash, another's tokens
    assert alloc.cached_prefix(s, 4) == []
    alloc.by_hash[alloc.block_hash(s, 0)] = (block, alloc.block_tokens(s, 0))
    assert alloc.cached_prefix(s, 4) == [block]


def test_same_prefix_admitted_together_is_computed_once(model):
    prefix = list(range(40, 64))  # six blocks of 4
    want = baseline(model, [prefix + [1], prefix + [2], prefix + [3]], [3, 3, 3])
    engine = PagedEngine(model, num_blocks=60, block_size=4, token_budget=10)  # prefill takes several steps
    got = run_engine(engine, make_requests([prefix + [1], prefix + [2], prefix + [3]], [3, 3, 3]), check=True)
    assert got == want
    # the first computes all 25 tokens; the others wait for its six blocks, share them, and compute 1 token each
    assert engine.meter.prefill_tokens == 25 + 1 + 1
    assert engine.meter.cached_tokens == 48


def test_a_readmitted_beam_group_keeps_every_members_cached_blocks_while_another_allocates(model):
    """A beam group is admitted whole: one member's new blocks may come from evicting cached ones, and
    they must never be the cached blocks another member of the group is about to share. The pool holds
    exactly what the group needs: 2 clean blocks, then cached ones, the oldest released being the second
    beam's own prefix."""
    engine = ServingEngine(model, num_blocks=6, block_size=2, token_budget=64)
    alloc = engine.allocator
    r = Request([9, 9, 9, 9, 9], 4, SamplingParams(num_beams=2))
    first = r.sequences[0]
    second = Sequence(r, [1, 2, 3, 4, 5], seed=0)  # a beam whose first two blocks are cached
    other = Sequence(r, [7, 7, 8, 8], seed=0)
    blocks = alloc.allocate(6)
    for k in range(2):  # the second beam's prefix, released first: least recently used
        alloc.register(blocks[k], alloc.block_hash(second, k), alloc.block_tokens(second, k))
        alloc.register(blocks[2 + k], alloc.block_hash(other, k), alloc.block_tokens(other, k))
    for block in blocks:
        alloc.free([block])
    r.sequences = [first, second]
    engine.waiting.extend([first, second])
    assert engine.admit_next() == [first, second]
    assert second.num_computed == 4 and set(first.block_table).isdisjoint(second.block_table)
    for k in range(2):  # what the second beam shares still holds its tokens
        assert alloc.hash_of[second.block_table[k]] == alloc.block_hash(second, k)
    check_invariants(engine)
