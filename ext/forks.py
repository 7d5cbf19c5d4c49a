"""n samples and beam search: forks of a sequence that share its K/V. A prompt of n samples is computed once and
forks when its first tokens are drawn (sample i is seeded seed + i); beam search is HF's, its beams forking and
dying as their scores rank. On the paged engine forks share their parent's blocks, and a block held by more
than one sequence is copied before it is written (copy-on-write).

Forks plugs into any engine at check_extensions, samplers, mark_computed, sample and append_tokens; PagedForks
adds the paged scheduler's side (blocks_needed, reserve_slot, preempt, admit_next, can_admit), as a beam group
is preempted and readmitted whole. An engine gives a fork its parent's K/V in fork_kv."""

from dataclasses import replace

import torch

from engine import Sampler
from sequence import Sequence, SequenceStatus


class Beam(Sequence):
    """A sequence of beam search: its summed log-probability (a finished hypothesis's: over its new tokens **
    length_penalty), and its next-token log-probabilities, held until every beam of its group has its own."""

    def __init__(self, request, tokens, seed):
        super().__init__(request, tokens, seed)
        self.score = 0.0
        self.next_logprobs = None


def width(r):
    """The sequences a request runs at once."""
    return max(r.params.n, r.params.num_beams)


def num_rows(s):
    """Rows admission finds for s: before its prompt forks, every sequence its request will run."""
    return 1 if len(s.request.sequences) > 1 else width(s.request)  # forks never fall back to one


def is_beam(s):
    return s.request.params.num_beams > 1


def rows_held(sequences):
    """Rows the sequences take: a beam group its width, however many beams it runs now (a first step picks at most
    one beam an id, and the group grows back to its width later), any other sequence its num_rows."""
    groups = {s.request for s in sequences if is_beam(s)}
    return sum(width(r) for r in groups) + sum(num_rows(s) for s in sequences if not is_beam(s))


