"""Log-probabilities of tokens, as vLLM returns them: SamplingParams(logprobs=N) gives each sampled token's and its
N likeliest ids', and SamplingParams(prompt_logprobs=N) each prompt token's from position prompt_logprobs_from on
(the first token has none: nothing comes before it). They are raw, as vLLM's default: log_softmax of the model's
logits in float32 (float64 stays), before temperature and any cut, each with its rank among the ids (1: the
likeliest). No processed form is offered: the sampler's kept ids live inside sampling.sample.

A generated token's entry lands on its sequence (Sequence.logprobs), so n samples get theirs each; the prompt's on
its request (Request.prompt_logprobs, None before prompt_logprobs_from). Each entry is a dict, vLLM's layout: the
token's own id first, then the N likeliest, each an id -> Logprob(logprob, rank).

Prompt logprobs read the logits of prompt positions: a step draws a PromptSampler at each such position of a
prefill chunk (Sampler.back, speculation's seam), whose draw is dropped. A step's prompt positions are scored
together, in tensor ops, into their request's PromptLogprobs (arrays, read as vLLM's list of entries), so scoring
a long text costs no Python per token beyond its sampler. The prefix cache still serves every full block that
ends before the first position whose logits are needed (cacheable), so the choices of a multiple-choice question
share their context's blocks; a position scored once is not scored again after a preemption.

Plugs into the engine at add (a request's PromptLogprobs), check_extensions, cacheable, samplers, batch_class
(short chunks after cached K/V attend together: ext/padded_chunks.py), sample and append_tokens; under
compile="kernel" a step with no prompt position to score draws and scores in one call (the kernel engine's
sample_scored, ext/cpu_kernel.py). Beams report their scores instead (ext/forks.py) and take neither."""

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from engine import Sampler
from ext.padded_chunks import padded_batch_class
from sequence import SequenceStatus

MAX_LOGPROBS = 20  # the most likeliest ids an entry lists, vLLM's default max_logprobs


class Logprob(NamedTuple):
    logprob: float
    # the entry's own token: how many ids are as likely or likelier; a listed id: its place (1 for the likeliest)
    rank: int


class PromptSampler(Sampler):
    """A sampler at a prompt position: its logits score the prompt token after it, and its draw is dropped."""

    __slots__ = ()


class DrawnRows(NamedTuple):
    """The batch's tables that the engine's draw reads, at the drawn samplers' rows."""

    sample_rows: torch.Tensor
    sample_pos: torch.Tensor


class PromptLogprobs(Sequence):
    """A request's prompt logprobs, read as vLLM's list: None where a position is not scored (the first, those
    before prompt_logprobs_from), else its entry, {the prompt token: Logprob, then the width likeliest ids'}.
    Kept as arrays, filled a step's positions at a time; an entry is built when it is read. list(it) is vLLM's
    list (for JSON, say)."""

    def __init__(self, prompt, width):
        self.prompt = np.array(prompt)  # (P,)
        self.scored = np.zeros(len(prompt), dtype=bool)  # (P,)
        self.logprob = np.zeros(len(prompt))  # (P,) the prompt token's
        self.rank = np.zeros(len(prompt), dtype=np.int64)  # (P,)
        self.top_ids = np.zeros((len(prompt), width), dtype=np.int64)  # (P, width) the likeliest, best first
        self.top_logprobs = np.zeros((len(prompt), width))  # (P, width)

    def __len__(self):
        return len(self.prompt)

    def __eq__(self, other):  # as the list it reads as
        return list(self) == list(other)

    def __repr__(self):
        return repr(list(self))

    def __getitem__(self, q):
        if isinstance(q, slice):
            return [self[i] for i in range(*q.indices(len(self)))]
        if not self.scored[q]:
            return None
        own = self.prompt[q].item(), self.logprob[q].item(), self.rank[q].item()
        return entry(*own, self.top_ids[q].tolist(), self.top_logprobs[q].tolist())

    def fill(self, positions, logprob, rank, top_ids, top_logprobs):
        """Score positions (n,) of the prompt, from a step's scores: (n,) each, and (n, at least width)."""
        width = self.top_ids.shape[1]
        self.scored[positions] = True
        self.logprob[positions] = logprob
        self.rank[positions] = rank
        self.top_ids[positions] = top_ids[:, :width]
        self.top_logprobs[positions] = top_logprobs[:, :width]


