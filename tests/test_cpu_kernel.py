"""Decode attention through the C kernel (compile="kernel", ext/cpu_kernel.py): its output equals gather_attend's in
float64 to rounding, and within float32's and bf16's rounding of it in those dtypes, at every block size, head
size and table with stale entries; a row's output is the same bits whatever rows run beside it; in float64 the
engine's tokens equal the contiguous baseline's under preemption, swap, prefix hits, forks, beams and speculation,
and the shipped model's float32 tokens equal the core's. The draw in C (ext/sample.c) gives the core's tokens on
every sampling setting, and its scores logprobs' own within float32's rounding; top_k.c's selection equals a
stable sort. A missing compiler or a failed build is one line."""

import copy
import os
import shlex
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_invariants, make_requests, run_engine
from hypothesis import HealthCheck, given, settings
from test_bf16 import prepack, prompts_from_the_plays
from test_robust import run_random_workload, workloads
from test_speculative import repetitive_prompts
from test_swap import mixed_requests, outputs, storm_prompts

from ext import ServingEngine, cpu_kernel, engine_class
from ext.cpu_kernel import (
    KernelBatch,
    kernel_attend,
    kernel_sample,
    kernel_sample_scored,
    kernel_scores,
    kernel_topk,
)
from ext.logprobs import scores
from harness.checkpoints import SHIPPED, load_checkpoint
from harness.contiguous import ContiguousEngine
from harness.metrics import agreement
from paged import gather_attend
from sampling import sample, uniform
from sequence import Request, SamplingParams


@contextmanager
def float64_default():
    """torch's default dtype float64 inside (the core's u and its draw's target follow it), as it was after."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def random_rows(B, H, D, block_size, num_blocks, dtype, seed=0):
    """B rows of 1 to 3 blocks' keys over a shuffled pool; each table has an entry past its row's blocks (stale:
    a block another row holds, never read) -> q, k_pool, v_pool, table, kv_len."""
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = torch.randn(2, num_blocks + 1, block_size, H, D, generator=g, dtype=torch.float64).to(dtype)
    kv_len = torch.randint(1, 3 * block_size + 1, (B,), generator=g)
    table = torch.randperm(num_blocks, generator=g)[: B * 4].view(B, 4)
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k_pool, v_pool, table, kv_len


def record_batches(engine):
    """Wrap make_batch -> the list it fills with each step's batch."""
    batches, make_batch = [], engine.make_batch

    def recorded(plan, samplers):
        batches.append(make_batch(plan, samplers))
        return batches[-1]

    engine.make_batch = recorded
    return batches


@pytest.mark.parametrize("H, D", [(2, 32), (12, 64), (3, 24)])  # the two inlined head sizes, and any other
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_kernel_equals_gather_attend_in_every_dtype(H, D, block_size):
    rows = random_rows(7, H, D, block_size, num_blocks=40, dtype=torch.float64)
    want = gather_attend(*rows)
    torch.testing.assert_close(kernel_attend(*rows), want, rtol=0, atol=1e-12)
    for dtype, tolerance in [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)]:
        q, k_pool, v_pool, table, kv_len = rows
        low = (q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table, kv_len)
        exact = gather_attend(*(t.double() if t.is_floating_point() else t for t in low))  # of the rounded inputs
        got = kernel_attend(*low)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), exact, rtol=tolerance, atol=tolerance)


def sorted_rows(x, k):
    """Each row's k best (value, id) pairs by a stable sort: larger values first, of equal values the lower id."""
    ids = torch.from_numpy(np.argsort(-x.numpy(), axis=1, kind="stable")[:, :k].copy())
    return x.gather(1, ids), ids


