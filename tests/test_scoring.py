"""Scoring through the paged engine (harness/scoring.py) and lm-eval's model on it (harness/lm_eval_model.py): in
float64, loglikelihood and loglikelihood_rolling equal log_softmax of one full forward of the model over the same
tokens, and is_greedy an argmax check, under chunked prefill, preemption by recompute and by swap, prefix hits
and misses, at block sizes 1, 3 and 16; the prefix cache serves a question's context to its later choices, with
the same scores as without it; generate_until is greedy decoding cut at its stop strings; lm-eval run on the local
task with our model and with its own HF backend on the exported weights gives the same accuracy and per-choice
loglikelihoods within 1e-4 in float32; bad input is refused in one line, before the engine takes any of it."""

import logging
import os
import random
import sys

import pytest
import torch
from conftest import tiny_gpt
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import ext.invariant
from ext import engine_class
from harness import scoring
from harness.checkpoints import SHIPPED, export_hf, load_checkpoint
from harness.lm_eval_model import NanoGPTPaged
from harness.metrics import Meter
from harness.observer import Observer
from sequence import Request, SamplingParams, SequenceStatus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 64  # tiny_gpt's block_size
TOLERANCE = 1e-9  # float64


def full_logprobs(model, tokens):
    """log_softmax of the model's logits at every position of tokens, in one forward: (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor(tokens)[None])[0][0], -1)


def reference(model, context, continuation):
    """lm-eval's loglikelihood of a pair, from one forward over its last WINDOW tokens: (sum, is_greedy)."""
    tokens = (context + continuation)[-WINDOW:]
    logprobs = full_logprobs(model, tokens)
    start = len(tokens) - len(continuation[-(WINDOW - 1) :])
    picks = [
        (logprobs[q - 1, tokens[q]].item(), logprobs[q - 1].argmax().item() == tokens[q])
        for q in range(start, len(tokens))
    ]
    return sum(p for p, _ in picks), all(g for _, g in picks)


def rolling_reference(model, tokens, prefix_token):
    """lm-eval's own rolling windows (max_seq_len WINDOW - 1), each scored by a forward of its own."""
    windows = map(make_disjoint_window, get_rolling_token_windows(tokens, prefix_token, WINDOW - 1, 1))
    return sum(reference(model, context, continuation)[0] for context, continuation in windows)


def greedy_continuation(model, context, n):
    """The model's n greedy tokens after context, one full forward each: a continuation whose is_greedy is True."""
    tokens = list(context)
    for _ in range(n):
        tokens.append(full_logprobs(model, tokens[-WINDOW:])[-1].argmax().item())
    return tokens[len(context) :]


