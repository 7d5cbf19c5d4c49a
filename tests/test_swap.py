"""Swap preemption: a victim's K/V go to the swap space and come back, token for token what recomputing gives."""

import json
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import check_invariants, run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fork import reference_beam_search, samples_as_separate_requests
from test_readme_commands import readme_commands
from test_robust import run_random_workload, workloads

import generate
from ext import ServingEngine
from harness.observer import Observer
from sequence import Request, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def outputs(requests):
    return [[s.generated for s in r.sequences] for r in requests]


def leaks_nothing(engine):
    """Every count back to zero: the pool's holds, and the swap space's blocks all free."""
    assert not engine.running and not engine.waiting
    assert engine.allocator.num_free() == engine.allocator.num_blocks and sum(engine.allocator.ref_count) == 0
    assert sorted(engine.free_swap) == list(range(engine.swap_space.shape[2]))


def mixed_requests(prompts, seed=0):
    """Plain greedy and sampled requests, n samples that fork, and beam groups, over the same prompts."""
    kinds = [dict(), dict(temperature=0.9, top_k=40), dict(n=3, temperature=0.9), dict(num_beams=3)]
    return [Request(p, 10, SamplingParams(seed=seed + i, **kinds[i % 4])) for i, p in enumerate(prompts)]


def storm_prompts(seed, n, block_size):
    """Prompts whose heads repeat (prefix-cache hits), long enough to fill a small pool many times over."""
    rng = random.Random(seed)
    heads = [[rng.randrange(300) for _ in range(2 * block_size + 1)] for _ in range(2)]
    return [rng.choice(heads)[: rng.randint(1, 2 * block_size + 1)] + [rng.randrange(300)] for _ in range(n)]


@pytest.mark.parametrize("block_size, num_blocks", [(1, 70), (3, 30), (16, 10)])
def test_swap_equals_the_baseline_and_recompute_token_for_token_under_a_preemption_storm(model, block_size, num_blocks):
    """float64: plain and sampled requests against the contiguous baseline; n samples and beams against the
    oracles and against the same run recomputing. Prefix hits, forks and beams all share blocks with their
    victims, and returning victims share cached blocks again; the invariants, swap space included, hold after
    every step."""
    prompts = storm_prompts(block_size, 12, block_size)
    kw = dict(num_blocks=num_blocks, block_size=block_size, token_budget=24, max_batch=12)
    recompute = mixed_requests(prompts)
    recomputing = ServingEngine(model, **kw)
    run_engine(recomputing, recompute, check=True)
    swapped = mixed_requests(prompts)
    engine = ServingEngine(model, swap_blocks=4 * num_blocks, **kw)
    run_engine(engine, swapped, check=True)
    assert outputs(swapped) == outputs(recompute)
    for r, p in zip(swapped, prompts):
        if r.params.num_beams > 1:
            assert outputs([r])[0] == reference_beam_search(model, p, 10, 3)
        else:  # n samples, or one, on the contiguous baseline
            params = r.params
            oracle = samples_as_separate_requests(model, p, 10, params.n, params.seed, params.temperature, params.top_k)
            assert outputs([r])[0] == oracle
    meter = engine.meter
    assert meter.num_preemptions >= 5 and meter.swapped_out_blocks > 0 and meter.swap_fallbacks == 0
    # what comes back is copied, less the blocks a returning sequence finds in the prefix cache
    assert 0 < meter.swapped_in_blocks <= meter.swapped_out_blocks
    # swap recomputes only the last token of a beam that held its logprobs when preempted
    assert meter.recomputed_tokens < 0.2 * recomputing.meter.recomputed_tokens
    leaks_nothing(engine)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_blocks_a_victim_shares_with_a_running_fork_stay_with_it_and_are_shared_again_on_return(model, prefix_cache):
    """n = 2 samples share their prompt's two full blocks; the newer fork is preempted while the older runs on.
    The shared blocks stay in the pool, held by the older; the victim's K/V, all of them, go to the swap space.
    On its return the prefix cache finds the prompt blocks, still held, and only the rest is copied back; without
    the prefix cache all of it is."""
    engine = ServingEngine(model, num_blocks=7, block_size=4, token_budget=32, max_batch=4, swap_blocks=8)
    engine.prefix_cache = prefix_cache
    out, back = [], []

    class Victims(Observer):
        def preempted(self, victim):
            [sibling] = [s for s in victim.request.sequences if s is not victim]
            prompt_blocks = sibling.block_table[:2]
            assert [engine.allocator.ref_count[b] for b in prompt_blocks] == [1, 1], "the sibling lost a block"
            out.append((len(engine.swapped[victim]), sibling in engine.running))

        def swapped_in(self, sequence, num_blocks):
            back.append(num_blocks)

    engine.observers.append(Victims())
    r = Request(list(range(1, 9)), 16, SamplingParams(temperature=0.9, seed=5, n=2))
    run_engine(engine, [r], check=True)
    assert outputs([r])[0] == samples_as_separate_requests(model, list(range(1, 9)), 16, 2, 5, 0.9)
    assert out and all(num_blocks > 2 and running for num_blocks, running in out), out
    hits = [swapped - copied for (swapped, _), copied in zip(out, back)]
    # the prompt's blocks at least; the victim's own full blocks too, if still cached
    assert all(h >= 2 for h in hits) if prefix_cache else not any(hits), (out, back)
    leaks_nothing(engine)