@pytest.mark.parametrize("kind", ["distinct", "bf16 ties", "few values", "signed zeros", "ascending", "descending"])
def test_the_kernels_top_k_equals_a_sort_of_each_row(kind):
    """Ties at and inside the cut, -0.0 beside 0.0, -inf ids (the padded vocabulary), ids in the worst order for a
    running bar, every k from 1 to the row; short rows, where every id enters the buffer and it fills, and long
    ones, where the groups' maxima set the bar first: the values torch.topk gives, the ids of a stable sort."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        R = int(torch.randint(1, 6, (), generator=g))
        V = int(torch.randint(1, 3000, (), generator=g) if trial % 3 else torch.randint(4096, 20000, (), generator=g))
        x = torch.randn(R, V, generator=g)
        if kind == "bf16 ties":
            x = x.bfloat16().float()
        elif kind == "few values":
            x = torch.randint(0, 4, (R, V), generator=g).float()
        elif kind == "signed zeros":
            x = torch.randint(0, 3, (R, V), generator=g).float() - 1
            x[torch.rand(R, V, generator=g) < 0.3] = -0.0
        elif kind in ("ascending", "descending"):
            x = x.sort(-1, descending=kind == "descending").values
        x[:, -V // 5 :] = float("-inf")
        for k in sorted({1, int(torch.randint(1, min(V, 700) + 1, (), generator=g)), V}):
            values, ids = kernel_topk(x, k)
            want_values, want_ids = sorted_rows(x, k)
            assert torch.equal(values, torch.topk(x, k).values) and torch.equal(values, want_values)
            assert torch.equal(ids, want_ids), (kind, R, V, k)


def test_the_kernels_top_k_puts_nan_first_and_leaves_other_inputs_to_torch():
    x = torch.tensor([[0.5, float("nan"), 2.0, float("nan"), -1.0]])
    values, ids = kernel_topk(x, 3)
    assert ids.tolist() == [[1, 3, 2]] and values[0, 2] == 2.0 and values[0, :2].isnan().all()
    half = torch.randn(2, 8192)
    half[:, ::2] = float("nan")  # a NaN in every group: the first pass's bar is no help, the buffer's NaNs end it
    assert torch.equal(kernel_topk(half, 300)[1], torch.arange(0, 600, 2).expand(2, -1))
    for other in (x.double(), x.bfloat16()):  # not float32: torch.topk's own
        assert kernel_topk(other, 3).values.dtype == other.dtype


def test_a_rows_output_is_the_same_bits_whatever_runs_beside_it():
    """Each row is one thread's, start to end, in one order: batch-invariant, at any thread count and table width."""
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        q, k_pool, v_pool, table, kv_len = random_rows(9, 4, 32, 4, num_blocks=60, dtype=dtype, seed=1)
        together = kernel_attend(q, k_pool, v_pool, table, kv_len)
        try:
            torch.set_num_threads(1)
            for b in range(9):
                wider = torch.cat([table[b : b + 1], table[:1]], dim=1)  # more stale entries, a longer scratch
                alone = kernel_attend(q[b : b + 1], k_pool, v_pool, wider, kv_len[b : b + 1])
                assert torch.equal(alone[0], together[b])
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size, num_blocks", [(1, 70), (3, 30), (16, 10)])
def test_the_kernel_engine_equals_the_core_under_preemption_swap_forks_and_beams(model, block_size, num_blocks):
    """float64: plain, sampled, n samples and beams over prompts with shared heads, in a pool that preempts
    (recompute and swap); the kernel engine's outputs equal the core engine's, which equal the oracles
    (tests/test_swap.py). Every decode step attends through the kernel."""
    prompts = storm_prompts(block_size, 12, block_size)
    kw = dict(num_blocks=num_blocks, block_size=block_size, token_budget=24, max_batch=12)
    for swap_blocks in [0, 4 * num_blocks]:
        want = mixed_requests(prompts)
        run_engine(ServingEngine(model, swap_blocks=swap_blocks, **kw), want)
        got = mixed_requests(prompts)
        engine = ServingEngine(model, swap_blocks=swap_blocks, compile="kernel", **kw)
        batches = record_batches(engine)
        run_engine(engine, got, check=True)
        assert outputs(got) == outputs(want)
        assert engine.meter.num_preemptions > 0 and engine.meter.cached_tokens > 0
        assert all(isinstance(b, KernelBatch) for b in batches) and engine.allocator.num_free() == num_blocks


def test_the_kernel_engine_speculating_gives_plain_decodings_tokens(model):
    prompts = repetitive_prompts(8, 4)
    news = [5 + 3 * i for i in range(8)]
    for temperature, top_k in [(0.0, None), (0.05, 40)]:
        want = run_engine(
            ServingEngine(model, num_blocks=200, block_size=4), make_requests(prompts, news, temperature, top_k)
        )
        engine = ServingEngine(model, num_blocks=200, block_size=4, num_speculative_tokens=4, compile="kernel")
        assert run_engine(engine, make_requests(prompts, news, temperature, top_k), check=True) == want
        assert sum(stats[0] for stats in engine.meter.speculation.values()) > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(w=workloads())
def test_random_workloads_through_the_kernel_match_the_baseline(model, w):
    engine = run_random_workload(model, w, engine_class(compile="kernel"), compile="kernel")
    check_invariants(engine)
    assert engine.allocator.num_free() == w["num_blocks"]


def test_the_shipped_models_float32_tokens_through_the_kernel_are_the_cores():
    """Greedy and sampled, at 1, 4 and 16 rows a step (the core: a lone row in place, eager rows, then compiled)."""
    model = load_checkpoint(SHIPPED)
    prompts = [[(7 * i + j) % 2048 for j in range(5 + 9 * i)] for i in range(16)]
    for rows in [1, 4, 16]:
        want = mixed_requests(prompts[: rows * 2])
        run_engine(ServingEngine(model, num_blocks=200, max_batch=rows), want)
        got = mixed_requests(prompts[: rows * 2])
        run_engine(ServingEngine(model, num_blocks=200, max_batch=rows, compile="kernel"), got, check=True)
        assert outputs(got) == outputs(want)