class Logprobs:
    """An engine mixin: log-probabilities where a request asks for them; a step with none asked runs as before."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        # a multiple-choice question's later choices are short chunks after its cached context: they attend together
        self.batch_class = padded_batch_class(self.batch_class)
        self.scoring = []  # this step's prompt samplers, in order: their draws are dropped
        self.spans = []  # the positions they score: (request, positions (n,)) in their samplers' order
        self.entries = {}  # this step's drawn sampler -> the entry sample() made for it
        self.scores = None  # this step's prompt scores, on the host: (logprob, rank, top ids, top logprobs)

    def check_extensions(self, r, p):
        """logprobs and prompt_logprobs: checked here, then the core checks the rest without them."""
        if (p.logprobs, p.prompt_logprobs) != (None, None):
            self.check_logprobs(r, p)
        super().check_extensions(r, replace(p, logprobs=None, prompt_logprobs=None))

    def check_logprobs(self, r, p):
        most = min(MAX_LOGPROBS, self.vocab_size)  # an entry lists ids of the vocabulary only
        for name, n in [("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)]:
            if n is not None and not 0 <= n <= most:
                why = f"vLLM's default max_logprobs {MAX_LOGPROBS}, and at most the vocabulary's {self.vocab_size} ids"
                raise ValueError(f"{name} {n} must be in 0..{most} ({why})")
        if p.prompt_logprobs is not None and not 1 <= p.prompt_logprobs_from <= len(r.prompt):
            why = f"prompt_logprobs_from {p.prompt_logprobs_from} must be in 1..{len(r.prompt)}"
            raise ValueError(f"{why}: the first token has no logprob, and from {len(r.prompt)} on none is scored")
        if r.params.num_beams > 1:  # r's own: the forks extension hands p on with its settings at their defaults
            raise ValueError("beams give their scores, not logprobs or prompt_logprobs")

    def add(self, r):
        super().add(r)  # which refuses a request added before: its prompt logprobs stay as they are
        if r.params.prompt_logprobs is not None:
            r.prompt_logprobs = PromptLogprobs(r.prompt, r.params.prompt_logprobs)

    def cacheable(self, s):
        """Until its prompt is scored, a sequence computes the positions whose logits score it."""
        p = s.request.params
        if p.prompt_logprobs is None:
            return super().cacheable(s)
        if s.request.prompt_logprobs.scored[p.prompt_logprobs_from :].all():
            return super().cacheable(s)
        return min(super().cacheable(s), p.prompt_logprobs_from - 1)

    def samplers(self, plan):
        """A sampler at each position of a prefill chunk whose logits score a prompt token not yet scored, after
        the engine's own: one run of samplers, which the extensions composed around this one keep together (forks
        adds a prompt's samples beside its sampler, speculation appends its proposals)."""
        self.scoring, self.spans = [], []
        for i, (s, n) in enumerate(plan):
            r = s.request
            if r.params.prompt_logprobs is None or s.status is not SequenceStatus.PREFILLING:
                continue
            last = s.num_computed + n - 1  # the entry's last position: back 0
            first = max(s.num_computed, r.params.prompt_logprobs_from - 1)
            end = min(last, len(r.prompt) - 2) + 1  # the prompt's last token scores nothing
            scored = np.arange(first + 1, end + 1)  # the prompt tokens these positions' logits score
            scored = scored[~r.prompt_logprobs.scored[scored]]  # a preemption recomputes some
            if len(scored):
                self.spans.append((r, scored))
                self.scoring += [PromptSampler(s, i, last + 1 - q) for q in scored.tolist()]
        return super().samplers(plan) + self.scoring

    def scoring_rows(self, samplers):
        """Where this step's run of prompt samplers sits among samplers: a slice, empty if they hold none
        (speculation hands its verified draws on one at a time)."""
        if not self.scoring:
            return slice(0, 0)
        start = next((j for j, x in enumerate(samplers) if x is self.scoring[0]), None)
        if start is None:  # a call without them
            return slice(0, 0)
        end = start + len(self.scoring)
        assert samplers[end - 1] is self.scoring[-1], "the prompt samplers were parted"
        return slice(start, end)

    def sample(self, logits, batch, samplers):
        """The engine's draw, an entry for each drawn sampler whose request asks for logprobs, and the scores of
        this step's prompt positions."""
        rows = self.scoring_rows(samplers)
        drawn = [*range(rows.start), *range(rows.stop, len(samplers))]
        asking = [j for j in drawn if samplers[j].sequence.request.params.logprobs is not None]
        widths = [samplers[j].sequence.request.params.logprobs for j in asking]
        compiled = self.compile != "off" and logits.device.type == "cpu"  # no GPU has run it compiled yet
        if self.compile == "kernel":
            compiled = "kernel"  # float32 scores through the C kernel (ext/cpu_kernel.py)
        if compiled == "kernel" and asking and len(drawn) == len(samplers) and logits.dtype == torch.float32:
            tokens, asked = self.draw_scored(logits, batch, asking, widths)
        else:
            tokens = self.draw(logits, batch, samplers, drawn)
            picked = slice(None) if len(asking) == len(samplers) else asking  # every row: no copy of the logits
            asked = entries(logits[picked], tokens[picked], widths, compiled) if asking else []
        self.entries = {samplers[j]: entry for j, entry in zip(asking, asked)}
        self.scores = None
        if self.spans:  # each scores the prompt's token after its position
            targets = np.concatenate([r.prompt_logprobs.prompt[scored] for r, scored in self.spans])
            targets = torch.from_numpy(targets).to(logits.device)
            width = max(r.params.prompt_logprobs for r, _ in self.spans)
            self.scores = scores(logits[rows], targets, width, compiled)
        return tokens

    def draw_scored(self, logits, batch, asking, widths):
        """The engine's draw at every row, and the asking rows' entries, from one call of the C kernel: each row is
        scored as it is drawn, read once, and a top-k row's likeliest ids are its candidates'
        (ext/cpu_kernel.py's sample_scored)."""
        scored = torch.zeros(len(logits), dtype=torch.bool)
        scored[asking] = True
        tokens, host = self.sample_scored(logits, batch, scored, max(widths))
        picked = slice(None) if len(asking) == len(logits) else asking
        return tokens, entries_of([a[picked] for a in host], tokens[picked], widths)

    def draw(self, logits, batch, samplers, drawn):
        """The engine's draw at the drawn samplers only; a prompt sampler's token is 0, never read."""
        if len(drawn) == len(samplers):
            return super().sample(logits, batch, samplers)
        tokens = torch.zeros(len(samplers), dtype=torch.long, device=logits.device)
        if drawn:
            rows = DrawnRows(batch.sample_rows[drawn], batch.sample_pos[drawn])  # what the engine's draw reads
            drawing = [samplers[j] for j in drawn]
            tokens[drawn] = super().sample(logits[drawn], rows, drawing)
        return tokens

    def append_tokens(self, samplers, tokens):
        """Each entry joins its sequence (a drawn token's), each prompt score its request's prompt logprobs; the
        draws at prompt positions go no further."""
        if self.scores is not None:  # once a step, though speculation calls this once for each verified draw
            self.fill_prompt_logprobs()
        rows = self.scoring_rows(samplers)
        drawn = samplers[: rows.start] + samplers[rows.stop :]
        drawn_tokens = tokens[: rows.start] + tokens[rows.stop :]
        for x in drawn:
            if x in self.entries:
                vars(x.sequence).setdefault("logprobs", []).append(self.entries[x])
        super().append_tokens(drawn, drawn_tokens)

    def fill_prompt_logprobs(self):
        """This step's prompt scores join their requests' prompt logprobs, span by span."""
        start = 0
        for r, scored in self.spans:
            end = start + len(scored)
            r.prompt_logprobs.fill(scored, *(a[start:end] for a in self.scores))
            start = end
        self.scores = None


