"""Speculative decoding by prompt lookup (ext/speculative.py): in float64, every output equals plain decoding's
token for token, greedy and sampled, with eos and max_new_tokens inside an accepted run, under preemption by
recompute and by swap, with prefix-cache hits, later arrivals, n samples and beams (which do not speculate), at
block sizes 1, 3 and 16; rejected tokens are rolled back exactly (the invariant checker runs after every step)."""

import json
import random
import re

import pytest
from conftest import baseline, make_requests, run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_eos import common_token
from test_robust import run_random_workload, workloads

import generate
from ext import ServingEngine
from ext.speculative import NgramIndex
from harness.metrics import Meter
from paged import blocks_for
from sequence import Request, SamplingParams, SequenceStatus


def repetitive_prompts(n, seed, vocab=300):
    """Prompts that repeat their own phrases, so that prompt lookup finds proposals, right and wrong."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        for _ in range(rng.randint(1, 4)):
            prompt += phrase + [rng.randrange(vocab) for _ in range(rng.randint(0, 2))]
        prompts.append(prompt[:30])
    return prompts


def totals(engine):
    """proposed, accepted and verify steps, over every request the engine speculated for (its Meter heard)."""
    return [sum(stats[i] for stats in engine.meter.speculation.values()) for i in range(3)]


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.propose(tokens, 4) == [7, 5, 1, 2]  # [1, 2, 3] last occurred before 7, not before 9
    assert NgramIndex(max_n=3).propose([4, 8, 1, 2, 8], 2) == [1, 2]  # only [8] matches: one token long
    assert NgramIndex(max_n=3).propose([4, 5, 6], 3) == []  # no suffix occurred before
    tokens += [7, 5]  # the index grows with the tokens
    assert index.propose(tokens, 3) == [1, 2, 3]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("k", [1, 4])
def test_speculation_gives_plain_decodings_tokens_greedy_and_sampled(model, block_size, k):
    prompts = repetitive_prompts(10, block_size + k)
    news = [random.Random(i).randint(1, 30) for i in range(10)]  # max_new_tokens often ends an accepted run
    # the random model's logits are nearly flat: at 0.05 a draw often matches a proposal, at 0.9 almost never
    counts = []
    for temperature, top_k in [(0.0, None), (0.05, 40), (0.9, 40)]:
        want = baseline(model, prompts, news, temperature, top_k)
        engine = ServingEngine(model, num_blocks=200, block_size=block_size, num_speculative_tokens=k)
        assert run_engine(engine, make_requests(prompts, news, temperature, top_k), check=True) == want
        counts.append(totals(engine))
        assert engine.allocator.num_free() == 200
    proposed, accepted, steps = map(sum, zip(*counts))
    assert 0 < accepted < proposed and steps > 0, "no proposal was both accepted and rejected"
    assert all(c[0] > 0 for c in counts), "a run proposed nothing"


def test_eos_inside_an_accepted_run_stops_there(model):
    prompts = repetitive_prompts(8, 7)
    plain = [Request(p, 24) for p in prompts]
    run_engine(ServingEngine(model, num_blocks=100, block_size=4), plain)
    eos = common_token([r.generated for r in plain])
    want = [Request(p, 24, SamplingParams(eos=eos)) for p in prompts]
    run_engine(ServingEngine(model, num_blocks=100, block_size=4), want)
    got = [Request(p, 24, SamplingParams(eos=eos)) for p in prompts]
    engine = ServingEngine(model, num_blocks=100, block_size=4, num_speculative_tokens=4)
    run_engine(engine, got, check=True)
    assert [r.generated for r in got] == [r.generated for r in want]
    assert any(r.generated[-1] == eos and len(r.generated) < 24 for r in got), "no sequence stopped at eos"
    assert totals(engine)[1] > 0


@pytest.mark.parametrize("swap", [False, True])
def test_preemption_between_verify_steps_recomputes_or_swaps_to_plain_decodings_tokens(model, swap):
    prompts = repetitive_prompts(12, 11)
    news = [30] * 12
    want = baseline(model, prompts, news, 0.05, 40)
    kw = dict(num_blocks=24, block_size=4, token_budget=48, max_batch=8, num_speculative_tokens=4)
    engine = ServingEngine(model, swap_blocks=48 if swap else 0, **kw)
    assert run_engine(engine, make_requests(prompts, news, 0.05, 40), check=True) == want
    assert engine.meter.num_preemptions > 0 and totals(engine)[1] > 0
    assert (engine.meter.swapped_out_blocks > 0) == swap
    assert engine.allocator.num_free() == 24


def test_prefix_hits_later_arrivals_and_samples_each_speculating_on_its_own(model):
    shared = repetitive_prompts(1, 3)[0][:12]
    prompts = [shared + p for p in repetitive_prompts(6, 5)]
    params = [SamplingParams(temperature=0.9, top_k=40, seed=10 * i, n=3) for i in range(3)]
    params += [SamplingParams(seed=i) for i in range(3)]
    requests = [Request(p, 20, sp) for p, sp in zip(prompts, params)]
    want = [Request(p, 20, sp) for p, sp in zip(prompts, params)]
    arrivals = [0, 0, 3, 5, 9, 14]
    run_engine(ServingEngine(model, num_blocks=120, block_size=4), want, arrivals)
    engine = ServingEngine(model, num_blocks=120, block_size=4, num_speculative_tokens=3)
    run_engine(engine, requests, arrivals, check=True)
    assert [[s.generated for s in r.sequences] for r in requests] == [[s.generated for s in r.sequences] for r in want]
    assert engine.meter.cached_tokens > 0 and totals(engine)[1] > 0
    forks = {r for r in engine.meter.speculation if r.params.n > 1}
    assert forks, "no request of samples speculated"


def test_beams_do_not_speculate_beside_requests_that_do(model):
    prompts = repetitive_prompts(4, 2)
    want = [Request(prompts[0], 12, SamplingParams(num_beams=3))] + [Request(p, 12) for p in prompts[1:]]
    run_engine(ServingEngine(model, num_blocks=100, block_size=4), want)
    got = [Request(prompts[0], 12, SamplingParams(num_beams=3))] + [Request(p, 12) for p in prompts[1:]]
    engine = ServingEngine(model, num_blocks=100, block_size=4, num_speculative_tokens=4)
    run_engine(engine, got, check=True)
    assert [[s.generated for s in r.sequences] for r in got] == [[s.generated for s in r.sequences] for r in want]
    assert got[0] not in engine.meter.speculation and totals(engine)[1] > 0


def test_rejected_slots_return_their_blocks_at_once(model):
    """After every step, a sequence holds no block past its tokens (as check_invariants checks too), and the blocks
    a verify step allocated for proposals it rejected are free again."""
    prompts = repetitive_prompts(4, 13)
    engine = ServingEngine(model, num_blocks=60, block_size=1, num_speculative_tokens=8)
    engine.meter = Meter(engine)
    requests = make_requests(prompts, [25] * 4, 0.05, 40)
    for r in requests:
        engine.add(r)
    while engine.waiting or engine.running:
        engine.step()
        for s in engine.running:
            assert len(s.block_table) <= blocks_for(len(s.tokens), engine.block_size)
    proposed, accepted, _ = totals(engine)
    assert proposed > accepted > 0 and engine.allocator.num_free() == 60


def count_revivals(engine):
    """Wrap check_guesses so that engine.revived counts the guesses that were the token drawn."""
    check_guesses = engine.check_guesses
    engine.revived = 0

    def counted(samplers, tokens):
        engine.revived += sum(engine.guesses.get(x.sequence) == token for x, token in zip(samplers, tokens))
        check_guesses(samplers, tokens)

    engine.check_guesses = counted


def test_auto_follows_each_sequences_acceptance_down_to_guessing_and_back(model):
    """auto proposes what acceptance earns: many tokens where draws follow the prompt (greedy, repetitive prompts),
    few where they rarely do (temperature 0.9), where a sequence soon proposes nothing and only guesses; a right
    guess brings its proposals back. Outputs equal plain decoding's throughout."""
    prompts = repetitive_prompts(6, 21)
    news = [40] * 6
    figures = {}
    for temperature in [0.0, 0.9]:
        want = baseline(model, prompts, news, temperature, 40)
        for k in [4, "auto"]:
            engine = ServingEngine(model, num_blocks=100, block_size=4, max_batch=6, num_speculative_tokens=k)
            count_revivals(engine)
            assert run_engine(engine, make_requests(prompts, news, temperature, 40), check=True) == want
            figures[temperature, k] = totals(engine)
            assert not engine.guesses and not engine.auto_tokens  # nothing kept for finished sequences
        assert engine.revived > 0 or temperature == 0, "no guess brought proposals back"
    assert figures[0.9, "auto"][0] < figures[0.9, 4][0] / 2, "auto kept proposing what was rejected"
    greedy = figures[0.0, "auto"]
    assert greedy[0] > greedy[1] > 0.9 * figures[0.0, 4][1], "auto held back where proposals are accepted"