@pytest.mark.parametrize("swap_blocks", [1, 6])
def test_a_swap_space_too_small_recomputes_the_victims_it_cannot_take_and_counts_them(model, swap_blocks):
    prompts = storm_prompts(7, 10, 4)
    kw = dict(num_blocks=16, block_size=4, token_budget=16, max_batch=8)
    recompute = mixed_requests(prompts)
    run_engine(ServingEngine(model, **kw), recompute)
    swapped = mixed_requests(prompts)
    engine = ServingEngine(model, swap_blocks=swap_blocks, **kw)
    run_engine(engine, swapped, check=True)
    assert outputs(swapped) == outputs(recompute)
    assert engine.meter.swap_fallbacks > 0 and engine.meter.recomputed_tokens > 0
    assert (engine.meter.swapped_out_blocks > 0) == (swap_blocks > 1)
    leaks_nothing(engine)


@st.composite
def pressed_workloads(draw):
    """test_robust's workloads() under pressure: a pool at most 3 blocks above the largest request, at least two
    rows, arrivals within 3 steps. About a third of the draws swap (39 of the test's 120, derandomized, counted
    2026-11-28; test_robust's own pools, rows and arrivals: one in ten); the storm tests above assert swapping."""
    w = draw(workloads())
    bs = w["block_size"]
    fits_one = max(-(-(len(p) + m - 1) // bs) for p, m in zip(w["prompts"], w["news"]))
    w.update(num_blocks=fits_one + draw(st.integers(0, 3)), max_batch=max(2, w["max_batch"]))
    w["arrivals"] = [at // 4 for at in w["arrivals"]]
    return w


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(w=pressed_workloads())
def test_random_workloads_with_swap_keep_invariants_and_match_the_baseline(model, w):
    leaks_nothing(run_random_workload(model, w, ServingEngine, swap_blocks=1 + w["num_blocks"] // 2))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_random_forks_and_beams_swapped_under_pressure_equal_recomputing_them(model, data):
    """Samples, beams and plain requests in pools down to the largest request, with a swap space from one block
    up: every sequence's tokens equal the recomputing engine's, and every invariant holds after every step."""
    block_size = data.draw(st.integers(1, 5))
    specs = []
    for i in range(data.draw(st.integers(3, 6))):
        prompt = data.draw(st.lists(st.integers(0, 299), min_size=1, max_size=12))
        kind = data.draw(st.sampled_from([dict(), dict(n=2, temperature=0.8), dict(n=3, temperature=0.8)]))
        kind = data.draw(st.sampled_from([kind, dict(num_beams=data.draw(st.integers(2, 3)))]))
        specs.append((prompt, data.draw(st.integers(6, 12)), kind, data.draw(st.integers(0, 3))))
    worst = max(-(-(len(p) + m - 1) // block_size) * kw.get("num_beams", 1) for p, m, kw, _ in specs)
    kw = dict(
        num_blocks=worst + data.draw(st.integers(0, 2)),
        block_size=block_size,
        token_budget=data.draw(st.integers(3, 24)),
        max_batch=6,
        prefix_cache=data.draw(st.booleans()),
    )

    def run(engine):
        requests = [Request(p, m, SamplingParams(seed=i, **k)) for i, (p, m, k, _) in enumerate(specs)]
        run_engine(engine, requests, [at for *_, at in specs], check=True)
        return outputs(requests)

    engine = ServingEngine(model, swap_blocks=data.draw(st.integers(1, 6 * worst)), **kw)
    assert run(engine) == run(ServingEngine(model, **kw))
    leaks_nothing(engine)


def test_meter_counts_swaps_both_ways_their_bytes_time_and_recomputed_tokens(model):
    prompts = storm_prompts(3, 10, 4)
    kw = dict(num_blocks=14, block_size=4, token_budget=16, max_batch=8, prefix_cache=False)
    engine = ServingEngine(model, swap_blocks=64, **kw)
    run_engine(engine, mixed_requests(prompts), check=True)
    meter = engine.meter
    # without the prefix cache every block comes back by copy
    assert meter.swapped_out_blocks == meter.swapped_in_blocks > 0 and meter.swap_fallbacks == 0
    assert meter.swap_out_s > 0 and meter.swap_in_s > 0
    from harness.metrics import metrics

    m = metrics(meter, 1.0, float("inf"), None)
    block_bytes = 2 * model.config.n_layer * 4 * model.config.n_embd * 8  # K and V, every layer, 4 slots, float64
    assert m["swap_mb"] * 2**20 == pytest.approx(2 * meter.swapped_out_blocks * block_bytes)
    assert m["preemption"] == "swap" and m["swap_blocks"] == 64 and m["preemptions"] == meter.num_preemptions
    recomputing = ServingEngine(model, **kw)
    run_engine(recomputing, mixed_requests(prompts))
    assert recomputing.meter.recomputed_tokens > 10 * max(1, meter.recomputed_tokens)
    assert recomputing.meter.recompute_s > 0 and metrics(recomputing.meter, 1.0, 1.0, None)["swap_mb"] == 0


def test_a_negative_swap_space_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match=re.escape("swap_blocks is -1; it must be >= 0")) as e:
        ServingEngine(model, num_blocks=8, swap_blocks=-1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preemption", "swap"], "error: --preemption swap needs --swap-blocks N"),
        (["--swap-blocks", "-1"], "error: argument --swap-blocks: -1 is below 0"),
        (["--preemption", "offload"], "error: argument --preemption: invalid choice: 'offload'"),
        (["--swap-blocks", "8"], "error: --swap-blocks needs --preemption swap"),
    ],
)
def test_bad_preemption_flags_get_one_line(argv, message, capsys):
    """The command line exits with the one line (sys.exit prints it to stderr, status 1), before it loads or
    serves anything."""
    with pytest.raises(SystemExit) as e:
        generate.main(["--paged", *argv])
    assert str(e.value.code).startswith(message) and "\n" not in str(e.value.code)
    assert capsys.readouterr().out == ""


def test_generate_reports_swaps_in_the_json_and_the_table_and_says_when_it_fell_back(ckpt, tmp_path, capsys):
    runs = {}
    for name, flags in [("recompute", []), ("swap", ["--preemption", "swap", "--swap-blocks", "64"])]:
        out = tmp_path / f"{name}.json"
        argv = ["--ckpt", ckpt, "--paged", "--num-requests", "12", "--prompt-len", "4:30", "--new-tokens", "10:30"]
        generate.main(argv + ["--num-blocks", "24", "--block-size", "4", "--json", str(out), *flags])
        runs[name] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert re.search(r"swapped_out_blocks\s+\d", text) and re.search(r"recomputed_tokens\s+\d", text)
    recompute, swap = runs["recompute"]["metrics"], runs["swap"]["metrics"]
    assert recompute["preemptions"] > 0 and recompute["recomputed_tokens"] > 0 and recompute["swapped_out_blocks"] == 0
    assert swap["swapped_out_blocks"] >= swap["swapped_in_blocks"] > 0 and swap["swap_mb"] > 0
    tokens = [[r["output_tokens"] for r in run["requests"]] for run in runs.values()]
    assert tokens[0] == tokens[1]
    argv = ["--ckpt", ckpt, "--paged", "--num-requests", "12", "--prompt-len", "4:30", "--new-tokens", "10:30"]
    generate.main(argv + ["--num-blocks", "24", "--block-size", "4", "--preemption", "swap", "--swap-blocks", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "recomputed instead of swapped" in line]
    assert len(lines) == 1 and "swap space of 1 blocks" in lines[0], lines


def test_check_invariants_catches_a_leaked_swap_block(model):
    engine = ServingEngine(model, num_blocks=8, block_size=4, swap_blocks=4)
    engine.free_swap.pop()
    with pytest.raises(AssertionError, match="a swap block leaked"):
        check_invariants(engine)
    engine.free_swap.append(engine.free_swap[0])
    with pytest.raises(AssertionError, match="a swap block is free twice"):
        check_invariants(engine)


# The two experiments, on the shipped model (their length mixes are scaled to its 256-token context), each run
# with the command its doc gives, at two of its block sizes and with fewer requests


def docs_command(doc, flag):
    """The one `python generate.py FLAG ...` command of docs/DOC's code blocks, as its argv."""
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    found = [argv for script, argv in readme_commands(text) if script == "generate.py" and flag in argv]
    assert len(found) == 1, f"docs/{doc} gives {len(found)} `python generate.py {flag} ...` commands, not one"
    return found[0]


def at_check_size(argv, flag, sizes, num_requests, tmp_path):
    """argv, parsed with today's flags as the doc gives it (in tmp_path, where its output folder lands), then cut
    to `sizes` of its block sizes and `num_requests` requests, its plot and JSON in tmp_path."""
    given = generate.parse_args(argv)
    assert given.compile == "off" and set(sizes) <= set(getattr(given, flag[2:].replace("-", "_")))
    changes = {flag: ",".join(map(str, sizes)), "--num-requests": str(num_requests)}
    changes.update({"--plot": str(tmp_path / "sweep.png"), "--json": str(tmp_path / "sweep.json")})
    argv = list(argv)
    for name, value in changes.items():
        if name in argv:
            argv[argv.index(name) + 1] = value
        else:
            argv += [name, value]
    return given, argv


def test_block_size_sweep_runs_both_mixes_at_every_block_size_and_plots_them(tmp_path, monkeypatch, capsys):
    """docs/block_size.md's command, at block sizes 4 and 64 and 4 requests: both length mixes at each block size,
    each run's figures, the table and the plot."""
    monkeypatch.chdir(tmp_path)
    given, argv = at_check_size(
        docs_command("block_size.md", "--sweep-block-sizes"), "--sweep-block-sizes", [4, 64], 4, tmp_path
    )
    generate.main(argv)
    runs = json.loads((tmp_path / "sweep.json").read_text())["block_sizes"]
    assert list(runs) == ["ShareGPT", "Alpaca"] and all(list(r) == ["4", "64"] for r in runs.values())
    for r in runs.values():
        assert all(m["normalized_latency_ms"] > 0 and m["block_size"] == int(b) for b, m in r.items())
        assert all(
            m["request_rate"] == given.request_rate and m["kv_budget_slots"] == given.kv_budget for m in r.values()
        )
        assert r["64"]["kv_allocated_peak_mb"] >= r["4"]["kv_allocated_peak_mb"] > 0  # 64-token blocks waste more
    text = capsys.readouterr().out
    assert "--- ShareGPT" in text and "--- Alpaca" in text and f"{given.threads} threads" in text
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_preemption_sweep_times_swap_and_recompute_and_runs_each_mode_under_pressure(tmp_path, monkeypatch, capsys):
    """docs/swap.md's command, at block sizes 4 and 32 and 16 requests (its KV budget kept): at each block size the
    microbenchmark's times, and the workload under each preemption mode, each preempting, the same tokens out."""
    monkeypatch.chdir(tmp_path)
    given, argv = at_check_size(
        docs_command("swap.md", "--sweep-preemption"), "--sweep-preemption", [4, 32], 16, tmp_path
    )
    generate.main(argv)
    points = json.loads((tmp_path / "sweep.json").read_text())["preemption"]
    assert [p["block_size"] for p in points] == [4, 32]
    for p in points:
        assert p["swap_out_ms"] > 0 and p["swap_in_ms"] > 0 and p["recompute_ms"] > 0
        recompute, swap = p["recompute"], p["swap"]
        assert recompute["preemption"] == "recompute" and recompute["swapped_out_blocks"] == 0
        assert swap["preemption"] == "swap" and swap["swap_blocks"] == given.kv_budget // p["block_size"]
        assert recompute["preemptions"] > 0 and recompute["recomputed_tokens"] > 0, p["block_size"]
        assert swap["preemptions"] > 0 and swap["swapped_out_blocks"] > 0 and swap["swap_fallbacks"] == 0
        assert recompute["output_tokens"] == swap["output_tokens"]
    assert "--- 16 sequences of 128 tokens preempted" in capsys.readouterr().out
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep-preemption", "4"], "error: --sweep-preemption needs --kv-budget"),
        (["--sweep-block-sizes", "4", "--prompt-len", "4:8"], "error: --sweep-block-sizes draws its own workloads"),
        (["--sweep-block-sizes", "4", "--sweep-preemption", "4", "--kv-budget", "64"], "takes no --sweep-preemption"),
        (["--sweep-block-sizes", "4", "--compile", "on"], "runs decode attention eager: it takes no --compile on"),
        (["--sweep-preemption", "4", "--kv-budget", "64", "--compile", "graph"], "it takes no --compile graph"),
        (["--sweep-block-sizes", "4", "--compile", "step"], "it takes no --compile step"),
        (["--sweep-block-sizes", "4,256", "--kv-budget", "128"], "error: --kv-budget 128 slots hold no block of 256"),
        (["--sweep-block-sizes", "4,0"], "error: argument --sweep-block-sizes: 0 is below 1"),
        (["--sweep-block-sizes", "4", "--pool-map", "x.png"], "error: --pool-map needs --paged"),
    ],
)
def test_bad_sweeps_get_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert message in str(e.value.code) and "\n" not in str(e.value.code)
    assert capsys.readouterr().out == "" and not any(tmp_path.iterdir()), "a refused sweep ran or wrote"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["off", "graph"])
def test_swap_on_cuda_gives_the_cpu_engines_tokens(model, compile):
    """On a GPU the swap space is pinned host memory and every swap crosses PCIe; the float64 engine there, with
    CUDA graphs or eager, gives the CPU engine's tokens under the same preemption storm, swapping throughout."""
    import copy

    prompts = storm_prompts(3, 12, 3)
    kw = dict(num_blocks=30, block_size=3, token_budget=24, max_batch=12, swap_blocks=120)
    on_cpu = mixed_requests(prompts)
    run_engine(ServingEngine(model, **kw), on_cpu, check=True)
    on_cuda = mixed_requests(prompts)
    engine = ServingEngine(copy.deepcopy(model).cuda(), compile=compile, **kw)
    assert engine.swap_space.is_pinned()
    run_engine(engine, on_cuda, check=True)
    assert outputs(on_cuda) == outputs(on_cpu) and engine.meter.swapped_out_blocks > 0
    leaks_nothing(engine)
