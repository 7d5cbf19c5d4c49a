"""Scoring through the paged engine as evaluation harnesses score a model (issue #61), on the shipped trained model
(models/tiny-shakespeare.pt): multiple choice as lm-eval asks it, and the perplexity of the held-out plays.

    python bench/scoring.py                                       # ours, Hugging Face, the model's own forward
    python bench/scoring.py --vllm-python .vllm/bin/python        # and vLLM's CPU build, in its own virtualenv
    python bench/scoring.py --vllm-python .vllm/bin/python --vllm-setup preloaded   # the figures' command
    python bench/scoring.py --smoke                               # seconds: a check that it runs, no figures

Multiple choice: --questions questions from harness.scoring.multiple_choice (seeded: a context of 64-192 tokens
of the held-out plays, its true next line and three lines from elsewhere). Each choice is one request, scored as
lm-eval scores it: the summed log-probability of the choice's tokens after its context (context and choice
encoded apart); the choice with the highest is the answer. Every question's requests go in at once, as a
serving run would send them. Methods:
  cache    ours: harness.scoring.loglikelihood on scoring_engine(model, prefix_cache=True): the four choices
           share their context's full blocks, computed once
  nocache  the same engine with prefix_cache=False: every request computes its whole context
  hf       Hugging Face's GPT2LMHeadModel on the same weights (to_transformers), the plain batched forward
           lm-eval's HF backend runs: requests sorted longest first, right-padded in batches of --hf-batch,
           log_softmax of every position, the continuation's tokens gathered
  vllm     vLLM's LLM.generate with SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0,
           detokenize=False), as lm-eval's vLLM backend asks; float32, both cores bound
           (VLLM_CPU_OMP_THREADS_BIND=0-1), and with --vllm-setup preloaded tcmalloc and the venv's libiomp5.so
           preloaded as vLLM's CPU docs ask (vllm_compare.py's setups). vLLM computes every prompt token of a
           request asking prompt logprobs, its prefix cache notwithstanding (its docs; vLLM PR #23399). Runs only
           with --vllm-python.
Perplexity: every token of the held-out plays scored once, in harness.scoring.rolling_windows (lm-eval's
disjoint rolling windows, each at most the model's 256 tokens: 255 tokens predicted in a full window, each from
the tokens before it; the first window starts after <|endoftext|>). Methods:
  engine   ours: harness.scoring.loglikelihood_rolling, every window a request, all at once
  forward  the model's own batched forward, as training runs it (GPT.forward(idx, targets), no cache): the same
           windows in batches of --ppl-batch, each window's tokens but its last in, the mean loss of its scored ones
Ours is the engine harness.scoring builds (the paged engine with the logprobs extension, its defaults: a
2,048-token step budget unless --token-budget says otherwise, 64 sequences at once; with --invariant the
batch-invariant forward of ext/invariant.py, whose scores are equal to the bit cache on and off), the model through
harness/tuning.py's prepare as generate.py loads it; its pool holds 64 sequences at their longest. Each engine is
built before its clock starts (a fresh one each repeat: its prefix cache starts empty); HF and our forward share
the process and its threads. Each vLLM run is its own process (it loads the model, exported each run with
export_hf to out/scoring/hf, warms up on other questions, then times one generate call). Every in-process method
warms up once on other questions and windows. Methods alternate within each repeat (cache, nocache, hf, vllm,
engine, forward, then again); the tables give medians (min-max) over --repeats, and each ratio of the goals is
computed within a repeat.
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from vllm_compare import cpu_line, setups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "out", "scoring")
METHODS = ["cache", "nocache", "hf", "vllm", "engine", "forward"]
CHOICE, PERPLEXITY = METHODS[:4], METHODS[4:]
LABELS = {
    "cache": "ours, prefix cache on",
    "nocache": "ours, prefix cache off",
    "hf": "HF batched forward",
    "vllm": "vLLM prompt_logprobs",
    "engine": "ours, loglikelihood_rolling",
    "forward": "the model's own forward",
}
# (ratio's name, faster method, slower method, goal): the goals, each a speed ratio within a repeat
GOALS = [
    ("prefix cache on / vLLM", "cache", "vllm", 2.5),
    ("prefix cache on / HF forward", "cache", "hf", 2.0),
    ("prefix cache on / off", "cache", "nocache", 1.8),
    ("engine perplexity / model's forward", "engine", "forward", 0.9),
]
TRAIN_TINY_LOSS = 3.639  # train_tiny.py's held-out loss of the shipped model (the README's)


def requests_of(enc, questions, window):
    """Questions -> each choice's (tokens, first scored position), as harness.scoring.scoring_request makes them:
    the context's and the choice's ids encoded apart, their last window kept."""
    out = []
    for context, choices, _ in questions:
        for choice in choices:
            ctx, cont = enc.encode_ordinary(context), enc.encode_ordinary(choice)
            tokens = (ctx + cont)[-window:]
            out.append((tokens, max(1, len(tokens) - len(cont))))
    return out


def pairs_of(requests):  # (tokens, start) -> loglikelihood's (context, continuation)
    return [(tokens[:start], tokens[start:]) for tokens, start in requests]


def run_ours(model, requests, prefix_cache, token_budget, invariant=False, max_batch=64):
    """loglikelihood on a fresh scoring engine -> (seconds, scores, (prefill tokens, cached tokens, steps))."""
    from harness.metrics import Meter
    from harness.scoring import loglikelihood, scoring_engine
    from paged import blocks_for

    num_blocks = max_batch * max(blocks_for(len(tokens), 16) for tokens, _ in requests)
    settings = dict(prefix_cache=prefix_cache, token_budget=token_budget, max_batch=max_batch, invariant=invariant)
    engine = scoring_engine(model, num_blocks=num_blocks, **settings)
    meter = Meter(engine)
    start = time.perf_counter()
    scores = loglikelihood(engine, pairs_of(requests))
    seconds = time.perf_counter() - start
    counts = meter.prefill_tokens, meter.cached_tokens, len(meter.steps)
    return seconds, [logprob for logprob, _ in scores], counts


def run_hf(hf, requests, batch_size):
    """lm-eval's HF loglikelihood, without its caching: longest first, right-padded batches -> (seconds, scores)."""
    import torch

    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
    scores = [None] * len(requests)
    start = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            rows = order[b : b + batch_size]
            width = max(len(requests[i][0]) for i in rows) - 1  # the last token is scored, never fed
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for j, i in enumerate(rows):
                fed = requests[i][0][:-1]
                ids[j, : len(fed)] = torch.tensor(fed)
                mask[j, : len(fed)] = 1
            logprobs = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for j, i in enumerate(rows):
                tokens, first = requests[i]
                targets = torch.tensor(tokens[first:])
                picked = logprobs[j, first - 1 : len(tokens) - 1].gather(-1, targets[:, None])
                scores[i] = picked.sum().item()
    return time.perf_counter() - start, scores