def pairs_workload(model, seed):
    """Questions of four choices on a shared context (prefix hits), single pairs (misses), greedy continuations,
    and pairs longer than the window (cut from the left)."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(300) for _ in range(n)]

    pairs = []
    for _ in range(3):
        context = ids(rng.randint(17, 40))
        choices = [ids(rng.randint(1, 12)) for _ in range(3)] + [greedy_continuation(model, context, 5)]
        pairs += [(context, choice) for choice in choices]
    pairs += [(ids(rng.randint(1, 30)), ids(rng.randint(1, 12))) for _ in range(4)]
    pairs += [(ids(60), ids(9)), (ids(3), ids(WINDOW - 1)), ([7], greedy_continuation(model, [7], 3))]
    return pairs


def generating(rng):
    """Requests that decode for long beside the scoring ones (which only prefill, and never grow): they take new
    blocks, and preempt the newest running when the pool runs out."""
    return [Request([rng.randrange(300) for _ in range(4)], 52, SamplingParams()) for _ in range(3)]


def preempt_mid_scoring(engine):
    """Before each step, the newest running sequence is preempted, as make_room would preempt it, if it is a
    scoring request whose prefill stopped inside its scored continuation, once each: every scoring request long
    enough to chunk there is recomputed (or swapped out and in) with some of its positions already scored."""
    schedule, preempted = engine.schedule, set()

    def preempting():
        s = engine.running[-1] if engine.running else None
        p = s and s.request.params
        scoring_now = p and p.prompt_logprobs is not None and s.status is SequenceStatus.PREFILLING
        if scoring_now and p.prompt_logprobs_from < s.num_computed < len(s.tokens) and s not in preempted:
            preempted.add(s)
            engine.preempt(s)
        return schedule()

    engine.schedule = preempting


class Watch(Observer):
    """What the tests ask of a run: the sequences preempted, each request's cached tokens at admission, and
    whether a prefill chunk ended inside a scored continuation."""

    def __init__(self, engine):
        self.preempted_scoring = 0
        self.cached = {}
        self.chunk_inside_scored = 0
        engine.observers.append(self)

    def planned(self, plan):
        for s, n in plan:
            p = s.request.params
            end = s.num_computed + n
            if s.status is SequenceStatus.PREFILLING and p.prompt_logprobs is not None:
                self.chunk_inside_scored += p.prompt_logprobs_from < end < len(s.request.prompt)

    def admitted(self, group):
        for s in group:
            self.cached.setdefault(s.request, s.num_computed)

    def preempted(self, sequence):
        self.preempted_scoring += sequence.request.params.prompt_logprobs is not None


@pytest.fixture
def unchecked_invariance(monkeypatch):
    """invariant=True with its check of the kernels passed by hand (16 rows, keys padded to 32 and queries to 8),
    so that on any CPU the tests compare the invariant forward's values with the model's (ext/invariant.py)."""
    monkeypatch.setattr(ext.invariant, "fewest_rows", lambda model, most: 16)
    monkeypatch.setattr(ext.invariant, "attention_paddings", lambda *args: (32, 8))


def engine_for(model, block_size, preemption, prefix_cache=True, invariant=False):
    """A small pool and token budget: prompts chunk, and the generating requests preempt scoring ones; invariant:
    the batch-invariant forward (ext/invariant.py)."""
    num_blocks = -(-WINDOW // block_size) + 4
    swap = preemption == "swap"
    engine = engine_class(logprobs=True, swap=swap, invariant=invariant)(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        token_budget=5,
        prefix_cache=prefix_cache,
        **({"swap_blocks": num_blocks} if swap else {}),
        **({"invariant": True} if invariant else {}),
    )
    preempt_mid_scoring(engine)
    return engine, Meter(engine), Watch(engine)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_loglikelihood_equals_one_full_forward_under_chunking_preemption_and_prefix_hits(
    model, block_size, preemption, invariant, request
):
    if invariant:
        request.getfixturevalue("unchecked_invariance")
    pairs = pairs_workload(model, block_size)
    engine, meter, watch = engine_for(model, block_size, preemption, invariant=invariant)
    for r in generating(random.Random(block_size)):  # queued first: they run while the scoring requests prefill
        engine.add(r)
    got = scoring.loglikelihood(engine, pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        want, want_greedy = reference(model, context, continuation)
        assert logprob == pytest.approx(want, abs=TOLERANCE) and greedy == want_greedy
    assert {greedy for _, greedy in got} == {True, False}
    assert watch.chunk_inside_scored > 0 and watch.preempted_scoring > 0
    assert meter.cached_tokens > 0 and meter.admitted_tokens > meter.cached_tokens  # hits and misses
    if preemption == "swap":
        assert meter.swapped_out_blocks > 0
    assert not engine.waiting and not engine.running and engine.allocator.num_free() == engine.allocator.num_blocks


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_loglikelihood_rolling_equals_lm_evals_windows_each_one_full_forward(
    model, block_size, preemption, invariant, request
):
    if invariant:
        request.getfixturevalue("unchecked_invariance")
    rng = random.Random(block_size)
    texts = [[rng.randrange(300) for _ in range(n)] for n in (0, 1, 5, WINDOW - 2, WINDOW - 1, WINDOW, 150)]
    engine, _, watch = engine_for(model, block_size, preemption, invariant=invariant)
    for r in generating(rng):
        engine.add(r)
    got = scoring.loglikelihood_rolling(engine, texts, prefix_token=299)
    assert got == pytest.approx([rolling_reference(model, t, 299) for t in texts], abs=TOLERANCE)
    assert got[0] == 0  # no token, nothing scored, as lm-eval's
    assert watch.chunk_inside_scored > 0 and watch.preempted_scoring > 0
    for tokens in texts:  # scoring's windows are lm-eval's own
        theirs = list(map(make_disjoint_window, get_rolling_token_windows(tokens, 299, WINDOW - 1, 1)))
        assert scoring.rolling_windows(tokens, 299, WINDOW) == [(list(c), list(x)) for c, x in theirs]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_prefix_cache_serves_a_questions_context_to_its_later_choices_with_the_same_scores(model, block_size):
    rng = random.Random(block_size)
    questions = [([rng.randrange(300) for _ in range(rng.randint(20, 45))], 4) for _ in range(3)]
    pairs = [
        (context, [rng.randrange(300) for _ in range(rng.randint(1, 8))]) for context, n in questions for _ in range(n)
    ]
    scores = {}
    for prefix_cache in (True, False):
        engine = scoring.scoring_engine(model, num_blocks=200, block_size=block_size, prefix_cache=prefix_cache)
        watch = Watch(engine)
        Meter(engine)
        scores[prefix_cache] = scoring.loglikelihood(engine, pairs)
        cached = list(watch.cached.values())  # admission order: the requests' own
        for q, (context, _) in enumerate(questions):
            first, *later = cached[4 * q : 4 * q + 4]
            if prefix_cache:
                # a question's first choice finds nothing; the later ones its context's full blocks, all but the
                # last token's (its logits score the choice's first token)
                full = (len(context) - 1) // block_size * block_size
                assert first == 0 and later == [full] * 3 and full > 0
            else:
                assert first == 0 and later == [0, 0, 0]
    # the same to float64's last bits: a later choice's prefill computes its suffix alone, in matmuls of another
    # shape than the whole prompt's, which round differently (1 ulp), as any two chunkings do
    assert [x for x, _ in scores[True]] == pytest.approx([x for x, _ in scores[False]], rel=1e-14, abs=0)
    assert [g for _, g in scores[True]] == [g for _, g in scores[False]]


def instances(kind, arguments):
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


@pytest.fixture(scope="module")
def lm(model):
    """Our lm-eval model on the float64 tiny_gpt, with a small pool and budget."""
    return NanoGPTPaged(ckpt=model, num_blocks=30, block_size=4, token_budget=16, compile="off")


def test_the_lm_eval_model_scores_strings_as_lm_eval_tokenizes_them(lm, model):
    enc = lm.enc
    requests = [("ROMEO: ", "good night"), ("", "O Romeo"), ("a" * 80, "b"), ("JULIET:\n", "\nWherefore")]
    got = lm.loglikelihood(instances("loglikelihood", requests))
    for (context, continuation), (logprob, greedy) in zip(requests, got):
        if context:  # lm-eval's: the context's trailing spaces move to the continuation, the pair is encoded whole
            stripped = context.rstrip()
            whole, head = enc.encode(stripped + context[len(stripped) :] + continuation), enc.encode(stripped)
            pair = (head, whole[len(head) :])
        else:  # an empty context is end-of-text
            pair = ([enc.eot_token], enc.encode(continuation))
        assert (logprob, greedy) == pytest.approx(reference(model, *pair), abs=TOLERANCE)
    texts = ["", "to be or not to be " * 8]
    got = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    want = [rolling_reference(model, enc.encode(t), enc.eot_token) for t in texts]
    assert got == pytest.approx(want, abs=TOLERANCE)


class Added(Observer):
    def __init__(self, engine):
        self.requests = []
        engine.observers.append(self)

    def added(self, request):
        self.requests.append(request)


def test_generate_until_is_greedy_decoding_cut_at_the_first_stop_string(lm, model):
    enc = lm.enc
    contexts = ["JULIET: O Romeo", "To be", "x" * 62]
    greedy = [greedy_continuation(model, enc.encode(c), 12) for c in contexts]
    assert enc.decode(greedy[0]) == "oooo````````"  # the tiny model's, from the fifth token on a stop string
    requests = [
        (contexts[0], {"until": ["`", "\n\n"], "max_gen_toks": 12}),
        (contexts[1], {"until": [], "max_gen_toks": 12, "do_sample": False}),
        (contexts[2], {"until": ["\n\n\n\n\n"], "max_gen_toks": 256}),  # capped: 65 - 62 tokens are left
    ]
    added = Added(lm.engine)
    got = lm.generate_until(instances("generate_until", requests))
    lm.engine.observers.remove(added)
    assert got == ["oooo", enc.decode(greedy[1]), enc.decode(greedy[2][:3])]
    assert [len(r.generated) for r in added.requests] == [5, 12, 3]  # the first stopped at its stop string
    sampled = [("ROMEO:\n", {"do_sample": True, "temperature": 1.0, "max_gen_toks": 8, "until": []})] * 2
    first, second = lm.generate_until(instances("generate_until", sampled))
    assert first != second  # each request its own seed
    assert lm.generate_until(instances("generate_until", sampled)) == [first, second]  # and repeatable


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda lm: lm.loglikelihood(instances("loglikelihood", [("a", "b"), ("ROMEO", "")])), "an empty continuation"),
        (lambda lm: lm._loglikelihood_tokens([(None, [1], [2]), (None, [1], [])]), "a continuation of no tokens"),
        (lambda lm: lm._loglikelihood_tokens([(None, [1], [2]), (None, [1], [300])]), "id 300 is outside the tokenizer's 0..299"),
        (lambda lm: lm._loglikelihood_tokens([(None, [-1], [2])]), "id -1 is outside"),
        (lambda lm: lm._loglikelihood_tokens([(None, [1], [2] * WINDOW)]), "a continuation of 64 tokens: the model's window of 64 scores at most 63"),
        (lambda lm: lm.generate_until(instances("generate_until", [("a", {}), ("x" * 65, {})])), "a context of 65 tokens leaves no room"),
        (lambda lm: lm.generate_until(instances("generate_until", [("a", {"num_beams": 2})])), "generation kwargs num_beams: nanogpt-paged takes until"),
        (lambda lm: NanoGPTPaged(ckpt=lm.model, block_sze=4), "unknown model_args block_sze"),
        (lambda lm: NanoGPTPaged(ckpt=lm.model, dtype="int8"), "dtype 'int8' must be one of"),
        (lambda lm: NanoGPTPaged(ckpt=lm.model, block_size=0), "block_size 0 must be an integer >= 1"),
        (lambda lm: NanoGPTPaged(ckpt=lm.model, num_blocks="many"), "num_blocks 'many' must be an integer >= 1"),
        (lambda lm: NanoGPTPaged(ckpt="no/such/ckpt.pt"), "no checkpoint at no/such/ckpt.pt"),
    ],
)  # fmt: skip
def test_the_lm_eval_model_refuses_bad_input_in_one_line_before_the_engine_takes_any(lm, call, message):
    with pytest.raises(ValueError, match=message) as e:
        call(lm)
    assert "\n" not in str(e.value)
    assert not lm.engine.waiting and not lm.engine.running


def test_scoring_refuses_bad_input_in_one_line(model):
    engine = scoring.scoring_engine(model, num_blocks=20, block_size=4)
    bad = [
        (lambda: engine.add(Request([1, 2, 3], 1, SamplingParams(prompt_logprobs=21))), "prompt_logprobs 21 must be in 0..20"),
        (lambda: scoring.loglikelihood(engine, [([1, 2], [])]), "context of 2 ids, continuation of 0: each needs a token"),
        (lambda: scoring.loglikelihood(engine, [([1, 2], [300])]), r"an id outside the model's 0..299"),
    ]  # fmt: skip
    for call, message in bad:
        with pytest.raises(ValueError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_the_task_file_is_what_its_generator_makes():
    sys.path.insert(0, os.path.join(ROOT, "tasks"))
    try:
        import shakespeare_next_line as task
    finally:
        sys.path.remove(os.path.join(ROOT, "tasks"))
    rows = task.rows()
    assert rows == task.questions() and len(rows) == 200
    assert all(0 <= row["label"] < 4 == len(row["choices"]) and row["context"].endswith("\n") for row in rows)


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        yield


def test_lm_eval_gives_our_model_and_its_hf_backend_on_the_export_the_same_scores(offline, tmp_path):
    """The oracle: the local task's first 20 questions through lm-eval, with nanogpt-paged on the shipped model and
    with lm-eval's hf backend on its Hugging Face export, both float32 on the CPU."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    export_hf(load_checkpoint(SHIPPED), tmp_path / "hf")
    tasks = TaskManager(include_path=os.path.join(ROOT, "tasks"), include_defaults=False)  # ours alone: 4 s less
    runs = {}
    for name, args in [
        ("nanogpt-paged", dict(ckpt=SHIPPED, dtype="float32")),
        ("hf", dict(pretrained=str(tmp_path / "hf"), dtype="float32")),
    ]:
        runs[name] = lm_eval.simple_evaluate(
            model=name,
            model_args=args,
            tasks=["shakespeare_next_line"],
            task_manager=tasks,
            limit=20,
            device="cpu",
            batch_size=16,
            bootstrap_iters=0,
            log_samples=True,
        )
    ours, theirs = (runs[name]["samples"]["shakespeare_next_line"] for name in runs)
    assert len(ours) == len(theirs) == 20
    for a, b in zip(ours, theirs):
        assert a["arguments"] == b["arguments"]  # the same questions, in the same order
        assert [x[0][0] for x in a["resps"]] == pytest.approx([x[0][0] for x in b["resps"]], abs=1e-4)
        assert [x[0][1] for x in a["resps"]] == [x[0][1] for x in b["resps"]]
    accuracy = {name: run["results"]["shakespeare_next_line"]["acc,none"] for name, run in runs.items()}
    assert accuracy["nanogpt-paged"] == accuracy["hf"]


