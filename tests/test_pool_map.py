"""The pool map: every block's recorded state against the running sequences' block tables, the admissions
and preemptions it marks, and the picture it draws (--pool-map is test_cli.py's)."""

import random

import numpy as np
from conftest import check_invariants, run_engine

from ext import ServingEngine
from harness.metrics import Meter
from harness.plots import CACHED, COPIED, FREE, HELD, SHARED, PoolMap
from sequence import Request, RequestStatus, SamplingParams


def holders(engine):
    """Each block's holders, counted from the running sequences' block tables, not from the allocator."""
    count = np.zeros(engine.allocator.num_blocks, dtype=int)
    for s in engine.running:
        np.add.at(count, s.block_table, 1)
    return count


def run_recorded(engine, requests):
    """Serve the requests with a PoolMap on the engine, checking after every step that its column says of
    each block what the block tables say: copied on write in this step (held by one, or already by the forks
    of a beam step), else shared by several, held by one, cached with no holder, or free; and that every
    block that replaced another in a table is marked copied, and was free before the step."""
    meter, pool_map = Meter(engine), PoolMap(engine)
    for r in requests:
        engine.add(r)
    previous = np.full(engine.allocator.num_blocks, FREE)
    while engine.waiting or engine.running:
        tables = {id(s): list(s.block_table) for s in engine.running}
        engine.step()
        check_invariants(engine)
        states, count = pool_map.states[-1], holders(engine)
        copied = states == COPIED  # a copy may be shared already: a beam step forks the beam that copied
        assert (count[copied] >= 1).all()
        assert np.array_equal(states == SHARED, (count > 1) & ~copied)
        assert np.array_equal(states == HELD, (count == 1) & ~copied)
        cached = {block for block, _ in engine.allocator.by_hash.values() if count[block] == 0}
        assert set(np.flatnonzero(states == CACHED).tolist()) == cached
        replaced = {  # blocks that took the place of another in a table that existed before this step
            new
            for s in engine.running
            if id(s) in tables
            for old, new in zip(tables[id(s)], s.block_table)
            if old != new
        }
        copied = set(np.flatnonzero(copied).tolist())
        assert replaced <= copied
        assert all(previous[block] in (FREE, CACHED) for block in copied), "a copy went to a block in use"
        previous = states
    assert len(pool_map.states) == len(meter.steps)
    return pool_map, meter


def test_beams_share_blocks_and_copy_on_write(model):
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    requests = [Request(p, 20, SamplingParams(num_beams=4)) for p in prompts]
    engine = ServingEngine(model, num_blocks=256, block_size=4, max_batch=16, vocab_size=300)
    pool_map, meter = run_recorded(engine, requests)
    seen = set(np.unique(np.stack(pool_map.states)).tolist())
    assert {FREE, HELD, SHARED, COPIED} <= seen
    assert meter.num_preemptions == 0 and len(pool_map.admissions) == len(requests)
    plain = ServingEngine(model, num_blocks=256, block_size=4, max_batch=16, vocab_size=300)
    expected = run_engine(plain, [Request(p, 20, SamplingParams(num_beams=4)) for p in prompts])
    assert [r.generated for r in requests] == expected, "recording changed the outputs"


def test_shared_prefix_blocks_are_shared_then_cached(model):
    rng = random.Random(1)
    prefix = [rng.randrange(300) for _ in range(24)]
    prompts = [prefix + [rng.randrange(300) for _ in range(rng.randint(1, 10))] for _ in range(8)]
    engine = ServingEngine(model, num_blocks=80, block_size=4, token_budget=64, vocab_size=300)
    pool_map, _ = run_recorded(engine, [Request(p, 6) for p in prompts])
    seen = set(np.unique(np.stack(pool_map.states)).tolist())
    assert {FREE, HELD, SHARED, CACHED} <= seen
    assert (pool_map.states[-1] == CACHED).sum() >= len(prefix) // 4, "the prefix stays cached after the run"


def test_memory_pressure_marks_every_preemption_and_readmission(model):
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(4, 20))] for _ in range(12)]
    engine = ServingEngine(model, num_blocks=14, block_size=4, vocab_size=300)
    requests = [Request(p, 24) for p in prompts]
    pool_map, meter = run_recorded(engine, requests)
    assert meter.num_preemptions > 0 and len(pool_map.preemptions) == meter.num_preemptions
    assert len(pool_map.admissions) == len(requests) + meter.num_preemptions  # each preempted one comes back
    assert all(r.status is RequestStatus.DONE for r in requests)


def test_draw_writes_a_png_with_a_column_per_step(model, tmp_path):
    engine = ServingEngine(model, num_blocks=32, block_size=4, vocab_size=300)
    pool_map = PoolMap(engine)
    engine.run([Request([1, 2, 3, 4, 5], 8, SamplingParams(num_beams=2)), Request([7, 8, 9], 5)])
    path = tmp_path / "pool.png"
    pool_map.draw(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.stack(pool_map.states, axis=1).shape == (32, len(pool_map.states))