def test_auto_leaves_the_budget_to_prompts_waiting_to_prefill(model):
    """auto proposes nothing in a step while a prompt prefills or waits with a row free for it: proposals would
    take its tokens' place in the step's budget. It speculates again once every prompt is in."""
    prompts = repetitive_prompts(4, 5)
    engine = ServingEngine(
        model, num_blocks=100, block_size=4, token_budget=8, max_batch=4, num_speculative_tokens="auto"
    )
    steps = []
    schedule_decodes = engine.schedule_decodes

    def recorded():
        plan = schedule_decodes()
        waiting = any(s.status is SequenceStatus.PREFILLING for s in engine.running) or engine.waiting
        steps.append((bool(waiting), bool(engine.proposing)))
        return plan

    engine.schedule_decodes = recorded
    want = baseline(model, prompts, [30] * 4)
    assert run_engine(engine, [Request(p, 30) for p in prompts], arrivals=[0, 0, 6, 12], check=True) == want
    assert (True, True) not in steps, "proposals took a prompt's budget"
    assert (False, True) in steps, "auto never speculated once the prompts were in"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(w=workloads(), k=st.sampled_from([1, 2, 4, "auto"]))
def test_random_workloads_with_speculation_keep_invariants_and_match_the_baseline(model, w, k):
    engine = run_random_workload(model, w, ServingEngine, num_speculative_tokens=k)
    assert engine.allocator.num_free() == w["num_blocks"] and not engine.proposing


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_speculative_tokens=-1), "num_speculative_tokens -1 must be an int >= 0 or 'auto'"),
        (dict(num_speculative_tokens="many"), "num_speculative_tokens 'many' must be an int >= 0 or 'auto'"),
        (dict(prompt_lookup_max=0), "prompt_lookup_max is 0; it must be at least 1"),
    ],
)
def test_bad_speculation_settings_are_refused_in_one_line(model, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        ServingEngine(model, num_blocks=8, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num-speculative-tokens", "-2"],
            "error: argument --num-speculative-tokens: '-2' is not a number >= 0 or auto",
        ),
        (
            ["--num-speculative-tokens", "x"],
            "error: argument --num-speculative-tokens: 'x' is not a number >= 0 or auto",
        ),
        (["--prompt-lookup-max", "0"], "error: argument --prompt-lookup-max: 0 is below 1"),
        (["--prompt-lookup-max", "2"], "error: --prompt-lookup-max needs --num-speculative-tokens"),
    ],
)
def test_bad_speculation_flags_get_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--paged", *argv])
    assert str(e.value.code).startswith(message) and "\n" not in str(e.value.code)