def ppl_windows(val, prefix_token, window):
    """The rolling windows loglikelihood_rolling scores: (tokens, first scored position) each."""
    from harness.scoring import rolling_windows

    return [(ctx + cont, len(ctx)) for ctx, cont in rolling_windows(val, prefix_token, window)]


def run_engine_ppl(model, val, prefix_token, token_budget, invariant=False, max_batch=64):
    """Every token of val through loglikelihood_rolling -> (seconds, mean loss, tokens)."""
    from harness.scoring import loglikelihood_rolling, scoring_engine
    from paged import blocks_for

    num_blocks = max_batch * blocks_for(model.config.block_size, 16)
    settings = dict(token_budget=token_budget, max_batch=max_batch, invariant=invariant)
    engine = scoring_engine(model, num_blocks=num_blocks, **settings)
    start = time.perf_counter()
    (total,) = loglikelihood_rolling(engine, [val], prefix_token)
    return time.perf_counter() - start, -total / len(val)


def run_forward_ppl(model, windows, batch_size):
    """The same windows through GPT.forward(idx, targets), training's call, in batches of windows of one length ->
    (seconds, mean loss over the scored tokens)."""
    import torch

    by_length = {}
    for tokens, first in windows:
        by_length.setdefault(len(tokens), []).append((tokens, first))
    total = count = 0
    start = time.perf_counter()
    with torch.no_grad():
        for group in by_length.values():
            for b in range(0, len(group), batch_size):
                batch = group[b : b + batch_size]
                x = torch.tensor([tokens for tokens, _ in batch])
                targets = x[:, 1:].clone()
                for j, (_, first) in enumerate(batch):
                    targets[j, : first - 1] = -1  # context tokens: fed, not scored (ignore_index)
                scored = int((targets >= 0).sum())
                _, loss = model(x[:, :-1], targets)  # the mean over the scored tokens
                total += loss.item() * scored
                count += scored
    return time.perf_counter() - start, total / count