def target_scores(logits, targets, best):
    """logits (R, V), targets (R,), best (R, 1) each row's largest logit -> each target's logprob (R,) and rank
    (R,), and each row's logsumexp (R, 1). Row reductions only: compiled (compiled_target_scores), they read the
    logits in one pass and write no (R, V) tensor, where eager ops write the rank's comparison and the exps."""
    target = logits.gather(1, targets[:, None])  # (R, 1)
    # as vLLM's: ids tied with it count; summed in int32, twice as fast on a CPU as the default int64
    rank = (logits >= target).sum(-1, dtype=torch.int32)
    # logsumexp's own formula, its maximum given: the pass that would find it is saved (the top ids found it)
    log_total = (logits - best).exp().sum(-1, keepdim=True).log() + best
    return (target - log_total)[:, 0], rank, log_total


@functools.cache
def compiled_target_scores():
    return torch.compile(target_scores, dynamic=True)


def two_level_topk(x, k):
    """x (R, V) -> x.topk(k)'s values and ids: the same values, and ids that hold them (of tied ids, maybe others).
    On a CPU, for 0 < k <= V // 16, in two levels: group c holds columns c, c + C, c + 2C, ... (C = V // 16, so
    that one vectorized pass takes every group's maximum), and a row's k best lie in the k groups with the largest
    maxima (any column outside them has k group maxima at least as large); the last V % 16 columns are candidates
    outright. At 64 x 50,304 and k = 5: 0.52 against 1.94 ms for topk (docs/floor_and_sampling.md)."""
    R, V = x.shape
    C = V // 16
    if x.device.type != "cpu" or not 0 < k <= C:
        return tuple(torch.topk(x, k))
    best_groups = torch.topk(x[:, : 16 * C].unflatten(1, (16, C)).amax(1), k, sorted=False).indices  # (R, k)
    cols = (best_groups[:, None] + C * torch.arange(16)[:, None]).flatten(1)  # (R, 16 k)
    cols = torch.cat([cols, torch.arange(16 * C, V).expand(R, -1)], 1)
    values, best = torch.topk(x.gather(1, cols), k)
    return values, cols.gather(1, best)


