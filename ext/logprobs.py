"""Log-probabilities of tokens, as vLLM returns them: SamplingParams(logprobs=N) gives each sampled token's and its
N likeliest ids', and SamplingParams(prompt_logprobs=N) each prompt token's from position prompt_logprobs_from on
(the first token has none: nothing comes before it). They are raw, as vLLM's default: log_softmax of the model's
logits in float32 (float64 stays), before temperature and any cut, each with its rank among the ids (1: the
likeliest). No processed form is offered: the sampler's kept ids live inside sampling.sample.

A generated token's entry lands on its sequence (Sequence.logprobs), so n samples get theirs each; the prompt's on
its request (Request.prompt_logprobs, None before prompt_logprobs_from). Each entry is a dict, vLLM's layout: the
token's own id first, then the N likeliest, each an id -> Logprob(logprob, rank).

Prompt logprobs read the logits of prompt positions: a step draws a Sampler at each such position of a prefill
chunk (Sampler.back, speculation's seam), whose draw is dropped. The prefix cache still serves every full block
that ends before the first position whose logits are needed (cacheable), so the choices of a multiple-choice
question share their context's blocks; a position scored once is not scored again after a preemption.

Plugs into the engine at check_extensions, cacheable, samplers, sample and append_tokens. Beams report their
scores instead (ext/forks.py) and take neither."""

from dataclasses import replace
from typing import NamedTuple

import torch

from engine import Sampler
from sequence import SequenceStatus

MAX_LOGPROBS = 20  # the most likeliest ids an entry lists, vLLM's default max_logprobs


class Logprob(NamedTuple):
    logprob: float
    rank: int  # how many ids are as likely or likelier: 1 for the likeliest


class Logprobs:
    """An engine mixin: log-probabilities where a request asks for them; a step with none asked runs as before."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.scoring = set()  # this step's samplers at prompt positions: their draws are dropped
        self.entries = {}  # this step's sampler -> the entry sample() made for it

    def check_extensions(self, r, p):
        """logprobs and prompt_logprobs: checked here, then the core checks the rest without them."""
        if (p.logprobs, p.prompt_logprobs) != (None, None):
            self.check_logprobs(r, p)
        super().check_extensions(r, replace(p, logprobs=None, prompt_logprobs=None))

    def check_logprobs(self, r, p):
        for name, n in [("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)]:
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} {n} must be in 0..{MAX_LOGPROBS} (vLLM's default max_logprobs)")
        if p.prompt_logprobs is not None and not 1 <= p.prompt_logprobs_from <= len(r.prompt):
            why = f"prompt_logprobs_from {p.prompt_logprobs_from} must be in 1..{len(r.prompt)}"
            raise ValueError(f"{why}, a position of the prompt (the first token has no logprob)")
        if r.params.num_beams > 1:  # r's own: the forks extension hands p on with its settings at their defaults
            raise ValueError("beams give their scores, not logprobs or prompt_logprobs")

    def add(self, r):
        if r.params.prompt_logprobs is not None:
            r.prompt_logprobs = [None] * len(r.prompt)
        super().add(r)

    def cacheable(self, s):
        """Until its prompt is scored, a sequence computes the positions whose logits score it."""
        p = s.request.params
        if p.prompt_logprobs is None or None not in s.request.prompt_logprobs[p.prompt_logprobs_from :]:
            return super().cacheable(s)
        return min(super().cacheable(s), p.prompt_logprobs_from - 1)

    def samplers(self, plan):
        """A sampler at each position of a prefill chunk whose logits score a prompt token not yet scored."""
        scoring = []
        for i, (s, n) in enumerate(plan):
            r = s.request
            if r.params.prompt_logprobs is None or s.status is not SequenceStatus.PREFILLING:
                continue
            last = s.num_computed + n - 1  # the entry's last position: back 0
            first = max(s.num_computed, r.params.prompt_logprobs_from - 1)
            positions = range(first, min(last + 1, len(r.prompt) - 1))  # each scores the prompt token after it
            unscored = [q for q in positions if r.prompt_logprobs[q + 1] is None]  # a preemption recomputes some
            scoring += [Sampler(s, i, last - q) for q in unscored]
        self.scoring = set(scoring)
        return super().samplers(plan) + scoring

    def width(self, x):
        """How many likeliest ids sampler x's entry lists, or None: its request asks for none here."""
        p = x.sequence.request.params
        return p.prompt_logprobs if x in self.scoring else p.logprobs

    def sample(self, logits, batch, samplers):
        """The engine's draw, and an entry for each sampler whose request asks for logprobs."""
        tokens = super().sample(logits, batch, samplers)
        widths = [self.width(x) for x in samplers]
        rows = [j for j, width in enumerate(widths) if width is not None]
        self.entries = {}
        if not rows:
            return tokens
        targets = tokens[rows]  # the drawn token, or at a prompt position the prompt's next token
        scored = [i for i, j in enumerate(rows) if samplers[j] in self.scoring]
        if scored:
            prompt_tokens = [next_prompt_token(samplers[rows[i]]) for i in scored]
            targets[scored] = torch.tensor(prompt_tokens, device=targets.device)
        asked = entries(logits[rows], targets, [widths[j] for j in rows])
        self.entries = {samplers[j]: entry for j, entry in zip(rows, asked)}
        return tokens

    def append_tokens(self, samplers, tokens):
        """Each entry joins its sequence (a drawn token's) or its request's prompt (a prompt position's); the
        draws at prompt positions go no further."""
        drawn, drawn_tokens = [], []
        for x, token in zip(samplers, tokens):
            entry = self.entries.get(x)
            if x in self.scoring:
                x.sequence.request.prompt_logprobs[x.sequence.num_computed - x.back] = entry
                continue
            if entry is not None:
                vars(x.sequence).setdefault("logprobs", []).append(entry)
            drawn.append(x)
            drawn_tokens.append(token)
        super().append_tokens(drawn, drawn_tokens)


def next_prompt_token(x):
    """The prompt token a scoring sampler's logits predict: its sequence counts this step's tokens computed."""
    return x.sequence.tokens[x.sequence.num_computed - x.back]


def entries(logits, targets, widths):
    """logits (R, V), targets (R,), each row's width -> an entry for each row: {target: Logprob, then the
    width likeliest ids'}, computed on the logits' device and brought to the host in one transfer."""
    # a log-probability is a logit less its row's logsumexp (float32 at least: the engine samples in it); no
    # (R, V) log_softmax is written, as a row's ranks and likeliest ids are its logits'
    log_total = logits.logsumexp(-1, keepdim=True)  # (R, 1)
    target = logits.gather(1, targets[:, None])  # (R, 1)
    # as vLLM's: ids tied with it count; summed in int32, twice as fast on a CPU as the default int64
    rank = (logits >= target).sum(-1, dtype=torch.int32)
    host = [t.tolist() for t in (targets, (target - log_total)[:, 0], rank)]
    out = [{token: Logprob(value, k)} for token, value, k in zip(*host)]
    if max(widths):  # the likeliest, each ranked by its place
        top = logits.topk(max(widths))
        values, ids = (top.values - log_total).tolist(), top.indices.tolist()
        for entry, row_ids, row_values, width in zip(out, ids, values, widths):
            for i in range(width):
                entry.setdefault(row_ids[i], Logprob(row_values[i], i + 1))
    return out