def run_vllm(job):
    """In vLLM's virtualenv: load, warm up on other questions, time one generate over the requests."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["folder"], skip_tokenizer_init=True, dtype=job["dtype"], seed=0, gpu_memory_utilization=0.5)
    params = SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0, detokenize=False)  # lm-eval's

    def score(requests):
        prompts = [TokensPrompt(prompt_token_ids=tokens) for tokens, _ in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        scores = [
            sum(out.prompt_logprobs[p][tokens[p]].logprob for p in range(first, len(tokens)))
            for (tokens, first), out in zip(requests, outputs)
        ]
        return seconds, scores, sum(out.num_cached_tokens or 0 for out in outputs)

    score(job["warm"])
    seconds, scores, cached = score(job["timed"])
    return dict(
        seconds=seconds,
        scores=scores,
        cached_tokens=cached,
        version=vllm.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        max_num_batched_tokens=llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
    )


def launch_vllm(python, job_file, env):
    cmd = [python, os.path.abspath(__file__), "--worker", job_file]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:  # vLLM may abort in its own teardown after its result is out: the result decides
        sys.exit(f"error: the vLLM worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def answers(scores, questions):
    """Each question's pick: the index of its highest-scoring choice (the first of a tie, as numpy's argmax)."""
    picks, i = [], 0
    for _, choices, _ in questions:
        mine = scores[i : i + len(choices)]
        picks.append(mine.index(max(mine)))
        i += len(choices)
    return picks


def fmt(xs, spec="{:,.1f}"):
    return f"{spec.format(statistics.median(xs))} ({spec.format(min(xs))}-{spec.format(max(xs))})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=200, help="multiple-choice questions (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="the questions' seed; the warm-up's is seed + 1")
    p.add_argument("--repeats", type=int, default=3, help="each method's timed runs, alternated (default: 3)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)} (default: all)"
    )
    p.add_argument("--vllm-python", help="the python of vLLM's own virtualenv; without it, vllm is not run")
    p.add_argument(
        "--vllm-setup",
        default="plain",
        choices=["plain", "preloaded"],
        help="vLLM's: both cores bound (VLLM_CPU_OMP_THREADS_BIND=0-1); preloaded adds LD_PRELOAD of tcmalloc and "
        "the venv's libiomp5.so, as vllm_compare.py's (default: plain)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=2048,
        help="ours' tokens a step (default: 2,048, harness.scoring's SCORING_TOKEN_BUDGET; the engine's own is 512, "
        "vLLM's 4,096)",
    )
    p.add_argument(
        "--invariant",
        action="store_true",
        help="ours with the batch-invariant forward (ext/invariant.py): scores equal to the bit, cache on or off",
    )
    p.add_argument("--hf-batch", type=int, default=32, help="HF's batch of requests (default: 32)")
    p.add_argument("--ppl-batch", type=int, default=64, help="the model's forward's batch of windows (default: 64)")
    p.add_argument("--ppl-tokens", type=int, default=0, help="score the held-out plays' first N tokens; 0: all")
    p.add_argument("--smoke", action="store_true", help="8 questions, 1 repeat, 2,000 tokens: seconds, no figures")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if (
        unknown
        or min(args.questions, args.repeats, args.hf_batch, args.ppl_batch, args.token_budget) < 1
        or args.ppl_tokens < 0
    ):
        p.error(f"--methods {args.methods} (unknown: {unknown}), and every count must be >= 1")
    if args.smoke:
        args.questions, args.repeats, args.ppl_tokens = min(args.questions, 8), 1, args.ppl_tokens or 2000
    args.methods = [m for m in METHODS if m in methods and (m != "vllm" or args.vllm_python)]
    args.skipped = "vllm" in methods and not args.vllm_python
    return args


def main():
    args = parse_args()
    if args.worker:
        with open(args.worker) as f:
            print("RESULT " + json.dumps(run_vllm(json.load(f))), flush=True)
        return
    print("$ python " + shlex.join(sys.argv))
    import torch
    import transformers

    from harness.checkpoints import SHIPPED, export_hf, get_tokenizer, load_checkpoint, shakespeare, to_transformers
    from harness.scoring import multiple_choice
    from harness.tuning import freeze_heap, prepare

    model = load_checkpoint(SHIPPED)
    window = model.config.block_size
    enc = get_tokenizer(model.config.vocab_size)
    hf = to_transformers(model)  # before prepare: HF gets plain copies of the same weights
    prepare(model)
    print(f"{cpu_line()}; {time.strftime('%Y-%m-%d')}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; transformers {transformers.__version__}; "
        f"ours: a {args.token_budget}-token step budget, 64 sequences at once"
        + (", the batch-invariant forward (--invariant)" if args.invariant else "")
    )
    methods = args.methods
    if args.skipped:
        print("vllm skipped: no --vllm-python given")
    if args.smoke:
        print("--smoke: a check that the script runs; its figures mean nothing")

    questions = multiple_choice(enc, args.questions, args.seed)
    warm_questions = multiple_choice(enc, min(args.questions, 16), args.seed + 1)
    requests, warm = requests_of(enc, questions, window), requests_of(enc, warm_questions, window)
    train, val = shakespeare()
    val = enc.encode_ordinary(val)
    val = val[: args.ppl_tokens] if args.ppl_tokens else val
    windows = ppl_windows(val, enc.eot_token, window)
    warm_text = enc.encode_ordinary(train[:8000])[: 4 * (window - 1)]  # other tokens: the training text's

    job_file, vllm_env = None, None
    if "vllm" in methods:
        vllm_env = setups(args.vllm_python, [args.vllm_setup]).get(f"vllm {args.vllm_setup}")
        if vllm_env is None:
            sys.exit(f"error: --vllm-setup {args.vllm_setup}: no tcmalloc (apt-get install libtcmalloc-minimal4)")
        too_long = [len(t) for t, _ in requests + warm if len(t) >= window]
        if too_long:  # vLLM generates the one token within the model's positions: a prompt of at most window - 1
            sys.exit(f"error: vLLM takes prompts of at most {window - 1} tokens; {len(too_long)} requests are longer")
        folder = os.path.join(OUT, "hf")
        shutil.rmtree(folder, ignore_errors=True)  # exported afresh: the shipped model may have changed
        export_hf(model, folder)
        job_file = os.path.join(OUT, "vllm_job.json")
        with open(job_file, "w") as f:
            json.dump(dict(folder=folder, dtype="float32", timed=requests, warm=warm), f)

    # one warm-up of each in-process method on other questions and tokens
    for m in methods:
        if m in ("cache", "nocache"):
            run_ours(model, warm, m == "cache", args.token_budget, args.invariant)
        elif m == "hf":
            run_hf(hf, warm, args.hf_batch)
        elif m == "engine":
            run_engine_ppl(model, warm_text, enc.eot_token, args.token_budget, args.invariant)
        elif m == "forward":
            run_forward_ppl(model, ppl_windows(warm_text, enc.eot_token, window), args.ppl_batch)
    freeze_heap()  # as serving does after its warm-up: the compiled graphs are never walked by the collector again

    seconds = {m: [] for m in methods}
    scores, losses, tokens, vllm_info = {}, {}, {}, {}
    for _ in range(args.repeats):
        for m in methods:
            if m in ("cache", "nocache"):
                t, s, tokens[m] = run_ours(model, requests, m == "cache", args.token_budget, args.invariant)
            elif m == "hf":
                t, s = run_hf(hf, requests, args.hf_batch)
            elif m == "vllm":
                vllm_info = launch_vllm(args.vllm_python, job_file, vllm_env)
                t, s = vllm_info["seconds"], vllm_info["scores"]
            elif m == "engine":
                t, s = run_engine_ppl(model, val, enc.eot_token, args.token_budget, args.invariant)
            else:
                t, s = run_forward_ppl(model, windows, args.ppl_batch)
            seconds[m].append(t)
            (losses if m in PERPLEXITY else scores).setdefault(m, s)  # the first repeat's; later ones the same

    report(args, questions, requests, val, windows, seconds, scores, losses, tokens, vllm_info)


def report(args, questions, requests, val, windows, seconds, scores, losses, tokens, vllm_info):
    methods = args.methods
    truth = [answer for _, _, answer in questions]
    mc = [m for m in methods if m in CHOICE]
    if mc:
        lengths = [len(t) for t, _ in requests]
        print(
            f"\n--- multiple choice: {len(questions)} questions (seed {args.seed}), {len(requests)} requests of "
            f"{min(lengths)}-{max(lengths)} tokens ({sum(lengths):,} in all), float32; ms per question, median "
            f"(min-max) of {args.repeats}"
        )
        if vllm_info:
            print(
                f"vLLM {vllm_info['version']}, {args.vllm_setup} (torch {vllm_info['torch']}, "
                f"{vllm_info['threads']} threads, "
                f"max_num_batched_tokens {vllm_info['max_num_batched_tokens']}): {vllm_info['cached_tokens']} prompt "
                "tokens served by its prefix cache"
            )
        base = mc[0]  # ours with the cache where it ran: the others' scores are compared with its
        base_picks = answers(scores[base], questions)
        print(f"{'method':<30} {'ms/question':>22} {'accuracy':>9} {'same picks':>11}  largest |score - {base}'s|")
        for m in mc:
            picks = answers(scores[m], questions)
            accuracy = sum(p == a for p, a in zip(picks, truth)) / len(truth)
            same = sum(p == b for p, b in zip(picks, base_picks))
            diff = max(abs(a - b) for a, b in zip(scores[m], scores[base]))
            ms = [1000 * t / len(questions) for t in seconds[m]]
            print(f"{LABELS[m]:<30} {fmt(ms):>22} {accuracy:>9.1%} {same:>5}/{len(questions):<5}  {diff:.2e}")
        for m in ("cache", "nocache"):
            if m in tokens:
                prefill, cached, steps = tokens[m]
                print(
                    f"{LABELS[m]}: {prefill:,} prefill tokens computed, {cached:,} served by the prefix cache, "
                    f"in {steps:,} steps"
                )
    if any(m in PERPLEXITY for m in methods):
        print(
            f"\n--- perplexity: {len(val):,} held-out tokens in {len(windows)} rolling windows of at most 256 tokens "
            f"(each predicts up to 255); seconds, median (min-max) of {args.repeats}"
        )
        print(f"{'method':<36} {'seconds':>20} {'tokens/s':>10} {'mean loss':>10}")
        for m in (m for m in methods if m in PERPLEXITY):
            label = LABELS[m] + (f", batch {args.ppl_batch}" if m == "forward" else "")
            rate = len(val) / statistics.median(seconds[m])
            print(f"{label:<36} {fmt(seconds[m], '{:.2f}'):>20} {rate:>10,.0f} {losses[m]:>10.5f}")
        if len(losses) == 2:
            print(f"|engine - forward| mean loss: {abs(losses['engine'] - losses['forward']):.2e} (goal: < 1e-4)")
        print(f"train_tiny.py's held-out loss (random 257-token windows, 256 predicted each): {TRAIN_TINY_LOSS}")
    print(f"\n--- goals: speed ratios, each within a repeat, median (min-max) of {args.repeats}")
    for name, fast, slow, goal in GOALS:
        if fast not in seconds or slow not in seconds:
            print(f"{name:<36} not run")
            continue
        ratios = [s / f for f, s in zip(seconds[fast], seconds[slow])]
        if fast == "engine":
            diff = abs(losses["engine"] - losses["forward"])
            equal, condition = diff < 1e-4, f"equal loss: |difference| {diff:.1e} < 1e-4"
        else:
            diff = max(abs(a - b) for a, b in zip(scores[fast], scores[slow]))
            same = sum(a == b for a, b in zip(answers(scores[fast], questions), answers(scores[slow], questions)))
            picks = f"same picks {same}/{len(questions)}, largest |difference| {diff:.1e}"
            equal = same == len(questions) and (diff == 0 or slow != "nocache")
            condition = f"{'identical scores' if slow == 'nocache' else 'equal choices'} ({picks})"
        met = statistics.median(ratios) >= goal and equal
        print(
            f"{name:<36} {fmt(ratios, '{:.2f}x'):>20}  goal >= {goal}x: {'met' if met else 'NOT met'}; "
            f"{condition}: {'yes' if equal else 'no'}"
        )


if __name__ == "__main__":
    main()