def test_the_command_runs_lm_evals_cli_with_our_model_and_tasks(offline, capsys, monkeypatch):
    """The README's command, on four questions, without --include_path: the repository's tasks/ is included."""
    import lm_eval.utils

    import lm_eval_run

    monkeypatch.setattr(sys, "argv", ["lm_eval_run.py"])
    logger = logging.getLogger("lm_eval")  # the CLI gives it a handler on this test's captured stderr: not after
    for name, value in [("handlers", list(logger.handlers)), ("propagate", logger.propagate), ("level", logger.level)]:
        monkeypatch.setattr(logger, name, value)
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", lm_eval.utils._LOGGING_CONFIGURED)
    lm_eval_run.main(
        [
            "--model",
            "nanogpt-paged",
            "--model_args",
            f"ckpt={SHIPPED}",
            "--tasks",
            "shakespeare_next_line",
            "--limit",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "|shakespeare_next_line|" in out and "|acc     |" in out


def test_the_command_exits_with_one_line_on_a_value_error(offline, monkeypatch):
    """What the model refuses (as the bad input above) ends the command with its one line, no traceback."""
    import lm_eval.__main__

    import lm_eval_run

    def refuses():
        NanoGPTPaged(ckpt=tiny_gpt(), ckpt_path="x")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", refuses)
    monkeypatch.setattr(sys, "argv", ["lm_eval_run.py"])
    with pytest.raises(SystemExit) as e:
        lm_eval_run.main(["--model", "nanogpt-paged", "--model_args", "ckpt_path=x"])
    assert e.value.code.startswith("error: unknown model_args ckpt_path: nanogpt-paged takes ckpt, ")
    assert "\n" not in e.value.code