class Forks:
    """n samples and beam search, for an Engine subclass that defines fork_kv(parent, child)."""

    def __init__(self, model, *, early_stopping=False, **kw):
        super().__init__(model, **kw)
        if early_stopping not in (False, True, "never"):
            raise ValueError(f"early_stopping {early_stopping!r} must be False, True or 'never', as Hugging Face's")
        self.early_stopping = early_stopping  # when a beam group stops, as HF's generate(early_stopping=...)
        self.forked = []  # (parent, child) of the forks made this step: they take the K/V once it is written
        self.beam_logprobs = None  # the step's beams' next-token log-probabilities, on the host
        self.hypotheses = {}  # a beam request -> its finished hypotheses, (score, tokens), best first
        self.improvable = {}  # a beam request -> whether a live beam may still beat its worst hypothesis

    def add(self, r):
        if r.params.num_beams > 1 and not isinstance(r.sequences[0], Beam):
            r.sequences = [Beam(r, r.prompt, r.params.seed)]
        super().add(r)

    def check_extensions(self, r, p):
        """n samples and beams: checked here, then the core checks the rest with them at their defaults."""
        if (p.n, p.num_beams) != (1, 1):
            self.check_forks(r, p)
        super().check_extensions(r, replace(p, n=1, num_beams=1))

    def check_forks(self, r, p):
        if min(p.n, p.num_beams) < 1:
            raise ValueError(f"n {p.n} and num_beams {p.num_beams} must be at least 1")
        drawing = p.temperature or p.top_k is not None or p.top_p < 1 or p.min_p
        if p.num_beams > 1 and (p.n > 1 or drawing):
            why = f"num_beams {p.num_beams}: beam search is greedy"
            raise ValueError(f"{why}: no n, temperature, top_k, top_p or min_p")
        if width(r) > self.max_batch:
            raise ValueError(f"{width(r)} sequences of one request exceed the {self.max_batch} that run at once")

    def samplers(self, plan):
        """Fork each prompt of n samples whose last chunk is planned, so that its forks draw in this step too,
        from its logits."""
        samplers = []
        for x in super().samplers(plan):
            r = x.sequence.request
            forks = r.params.n > 1 and len(r.sequences) == 1 and not x.back  # its prompt's last logits
            # in the prompt's last chunk only: prompt logprobs (ext/logprobs.py) draw in earlier chunks too
            if forks and plan[x.entry].num_tokens == x.sequence.num_uncomputed():
                seeds = range(r.params.seed + 1, r.params.seed + r.params.n)
                r.sequences += [self.fork(x.sequence, seed) for seed in seeds]
                self.forked += [(x.sequence, child) for child in r.sequences[1:]]
                samplers += [Sampler(child, x.entry) for child in r.sequences]
            else:
                samplers.append(x)
        return samplers

    def fork(self, s, seed):  # a sequence that runs on its own from s's tokens; fork_kv gives it s's K/V
        child = type(s)(s.request, s.tokens, seed)
        self.start(child)
        child.status = s.status
        return child

    def mark_computed(self, plan):
        super().mark_computed(plan)
        for parent, child in self.forked:  # the forward has written the parent's K/V: the forks share them
            self.fork_kv(parent, child)
        self.forked = []

    def sample(self, logits, batch, samplers):
        beams = [j for j, (s, _, _) in enumerate(samplers) if is_beam(s)]
        self.beam_logprobs = None
        if beams:  # in float32, as HF's beam search
            self.beam_logprobs = torch.log_softmax(logits[beams].float(), -1).cpu()
        return super().sample(logits, batch, samplers)

    def append_tokens(self, samplers, tokens):
        """A beam holds its log-probabilities instead of a token; its group steps once all its beams hold theirs."""
        if self.beam_logprobs is None:  # no beam sampled this step
            return super().append_tokens(samplers, tokens)
        plain = [j for j, x in enumerate(samplers) if not is_beam(x.sequence)]
        plain_tokens = [tokens[j] for j in plain]
        super().append_tokens([samplers[j] for j in plain], plain_tokens)
        beams = [x for x in samplers if is_beam(x.sequence)]
        for (s, _, _), logprobs in zip(beams, self.beam_logprobs):
            s.status = SequenceStatus.DECODING
            s.next_logprobs = logprobs
            if all(b.next_logprobs is not None for b in s.request.sequences):
                self.step_beams(s.request)

    def step_beams(self, r):
        """One step of beam search for r's group, as Hugging Face's generate(num_beams=k, eos_token_id,
        length_penalty, early_stopping): the 2k likeliest continuations of its live beams by summed
        log-probability (float32); of the first k, those that end (at eos, or at max_new_tokens) join its
        hypotheses, scored by their sum over (new tokens) ** length_penalty, the best k kept; the k best that do
        not end run on (HF's, padded with ended ones scored 1e9 lower). A beam continued more than once forks;
        one not continued dies and frees its blocks at once."""
        k = r.params.num_beams
        beams = r.sequences
        next_logprobs = torch.stack([b.next_logprobs for b in beams])  # (B, V)
        scores = next_logprobs + torch.tensor([b.score for b in beams])[:, None]  # summed, in float32 as HF's
        # (2k,): float32, best first; k where only max_new_tokens ends a beam, as the extra k then never matter
        num_picks = k if r.params.eos is None else 2 * k
        top = scores.flatten().topk(min(num_picks, scores.numel()))
        V = scores.shape[1]
        picks = [(beams[i // V], i % V) for i in top.indices.tolist()]
        new_tokens = len(r.generated) + 1
        last = new_tokens == r.max_new_tokens
        ends = [last or token == r.params.eos for _, token in picks]
        if any(ends[:k]):
            penalized = top.values[:k] / new_tokens**r.params.length_penalty  # an ended pick's score, as HF's
            self.add_hypotheses(r, picks[:k], penalized.tolist(), ends[:k])
        running = list(enumerate(top.values.tolist()))[:k]  # (pick, score) of the k best that run on
        if any(ends):  # HF's: ended picks run on, scored 1e9 lower (float32), only where k others cannot
            lowered = torch.tensor(ends) * 1e9  # float32
            runners = (top.values - lowered).topk(min(k, len(picks)))
            running = list(zip(runners.indices.tolist(), runners.values.tolist()))
        done = all(ends) or self.beams_done(r, running[0][1], new_tokens)  # all end at max_new_tokens
        if done:
            return self.finish_beams(r)
        parents = [picks[j][0] for j, _ in running]
        for b in beams:
            if b not in parents:
                self.stop(b, SequenceStatus.DEAD)
        r.sequences = self.continue_beams(parents)
        for b, (j, score) in zip(r.sequences, running):
            b.tokens.append(picks[j][1])
            b.score = score
            b.next_logprobs = None

    def add_hypotheses(self, r, picks, scores, ends):
        """The picks that end join r's hypotheses, unless k are in and early_stopping is True, or no live beam
        could beat them (HF's heuristic); the best k stay, best first."""
        hypotheses = self.hypotheses.setdefault(r, [])
        full = len(hypotheses) == r.params.num_beams
        if not self.improvable.setdefault(r, True) or full and self.early_stopping is True:
            return
        for (b, token), score, end in zip(picks, scores, ends):
            if end:
                hypotheses.append((score, b.tokens + [token]))
        hypotheses.sort(key=lambda h: -h[0])
        del hypotheses[r.params.num_beams :]

    def beams_done(self, r, best, new_tokens):
        """Whether r's group stops: k hypotheses are in and early_stopping is True, or none of its live beams, the
        best scoring `best`, can beat the worst of them (HF's heuristic: at its length now, or with
        early_stopping "never" and a positive length_penalty, at max_new_tokens)."""
        hypotheses, lp = self.hypotheses.get(r, []), r.params.length_penalty
        if len(hypotheses) < r.params.num_beams:
            return False
        length = r.max_new_tokens if self.early_stopping == "never" and lp > 0 else new_tokens
        if not torch.tensor(best) / length**lp > hypotheses[-1][0]:  # in float32, as HF's
            self.improvable[r] = False
        return self.early_stopping is True or not self.improvable[r]

    def finish_beams(self, r):
        """r's live beams stop, and its hypotheses, best first, become its sequences."""
        for b in r.sequences:
            self.stop(b, SequenceStatus.DONE)
        r.sequences = []
        for score, tokens in self.hypotheses.pop(r):
            r.sequences.append(Beam(r, tokens, r.params.seed))
            r.sequences[-1].score = score
            r.sequences[-1].status = SequenceStatus.DONE
        del self.improvable[r]
        self.finish(r)

    def continue_beams(self, parents):
        """A beam for each pick: its parent the first time, then forks of it that share its K/V. Forks copy
        the parent's tokens before it grows."""
        beams = []
        for parent in parents:
            if parent in beams:  # continued before: fork it
                child = self.fork(parent, parent.seed)
                self.fork_kv(parent, child)
                beams.append(child)
            else:
                beams.append(parent)
        return beams


class PagedForks(Forks):
    """Forks on the paged engine: they share blocks, copied on write; a beam group is preempted and admitted
    whole, since a beam needs all its group to step."""

    def blocks_needed(self, r):  # a preempted beam group comes back whole
        return super().blocks_needed(r) * r.params.num_beams

    def fork_kv(self, parent, child):
        for block in parent.block_table:
            self.allocator.share(block)
        child.block_table = parent.block_table[:]
        child.num_computed = parent.num_computed
        self.block_tables[child.row] = self.block_tables[parent.row]

    def reserve_slot(self, s):
        """s's next token goes in a block others hold too: copy it into a new block that s holds alone (shared
        blocks are never written). May preempt s itself."""
        k = s.num_computed // self.block_size  # the block its next token goes in
        shared = s.block_table[k] if k < len(s.block_table) else None
        if shared is None or self.allocator.ref_count[shared] == 1:
            return super().reserve_slot(s)
        if not self.make_room(s):
            return
        [block] = self.allocator.allocate(1)
        self.kv_pool[:, :, block] = self.kv_pool[:, :, shared]
        self.allocator.free([shared])
        self.place_blocks(s, k, [block])
        self.notify("copied", block)

    def group(self, s, sequences):
        """s, with the rest of its beam group among `sequences`, in their order."""
        if not is_beam(s):
            return [s]
        return [x for x in sequences if x.request is s.request]

    def preempt(self, s):
        """s, with its whole beam group."""
        for x in reversed(self.group(s, self.running)):
            if isinstance(x, Beam):  # a beam that held its logprobs computes its last token again, for them
                x.num_computed = min(x.num_computed, len(x.tokens) - 1)
                x.next_logprobs = None
            super().preempt(x)

    def admit_next(self):
        """A preempted beam group heads the queue, and is admitted whole."""
        group = self.group(self.waiting[0], self.waiting)
        if len(group) == 1:
            return super().admit_next()
        cached_prefix = self.allocator.cached_prefix
        hits = [cached_prefix(x, self.cacheable(x)) if self.prefix_cache else [] for x in group]
        # a free block that several members hit is counted for each: admission waits for more than it takes
        need = sum(self.blocks_to_admit(x, cached) for x, cached in zip(group, hits))
        if rows_held(self.running + group) > self.max_batch:
            return []
        if need > self.spare_blocks():
            return []
        # NOTE: every hit is shared before any member allocates, which could evict a free cached block
        # that another member of the group is about to share
        for cached in hits:
            for block in cached:
                self.allocator.share(block)
        for s, cached in zip(group, hits):
            self.waiting.popleft()  # the group heads the queue
            self.admit(s, cached)
        self.notify("admitted", group)
        return group

    def can_admit(self, s, cached, copies=0):
        """Rows for every sequence s's request will run, and blocks for its forks' copies of a shared last block."""
        if rows_held([*self.running, s]) > self.max_batch:
            return False
        # the forks of a prompt each copy its last block, if partly filled, on their first write; alone, a
        # sequence's forks may preempt each other
        if self.running and len(s.tokens) % self.block_size:
            copies += num_rows(s) - 1
        return super().can_admit(s, cached, copies)