def scores(logits, targets, width, compiled=False):
    """logits (R, V), targets (R,) -> on the host: each target's logprob (R,) and rank (R,), and the width
    likeliest ids (R, width) and their logprobs (R, width). In the logits' dtype, float32 at least (the engine
    samples in it); compiled: through torch.compile (on a CPU, 2-4x as fast as the eager ops at 512-2,048 rows of
    2,048 ids, and never slower at 8-128), or "kernel": float32 logits on a CPU through ext/cpu_kernel.py's C
    kernel (compile="kernel")."""
    if compiled == "kernel" and logits.dtype == torch.float32 and logits.device.type == "cpu":
        from ext.cpu_kernel import kernel_scores  # built with the engine's kernels: compile="kernel" asked for it

        return kernel_scores(logits, targets, width)
    if len(logits) == 1:  # a lone row's sums are split across threads, and round apart from the same row among others
        return [t[:1] for t in scores(logits.repeat(2, 1), targets.repeat(2), width, compiled)]
    top_values, top_ids = two_level_topk(logits, width)
    best = top_values[:, :1] if width else logits.amax(-1, keepdim=True)
    logprob, rank, log_total = (compiled_target_scores() if compiled else target_scores)(logits, targets, best)
    host = (logprob, rank, top_ids, top_values - log_total)
    return [t.cpu().numpy() for t in host]


def entries(logits, targets, widths, compiled=False):
    """logits (R, V), targets (R,), each row's width -> an entry for each row: {target: Logprob, then the
    width likeliest ids'}, computed on the logits' device (compiled: as scores)."""
    return entries_of(scores(logits, targets, max(widths), compiled), targets, widths)


def entries_of(host, targets, widths):
    """scores' arrays on the host, the rows' targets (R,) and widths -> an entry for each row."""
    logprob, rank, top_ids, top_logprobs = (a.tolist() for a in host)
    rows = zip(targets.tolist(), logprob, rank, top_ids, top_logprobs, widths)
    return [entry(*own, ids[:width], values[:width]) for *own, ids, values, width in rows]


def entry(token, logprob, rank, top_ids, top_logprobs):
    """vLLM's entry: {token: Logprob(logprob, rank), then each of the likeliest ids: its Logprob, ranked by place}.
    A token among the likeliest stays first and takes its place as its rank, as vLLM's dict does (they differ only
    where ids tie)."""
    out = {token: Logprob(logprob, rank)}
    for place, (i, value) in enumerate(zip(top_ids, top_logprobs), 1):
        out[i] = Logprob(value, place)
    return out
