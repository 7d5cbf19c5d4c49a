"""Scoring text through the paged engine, as evaluation harnesses ask a model: the summed log-probability of a
continuation after its context and whether it is the greedy one (lm-eval's loglikelihood), and the summed
log-probability of whole texts in rolling windows (its loglikelihood_rolling, for perplexity).

Every request runs through the engine at once, as serving does, each asking prompt logprobs from its
continuation's first token on (ext/logprobs.py) and generating one token, as lm-eval's vLLM backend does. The
context's full blocks stay in the prefix cache: the choices of a multiple-choice question compute their shared
context once."""

import itertools
import random

from ext import engine_class
from sequence import Request, SamplingParams

# tokens a scoring step computes: scoring requests are all prompt, and a step of 2,048 tokens ran 1.2x as fast as
# the engine's 512 on the shipped model (per-step host side and small GEMMs: docs/scoring.md);
# its logits are 2,048 rows of the vocabulary at most (412 MB in float32 at GPT-2's, and as much again while
# ext/logprobs.py's cross-entropy scores them)
SCORING_TOKEN_BUDGET = 2048


def scoring_engine(model, token_budget=SCORING_TOKEN_BUDGET, invariant=False, **settings):
    """A paged engine with the logprobs extension, for these functions; settings as PagedEngine's (num_blocks is
    required), but for the step's token budget. invariant: the batch-invariant forward (ext/invariant.py), so
    that a score is the same to the bit whatever was scored beside it and whatever the prefix cache held."""
    if invariant:
        settings["invariant"] = True
    return engine_class(logprobs=True, invariant=invariant)(model, token_budget=token_budget, **settings)


def loglikelihood(engine, pairs):
    """pairs: [(context ids, continuation ids)] -> [(the continuation's summed log-probability after its context,
    whether each of its tokens is the likeliest)], in order. A pair longer than the model's window keeps its last
    window of tokens (lm-eval's HF backend keeps one more, a token the engine would have to feed and cannot).
    Raises ValueError, in one line, for a pair it cannot score."""
    requests = [scoring_request(engine, context, continuation) for context, continuation in pairs]
    engine.run(requests)
    return [score(r) for r in requests]


def scoring_request(engine, context, continuation):
    if not continuation or not context or len(continuation) >= engine.window:
        why = f"context of {len(context)} ids, continuation of {len(continuation)}"
        raise ValueError(f"{why}: each needs a token, and the continuation fewer than the window, {engine.window}")
    tokens = list(context + continuation)[-engine.window :]
    start = len(tokens) - len(continuation)
    return Request(tokens, 1, SamplingParams(prompt_logprobs=0, prompt_logprobs_from=start))


def score(r):
    """The summed log-probability of r's scored prompt tokens, and whether each was the likeliest (rank 1)."""
    scored = slice(r.params.prompt_logprobs_from, None)
    return float(r.prompt_logprobs.logprob[scored].sum()), bool((r.prompt_logprobs.rank[scored] == 1).all())


def rolling_windows(tokens, prefix_token, window):
    """lm-eval's disjoint rolling windows with a context of 1 (get_rolling_token_windows, then
    make_disjoint_window), each of at most `window` tokens with its context: (context, continuation) pairs whose
    continuations tile the tokens in order, the first after prefix_token, each later one after as many of the
    tokens before it as fit. lm-eval's max_seq_len is window - 1: the engine scores prompt tokens, so a window's
    tokens all fit in the model's context (lm-eval's vLLM backend gives up one more, for the generated token)."""
    inputs = window - 1  # the tokens a window feeds the model; it predicts as many
    pairs = [([prefix_token], tokens[:inputs])] if tokens else []
    predicted = inputs
    while predicted < len(tokens):
        end = min(len(tokens), predicted + inputs)
        context = tokens[end - inputs - 1 : predicted]  # the window's other inputs
        pairs.append((context, tokens[predicted:end]))
        predicted = end
    return pairs


def loglikelihood_rolling(engine, texts, prefix_token):
    """texts: [token ids] -> each text's summed log-probability, scored in rolling windows of the model's
    window: every token once, after as many of the tokens before it as fit."""
    windows = [rolling_windows(tokens, prefix_token, engine.window) for tokens in texts]
    scores = loglikelihood(engine, [pair for text in windows for pair in text])
    totals, i = [], 0
    for text in windows:
        text_scores = scores[i : i + len(text)]
        totals.append(sum(logprob for logprob, _ in text_scores))
        i += len(text)
    return totals


def multiple_choice(enc, num_questions=200, seed=0, context_tokens=(64, 192)):
    """Questions from the held-out plays (each play's last tenth): a context of context_tokens (MIN, MAX) tokens
    ending at a line's end, its true next line, and three verse lines of at least 20 characters from elsewhere
    in the held-out text -> [(context, choices, index of the true one)], texts, choices in a seeded order. The
    true line is at least 20 characters too, and differs from the others."""
    from harness.checkpoints import shakespeare

    rng = random.Random(seed)
    text = shakespeare()[1]
    starts = [i + 1 for i, c in enumerate(text) if c == "\n"]  # each line's first character
    lines = [text[a:b] for a, b in itertools.pairwise(starts)]  # each with its newline
    long_lines = [i for i, line in enumerate(lines) if len(line) > 20]
    verse = [i for i in long_lines if not lines[i].rstrip().endswith(":")]  # no speaker's name
    questions = []
    while len(questions) < num_questions:
        i = rng.choice(verse)
        want = rng.randint(*context_tokens)
        context = ""
        for line in reversed(lines[:i]):  # whole lines, back from the true one, until the context is long enough
            context = line + context
            if len(enc.encode_ordinary(context)) >= want:
                break
        far = [j for j in rng.sample(verse, 8) if abs(j - i) > 50]  # lines from elsewhere in the plays
        others = [lines[j] for j in far if lines[j] != lines[i]][:3]
        if len(others) < 3 or len(enc.encode_ordinary(context)) < context_tokens[0]:
            continue
        choices = others + [lines[i]]
        rng.shuffle(choices)
        questions.append((context, choices, choices.index(lines[i])))
    return questions