def test_the_shipped_models_top_p_min_p_and_logprobs_through_the_kernel_are_the_cores(monkeypatch):
    """In float32, rows with top-p, min-p, top-k and logprobs=3 (with prompt logprobs) drawn and scored in C (the
    calls counted: they ran) give the core's tokens, and logprobs within float32's rounding of its."""
    model = load_checkpoint(SHIPPED)
    calls = {"kernel_sample": 0, "kernel_scores": 0, "kernel_sample_scored": 0}

    def counting(name):
        real = getattr(cpu_kernel, name)

        def counted(*args):
            calls[name] += 1
            return real(*args)

        return counted

    for name in calls:
        monkeypatch.setattr(cpu_kernel, name, counting(name))
    kinds = [dict(top_p=0.9), dict(min_p=0.05), dict(top_k=30, top_p=0.8), dict(top_p=0.5, min_p=0.02), dict()]

    def requests():
        return [
            Request(
                [(5 * i + j) % 2048 for j in range(4 + 3 * i)],
                12,
                SamplingParams(temperature=0.9, seed=i, logprobs=3, prompt_logprobs=2, **kinds[i % 5]),
            )
            for i in range(10)
        ]

    got, want = requests(), requests()
    run_engine(ServingEngine(model, num_blocks=200, max_batch=8, compile="kernel"), got, check=True)
    run_engine(ServingEngine(model, num_blocks=200, max_batch=8), want)
    assert outputs(got) == outputs(want)
    assert all(calls.values())  # drawn, scored, and drawn and scored in one call (every row asks: logprobs=3)
    for a, b in zip(got, want):
        assert len(a.sequences[0].logprobs) == len(b.sequences[0].logprobs) == 12
        for entry, other in zip(a.sequences[0].logprobs, b.sequences[0].logprobs):
            assert list(entry) == list(other) and [x.rank for x in entry.values()] == [x.rank for x in other.values()]
            assert [x.logprob for x in entry.values()] == pytest.approx([x.logprob for x in other.values()], abs=1e-5)
        pa, pb = a.prompt_logprobs, b.prompt_logprobs
        assert np.array_equal(pa.top_ids, pb.top_ids) and np.array_equal(pa.rank, pb.rank)
        np.testing.assert_allclose(pa.logprob, pb.logprob, rtol=0, atol=1e-5)


def test_the_shipped_model_in_bf16_agrees_with_the_baseline_as_the_cores_paths_do():
    """tests/test_bf16.py's check of the core's eager and compiled paths, through the kernel: bf16 rounds apart
    in each, so outputs may part after a near tie; a K/V in a wrong slot, block or dtype would part at once."""
    model = load_checkpoint(SHIPPED).to(torch.bfloat16)
    prepack(model)
    prompts, news = prompts_from_the_plays(16, 40), [32] * 16
    want = run_engine(ContiguousEngine(model, max_batch=16), make_requests(prompts, news))
    kw = dict(num_blocks=24, block_size=4, token_budget=64, max_batch=16)
    engine = ServingEngine(model, compile="kernel", **kw)
    got = run_engine(engine, make_requests(prompts, news), check=True)
    assert engine.meter.num_preemptions > 0
    assert sum(map(agreement, want, got)) / len(want) > 0.9
    assert sum(a == b for a, b in zip(want, got)) >= 13


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """The kernel built anew into tmp_path/nanogpt-paged, then the real one again, from its own cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernel.load_kernel.cache_clear()
    yield tmp_path / "nanogpt-paged"
    cpu_kernel.load_kernel.cache_clear()


def test_a_missing_compiler_or_a_failed_build_is_one_line(model, monkeypatch, tmp_path, fresh_cache):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(ValueError, match="no C compiler 'no-such-cc' is on the PATH: set CC"):
        ServingEngine(model, num_blocks=10, compile="kernel")
    monkeypatch.setenv("CC", "cc -Wall")  # a compiler with its arguments, as make takes CC
    ServingEngine(model, num_blocks=10, compile="kernel")
    monkeypatch.delenv("CC")
    cpu_kernel.load_kernel.cache_clear()
    broken = tmp_path / "decode_attention.c"
    broken.write_text("int decode_attend( {\n")
    monkeypatch.setattr(cpu_kernel, "SOURCES", [broken, cpu_kernel.SOURCES[1]])
    with pytest.raises(ValueError, match="could not build decode_attention.c and top_k.c: .*error"):
        ServingEngine(model, num_blocks=10, compile="kernel")
    assert not list(fresh_cache.glob("*/*"))  # nothing half-built left behind


def test_a_corrupt_cached_kernel_is_built_again_and_an_unwritable_cache_is_one_line(model, monkeypatch, fresh_cache):
    library = cpu_kernel.library_for("double")[2]
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")  # cut short, by another process
    rows = random_rows(3, 2, 32, 4, num_blocks=20, dtype=torch.float64)
    torch.testing.assert_close(kernel_attend(*rows), gather_attend(*rows), rtol=0, atol=1e-12)
    assert library.stat().st_size > 0
    not_a_folder = fresh_cache.parent / "a_file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    cpu_kernel.load_kernel.cache_clear()
    with pytest.raises(ValueError, match="compile 'kernel': cannot build or load .*a_file"):
        ServingEngine(model, num_blocks=10, compile="kernel")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # unset, empty or relative: ~/.cache, as XDG says
    assert cpu_kernel.cache_folder() == Path.home() / ".cache" / "nanogpt-paged"


def test_a_float64_engine_takes_its_top_k_from_the_one_library_it_built(model, fresh_cache):
    """Both builds hold top_k: the engine's draws take it from its pool's build, so nothing is built mid-run. Its
    outputs are float32 whatever the default dtype."""
    engine = ServingEngine(model, num_blocks=20, compile="kernel")
    run_engine(engine, make_requests([[1, 2, 3], [4, 5]], [4, 3], 0.9, 5), check=True)
    assert [path.name.split("_")[2] for path in fresh_cache.glob("*.so")] == ["double"]
    with float64_default():
        x = torch.randn(2, 50, dtype=torch.float32)
        assert torch.equal(kernel_topk(x, 7, real="double")[0], torch.topk(x, 7).values)


def core_sample(logits, settings, position):
    """The core's draw, with the hints the engine gives it (PagedEngine.sample)."""
    best = [int(k) for t, k in settings[:, :2].tolist() if t > 0]
    return sample(logits, settings, position, max(best, default=0), 0 in best)