def test_generate_reports_speculation_per_request_and_in_all_with_plain_decodings_tokens(ckpt, tmp_path, capsys):
    runs = {}
    for name, flags in [("plain", []), ("speculative", ["--num-speculative-tokens", "4"])]:
        out = tmp_path / f"{name}.json"
        argv = ["--ckpt", ckpt, "--paged", "--prompt", "a b a b a b", "--prompt", "c d c d", "--temperature", "0"]
        generate.main(argv + ["--max-new-tokens", "24", "--json", str(out), *flags])
        runs[name] = json.loads(out.read_text())
    text = capsys.readouterr().out
    tokens = [[r["output_tokens"] for r in run["requests"]] for run in runs.values()]
    assert tokens[0] == tokens[1]
    m, requests = runs["speculative"]["metrics"], runs["speculative"]["requests"]
    per_request = [r["speculation"] for r in requests if "speculation" in r]
    assert per_request and m["spec_proposed_tokens"] == sum(r["proposed_tokens"] for r in per_request) > 0
    assert m["spec_accepted_tokens"] == sum(r["accepted_tokens"] for r in per_request)
    assert m["spec_verify_steps"] == sum(r["verify_steps"] for r in per_request)
    assert "spec_proposed_tokens" not in runs["plain"]["metrics"]
    assert re.search(r"--- speculation in all: \d+ of \d+ proposed tokens accepted", text)


def test_tokens_per_verify_step_count_only_the_tokens_kept_before_an_eos():
    """An eos inside an accepted run drops the draws after it: the Meter's accepted tokens are those that became
    tokens, so tokens per verify step is what the verify steps appended (they were counted though dropped)."""
    from ext import engine_class
    from harness.checkpoints import SHIPPED, get_tokenizer, load_checkpoint
    from harness.metrics import Meter, speculation
    from harness.observer import Observer

    model = load_checkpoint(SHIPPED)
    enc = get_tokenizer(model.config.vocab_size)
    prompt = enc.encode("ROMEO:\nI will.\nJULIET:\nI will.\nROMEO:\nI will.\nJULIET:\n")

    class Appended(Observer):  # what each verify step appended to its sequence
        def __init__(self):
            self.rows = []

        def planned(self, plan):
            self.before = {s: (len(s.tokens), bool(s.proposed)) for s, _ in plan}

        def stepped(self):
            self.rows += [len(s.tokens) - n for s, (n, proposing) in self.before.items() if proposing]

    def run(eos):
        engine = engine_class(speculative=True)(model, num_blocks=64, num_speculative_tokens=4, compile="off")
        meter, appended = Meter(engine), Appended()
        engine.observers.append(appended)
        r = Request(prompt, 40, SamplingParams(eos=eos))
        engine.run([r])
        return r, meter, appended.rows

    r, _, _ = run(None)
    eos = r.generated[r.generated.index(198) if 198 in r.generated else 0]  # a newline, inside accepted runs
    r, meter, rows = run(eos)
    assert rows and r.generated[-1] == eos
    figures = speculation(meter.proposed_tokens, meter.accepted_tokens, meter.verify_steps)
    assert meter.verify_steps == len(rows) and figures["spec_tokens_per_verify"] == sum(rows) / len(rows)