def settings_rows(R, temperature, top_k, top_p, min_p, seed=0):
    return torch.tensor([[temperature, top_k, top_p, min_p, seed + 7 * i] for i in range(R)], dtype=torch.float64)


SETTINGS = [  # temperature, top_k (0: none), top_p, min_p: each rule alone and together, near greedy and near flat
    (0.0, 0, 1.0, 0.0),
    (0.8, 200, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (0.7, 0, 0.2, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.3, 0, 0.7, 0.1),
    (0.8, 40, 0.9, 0.05),
    (1.5, 40, 0.5, 0.0),
    (1e-3, 0, 0.95, 0.0),
    (1e-3, 50, 1.0, 0.0),
    (50.0, 0, 0.9, 0.0),
    (50.0, 300, 0.8, 0.0),
]


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_the_kernels_draw_equals_the_cores_on_every_setting(scale):
    """Rows of GPT-2's padded vocabulary (its last ids at -inf, as the engine leaves them): every setting alone and
    all of them in one batch draw the core's tokens, in either default dtype (the core's u, and its draw's target,
    follow it)."""
    R, V = 48, 50304
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(R, V, generator=g) * scale
    logits[:, 50257:] = float("-inf")
    position = torch.randint(0, 1000, (R,), generator=g)
    mixed = torch.cat([settings_rows(R // len(SETTINGS) + 1, *c, seed=i) for i, c in enumerate(SETTINGS)])[:R]
    for rows in [settings_rows(R, *c, seed=3) for c in SETTINGS] + [mixed]:
        assert torch.equal(kernel_sample(logits, rows, position), core_sample(logits, rows, position))
    with float64_default():
        assert torch.equal(kernel_sample(logits, mixed, position), core_sample(logits, mixed, position))


def test_a_flat_rows_draw_from_float32_weights_stands_only_where_rounding_cannot_move_it():
    """Rows with no top-k or top-p draw from float32 weights first (invert_cdf_near) and keep that column only
    where the float64 weights' draw surely takes it too; ~3% of draws on these flat rows (each id ~1/50,000 of the
    mass) fall within the bound of a boundary and are drawn again from float64 weights. Every draw is the core's,
    at both dtypes of the target, and at a vocabulary whose last block is short."""
    g = torch.Generator().manual_seed(11)
    for V, scale, (temperature, min_p) in [
        (50304, 0.7, (1.0, 0.0)),
        (50257, 0.1, (1.0, 0.0)),
        (20000, 0.7, (0.8, 0.05)),
    ]:
        logits = torch.randn(128, V, generator=g) * scale
        rows = settings_rows(128, temperature, 0, 1.0, min_p, seed=V)
        for _ in range(3):
            position = torch.randint(0, 10**6, (128,), generator=g)
            assert torch.equal(kernel_sample(logits, rows, position), core_sample(logits, rows, position))
    with float64_default():
        assert torch.equal(kernel_sample(logits, rows, position), core_sample(logits, rows, position))


EXP_GAP = r"""
#include <stdio.h>
#include "%s"
int main(void) { /* the largest gap between exp_vec_float and exp_vec on [-87, 0], relative to exp_vec's */
    uint32_t last; float floor = -87.0f;
    memcpy(&last, &floor, 4);
    double worst = 0;
#pragma omp parallel for reduction(max : worst)
    for (int64_t b = 0x80000000u; b <= last; b += LANES) {
        floats v;
        for (int j = 0; j < LANES; j++) {
            uint32_t bits = b + j <= last ? (uint32_t)(b + j) : last;
            memcpy(&v[j], &bits, 4);
        }
        floats a = exp_vec_float(v), e = exp_vec(v);
        for (int j = 0; j < LANES; j++)
            worst = fmax(worst, fabs((double)a[j] - e[j]) / e[j]);
    }
    printf("%%.17g\n", worst);
}
"""


def run_probe(tmp_path, code):
    """code: a C program that includes ext/sample.c (its path at %s), built as this CPU's kernel is -> its output."""
    source = tmp_path / "probe.c"
    source.write_text(code % Path(cpu_kernel.__file__).with_name("sample.c"))
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = [f for f in cpu_kernel.FLAGS if f not in ("-shared", "-fPIC")] + cpu_kernel.BUILD_FLAGS["float"]
    top_k = Path(cpu_kernel.__file__).with_name("top_k.c")
    command = [*compiler, *flags, str(source), str(top_k), "-o", str(tmp_path / "probe"), "-lm"]
    subprocess.run(command, check=True, capture_output=True)
    return subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout


def test_the_float32_exp_is_within_2_to_the_minus_23_of_the_float64_one_on_every_scaled_value(tmp_path):
    """invert_cdf_near's bound (NEAR, 2**-22) rests on every float32 weight lying within 2**-23 of its float64 one,
    relative, for every scaled value a row without top-k holds ([-87, 0]): checked for every float there, as this
    CPU's build of ext/sample.c computes them (the compiler's contractions into FMA are its own)."""
    worst = float(run_probe(tmp_path, EXP_GAP))
    assert 0 < worst <= 2**-23, worst


ONE_WAY = r"""
#include <stdio.h>
#include "%s"
int main(void) { /* floats of [-6, -1], from an LCG, whose float32 weight is an ulp above exp_vec's (1) or below (0) */
    uint32_t state = 12345, shown[2] = {0, 0};
    while (shown[0] < 6000 || shown[1] < 6000) {
        state = state * 1664525u + 1013904223u;
        float x = -1.0f - 5.0f * (float)(state >> 8) / 16777216.0f;
        float a = exp_vec_float(splat(x))[0], e = exp_vec(splat(x))[0];
        if (a != e && shown[a > e] < 6000) {
            printf("%%d %%.9g\n", a > e, x);
            shown[a > e]++;
        }
    }
}
"""


def test_top_p_on_flat_rows_cuts_from_float32_weights_only_where_rounding_cannot_move_the_cut(tmp_path):
    """Top-p on a flat row cuts from float32 weights first (cut_top_p), and keeps that cut only where the float64
    weights' cut is surely the same. Rows whose values above -2.5 all have float32 weights an ulp above their float64
    ones, and those below an ulp below, or the other way round (the mass before a cut there errs one way and about
    as much after it the other), each value's torch exp the correctly rounded one (as the kernel's float64 exp
    nearly always is), at the 24 float32 top_p values around each of 8 of the core's cuts among the last values
    above -2.5: every draw is the core's (with the bound's margin dropped from cut_top_p, 3 of the 384 differ)."""
    side, x = np.loadtxt(run_probe(tmp_path, ONE_WAY).splitlines(), unpack=True)
    values = torch.tensor(x, dtype=torch.float32)
    one_way = [values[(torch.tensor(side) == s) & (values.exp() == values.double().exp().float())] for s in (0, 1)]
    for high, low in [one_way, one_way[::-1]]:
        row = torch.cat([torch.zeros(1), high[high > -2.5][:1000], low[(low < -2.5) & (low > -4.5)][:4000]])
        ranked = row.sort(descending=True).values
        p = ranked.exp()
        mass = p.cumsum(0)
        boundaries = (mass - p) / mass[-1]  # the core's walk stops where top_p of the sum reaches one of these
        last_high = int((ranked > -2.5).sum())
        top_ps = []
        for i in range(last_high - 200, last_high, 25):
            step = np.float32(boundaries[i].item())
            for _ in range(12):
                step = np.nextafter(step, np.float32(0))
            for _ in range(24):
                top_ps.append(float(step))
                step = np.nextafter(step, np.float32(1))
        R = len(top_ps)
        logits = row.expand(R, -1).contiguous()
        settings = torch.tensor([[1.0, 0, top_p, 0.0, 5 + i] for i, top_p in enumerate(top_ps)], dtype=torch.float64)
        position = torch.arange(R)
        assert torch.equal(kernel_sample(logits, settings, position), core_sample(logits, settings, position))


def test_the_kernels_draw_is_each_rows_own_and_picks_among_ties_by_value():
    """A row draws the same token alone as among others. Of tied values (bf16 logits), a top-k row may take
    another id than the core, never another value; a row with no top-k draws in id order, the core's token. A
    top-k row of one value, whose ties run past every doubling of its candidates, holds every id in id order:
    its token is the column of the core's inverse CDF over equal weights, floor(u V)."""
    R, V = 32, 5000
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(R, V, generator=g) * 2).bfloat16().float()
    logits[:2] = 1.5  # every id tied, in two top-k rows
    position = torch.randint(0, 1000, (R,), generator=g)
    rows = torch.cat([settings_rows(R // 4, *c, seed=i) for i, c in enumerate(SETTINGS[1:5])])
    tokens = kernel_sample(logits, rows, position)
    want = core_sample(logits, rows, position)
    assert torch.equal(logits.gather(1, tokens[:, None]), logits.gather(1, want[:, None]))
    uncut = rows[:, 1] == 0
    assert torch.equal(tokens[uncut], want[uncut])
    for r in range(0, R, 5):
        assert kernel_sample(logits[r : r + 1], rows[r : r + 1], position[r : r + 1]).item() == tokens[r]
    u = uniform(rows[:2, 4].long(), position[:2]).float()
    assert tokens[:2].tolist() == (u * V).floor().long().clamp(max=V - 1).tolist()


def test_the_kernels_draw_reads_ties_past_its_candidates_and_float64_argmaxes():
    """A top-k row whose ties with its k-th run past its k best and one more holds them all in top-p's mass (a
    review found it cut among the first two); a float64 greedy row takes the argmax of its float64 logits, not of
    their float32 rounding."""
    logits = torch.full((1, 200), -20.0)
    logits[:, 0], logits[:, 1], logits[:, 2:12] = 0.0, -0.5, -1.0
    rows = settings_rows(1, 1.0, 3, 0.6, 0.0)
    drawn = [int(kernel_sample(logits, rows, torch.tensor([p]))) for p in range(60)]
    want = [int(core_sample(logits, rows, torch.tensor([p]))) for p in range(60)]
    assert logits[0, drawn].tolist() == logits[0, want].tolist()  # of tied ids, the same value
    assert set(drawn) & set(range(2, 12))  # a tied id drawn: the ten at -1 are in the mass
    wide = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)
    assert int(kernel_sample(wide, settings_rows(1, 0.0, 0, 1.0, 0.0), torch.tensor([0]))) == 1


def test_the_kernels_draw_survives_nan_and_infinite_rows():
    """NaN and rows of -inf give some id in range, as the core's garbage in gives garbage out, never a crash."""
    logits = torch.randn(6, 3000)
    logits[0, 17] = float("nan")
    logits[1] = float("-inf")
    logits[2, :100] = float("nan")
    rows = torch.cat([settings_rows(2, *c) for c in [(0.0, 0, 1, 0), (1.0, 0, 0.9, 0), (1.0, 30, 0.9, 0.1)]])
    tokens = kernel_sample(logits, rows, torch.arange(6))
    assert tokens.min() >= 0 and tokens.max() < 3000
    for setting in [(1.0, 0, 0.9, 0), (1.0, 30, 1, 0), (1.0, 0, 1, 0.1), (1.0, 0, 1, 0)]:  # sampled rows of one value
        for value in [float("-inf"), float("nan"), float("inf")]:
            row = torch.full((1, 3000), value)
            assert 0 <= int(kernel_sample(row, settings_rows(1, *setting), torch.tensor([4]))) < 3000
    assert tokens[0] == 17  # greedy: numpy's argmax, the first NaN


def test_a_draw_reads_no_weight_it_skipped():
    """A row without top-k or top-p weighs only the runs of 64 ids that hold one its min-p keeps, and leaves the
    other weights in its thread's scratch as the row before left them. Rows of NaN drawn through top-p first fill
    every weight with NaN; peaked rows after them, at a vocabulary no multiple of 64, draw the core's tokens."""
    V, threads = 50_037, torch.get_num_threads()
    g = torch.Generator().manual_seed(7)
    nan_rows = torch.full((2, V), float("nan"))
    logits = torch.randn(16, V, generator=g) * 4  # min-p 0.05 keeps a handful of ids
    position = torch.randint(0, 1000, (16,), generator=g)
    torch.set_num_threads(1)  # one thread: every row reads the scratch the NaN rows filled
    try:
        for setting in [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3), (1.0, 0, 1.0, 0.0), (1.0, 50, 1.0, 0.1)]:
            kernel_sample(nan_rows, settings_rows(2, 1.0, 0, 0.9, 0.0), torch.arange(2))
            rows = settings_rows(16, *setting, seed=11)
            assert torch.equal(kernel_sample(logits, rows, position), core_sample(logits, rows, position)), setting
    finally:
        torch.set_num_threads(threads)


def peaked_rows(R, V, g):
    """Rows whose top-p cut lies within 8 nats of their best (randn x 4), among them ties (bf16), a best that rises
    late in the row, a first run of -inf and GPT-2's padded ids; rows whose cut lies deeper (a best, then 300 ids
    7.5 nats below it and 3,000 at 9); flat rows (randn x 0.7)."""
    logits = torch.randn(R, V, generator=g) * 4
    logits[: R // 8] = logits[: R // 8].bfloat16().float()
    logits[R // 8 : R // 4, V - 1000] += 14  # the best so far rises late: the sums so far are rescaled
    logits[R // 4 : R // 4 + 2, :64] = float("-inf")
    deep = slice(R - R // 4, R - R // 8)
    logits[deep] = -40.0
    logits[deep, 0], logits[deep, 100:400], logits[deep, 1000:4000] = 0.0, -7.5, -9.0
    logits[R - R // 8 :] = torch.randn(R // 8, V, generator=g) * 0.7
    logits[:, 50257:] = float("-inf")
    return logits


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.3])
def test_the_kernels_top_p_on_peaked_rows_equals_the_cores(temperature):
    """A top-p row whose cut lies within 8 nats of its best (a trained model's, mostly) takes its cut from those few
    values alone, the rest of the row weighed by the float32 exp; a row whose cut lies deeper, or a flat one, takes
    the histogram's path: every row, with top-p alone and with min-p beside it, draws the core's token."""
    R, V = 48, 50304
    g = torch.Generator().manual_seed(int(temperature * 10))
    logits = peaked_rows(R, V, g)
    for top_p, min_p in [(0.9, 0.0), (0.5, 0.0), (0.99, 0.0), (0.9, 0.02)]:
        for rep in range(3):
            rows = settings_rows(R, temperature, 0, top_p, min_p, seed=100 * rep)
            position = torch.randint(0, 100_000, (R,), generator=g)
            assert torch.equal(kernel_sample(logits, rows, position), core_sample(logits, rows, position))


def rest_heavy_rows(R, candidates=0):
    """A review's rows (its reproducers, 2026-12-07): the best, 200,000 ids tied ~8.15 nats below it at temperature
    1.955..., where top-p's peaked path weighs them by the float32 exp of a product (~1e-6 light against the core's:
    past its first margin), and 100 ids 3 nats below the best, so that the cut may fall among its candidates;
    candidates: that many more, 7.9 nats below, to bring the candidates near the path's capacity. -> the rows, the
    temperature, and the top_p values of 30 consecutive float32s around 1 / the row's weight (where the cut moves)."""
    t, c, V = 1.9552539587020874, -15.932278633117676, 200_064
    x = torch.full((R, V), -1000.0)
    x[:, 0], x[:, 1:101] = 0.0, -3 * t
    x[:, 101 : 101 + candidates] = -7.9 * t
    x[:, 101 + candidates : 200_101] = c
    total = (x[:1] / torch.tensor(t)).clamp(-87.0).exp().double().sum().item()
    p = np.float32(1 / total)
    for _ in range(14):
        p = np.nextafter(p, np.float32(0))
    top_ps = []
    for _ in range(30):
        top_ps.append(float(p))
        p = np.nextafter(p, np.float32(1))
    return x, t, top_ps


def test_the_kernels_top_p_cut_holds_where_its_float32_weights_of_the_rest_round_apart():
    """Rows whose rest, weighed in float32 by top-p's peaked path, is most of their weight: where the core's cut
    could lie on either side of the path's, the row takes the histogram's path, and draws the core's token at every
    top_p where the cut moves (a review found 8 and 9 top_p values that drew others, before the margins)."""
    x, t, top_ps = rest_heavy_rows(4)
    position = torch.arange(4) * 12345
    for top_p in top_ps:
        rows = settings_rows(4, t, 0, top_p, 0.0, seed=3)
        assert torch.equal(kernel_sample(x, rows, position), core_sample(x, rows, position)), top_p


@pytest.mark.parametrize("width", [0, 1, 5, 20])
def test_the_kernels_scores_equal_logprobs_own_to_float32s_rounding(width):
    """score_rows against ext/logprobs.py's scores() on float32 rows of GPT-2's padded vocabulary: each target's
    rank and the likeliest ids equal (no ties in randn), the logprobs within float32's rounding of their sums."""
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(37, 50304, generator=g) * 3
    logits[:, 50257:] = float("-inf")
    targets = torch.randint(0, 50257, (37,), generator=g)
    targets[0] = logits[0].argmax()
    got, want = kernel_scores(logits, targets, width), scores(logits, targets, width)
    for name, a, b in zip(["logprob", "rank", "top ids", "top logprobs"], got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5, err_msg=name)
    assert got[1][0] == 1
    one = kernel_scores(logits[3:4], targets[3:4], width)  # a row alone: its own thread's sums, the same bits
    assert all(np.array_equal(a[3:4], b) for a, b in zip(got, one))
    with pytest.raises(ValueError, match="width 6 must be in 0..5"):  # found by review: it read past the row
        kernel_scores(logits[:2, :5], targets[:2] % 5, 6)


@pytest.mark.parametrize("width", [0, 1, 5, 20])
def test_scores_taken_as_the_rows_are_drawn_are_score_rows_own(width):
    """sample_rows scoring the rows it marks, as it draws them, gives kernel_sample's tokens and, at those rows,
    kernel_scores' scores of them, bit for bit: on every setting (top-k rows with fewer candidates than the width
    among them, which select their likeliest ids again), on rows tied past a top-k row's candidates, rows with
    NaN and -inf, and short rows."""
    for V, scale in [(50304, 0.5), (2048, 3.0), (30, 10.0)]:
        R = 2 * len(SETTINGS)
        g = torch.Generator().manual_seed(V + width)
        logits = torch.randn(R, V, generator=g) * scale
        logits[0, 5], logits[1, :7], logits[2] = float("nan"), float("-inf"), 1.0  # NaN, -inf, one value
        logits[3] = (logits[3] * 4).round()  # ties past a top-k row's k best and one more
        position = torch.randint(0, 1000, (R,), generator=g)
        rows = torch.cat([settings_rows(2, *c, seed=i) for i, c in enumerate(SETTINGS)])
        rows[:, 1] = rows[:, 1].clamp(max=V)
        scored = torch.rand(R, generator=g) < 0.7
        tokens, got = kernel_sample_scored(logits, rows, position, scored, min(width, V))
        assert torch.equal(tokens, kernel_sample(logits, rows, position))
        want = kernel_scores(logits, tokens, min(width, V))
        for a, b in zip(got, want):
            assert np.array_equal(a[scored.numpy()], b[scored.numpy()], equal_nan=True)


@pytest.mark.parametrize("lanes", [4, 16])
def test_the_kernels_draw_and_scores_are_the_same_bits_at_every_vector_width(lanes, monkeypatch, fresh_cache):
    """ext/sample.c's vectors are the CPU's widest (16 floats with AVX-512, 8 with AVX): a build at another width
    draws the same tokens and gives the same scores, bit for bit, on rows whose length is no multiple of 16 (on an
    AVX2 EPYC, gcc 12 compiled 16-float vectors to scalar code, 10x slower: so the width follows the CPU)."""
    R, V = 2 * len(SETTINGS), 50257
    g = torch.Generator().manual_seed(lanes)
    logits = torch.randn(R, V, generator=g) * 2
    position = torch.randint(0, 1000, (R,), generator=g)
    rows = torch.cat([settings_rows(2, *c, seed=i) for i, c in enumerate(SETTINGS)])
    targets = torch.randint(0, V, (R,), generator=g)
    peaked, top_p = peaked_rows(16, V, g), settings_rows(16, 1.0, 0, 0.9, 0.0)  # top-p's path for peaked rows
    full, t, top_ps = rest_heavy_rows(2, candidates=200_064 // 32 + 512 - 110)  # near its capacity
    full_rows = [settings_rows(2, t, 0, p, 0.0, seed=3) for p in top_ps]
    native = kernel_sample(logits, rows, position), kernel_scores(logits, targets, 5)
    every = torch.ones(R, dtype=torch.bool)
    native_scored = kernel_sample_scored(logits, rows, position, every, 5)[1]  # scored as drawn
    native_peaked = [kernel_sample(peaked, top_p, position[:16])] + [
        kernel_sample(full, r, position[:2]) for r in full_rows
    ]
    monkeypatch.setitem(cpu_kernel.BUILD_FLAGS, "float", [f"-DLANES={lanes}"])
    cpu_kernel.load_kernel.cache_clear()
    assert torch.equal(kernel_sample(peaked, top_p, position[:16]), native_peaked[0])
    for r, want in zip(full_rows, native_peaked[1:]):  # the path taken, the same at every width (a review's find)
        assert torch.equal(kernel_sample(full, r, position[:2]), want)
    assert torch.equal(kernel_sample(logits, rows, position), native[0])
    assert all(np.array_equal(a, b) for a, b in zip(kernel_scores(logits, targets, 5), native[1]))
    assert all(
        np.array_equal(a, b) for a, b in zip(kernel_sample_scored(logits, rows, position, every, 5)[1], native_scored)
    )


def test_kernel_attend_refuses_what_it_cannot_read():
    q, k_pool, v_pool, table, kv_len = random_rows(3, 2, 32, 4, num_blocks=20, dtype=torch.float32)
    cases = [
        ((q, k_pool.bfloat16(), v_pool.bfloat16(), table, kv_len), "of one dtype"),
        ((q.half(), k_pool.half(), v_pool.half(), table, kv_len), "not torch.float16"),
        ((q, k_pool, v_pool, table.int(), kv_len), "int64"),
        ((q, k_pool.transpose(1, 2), v_pool, table, kv_len), "contiguous"),
        ((q, k_pool, v_pool, table, kv_len + 4 * 4), "past its table"),  # more keys than 4 blocks of 4
        ((q, k_pool, v_pool, table.clone().fill_(21), kv_len), "or the pool"),  # 20 blocks and the padding one
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel_attend(*args)


def test_invariance_is_refused_with_the_kernel(model):
    """The batch-invariant forward's own rows would run instead of the kernel: refused, as with graph and step."""
    with pytest.raises(ValueError, match="not with compile 'kernel'"):
        ServingEngine(model, num_blocks=10, compile="kernel", invariant=True)


def test_the_kernel_is_refused_off_the_cpu(model):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(ValueError, match="compile 'kernel' is a CPU kernel"):
        ServingEngine(copy.deepcopy(model).cuda(), num_blocks=10, compile="kernel")
