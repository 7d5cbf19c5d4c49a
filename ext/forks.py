"""n samples and beam search: forks of a sequence that share its K/V. A prompt of n samples is computed once and
forks when its first tokens are drawn (sample i is seeded seed + i); beam search is HF's, its beams forking and
dying as their scores rank. On the paged engine forks share their parent's blocks, and a block held by more
than one sequence is copied before it is written (copy-on-write).

Forks plugs into any engine at check_forks, samplers, mark_computed, sample and append_tokens; PagedForks
adds the paged scheduler's side (blocks_needed, reserve_slot, preempt, admit_next, can_admit), as a beam group
is preempted and readmitted whole. An engine gives a fork its parent's K/V in fork_kv."""

import torch

from engine import Sampler
from sequence import Sequence, SequenceStatus


class Beam(Sequence):
    """A sequence of beam search: its summed log-probability, and its next-token log-probabilities, held until
    every beam of its group has its own."""

    def __init__(self, request, tokens, seed):
        super().__init__(request, tokens, seed)
        self.score = 0.0
        self.logprobs = None


def width(r):
    """The sequences a request runs at once."""
    return max(r.params.n, r.params.num_beams)


def num_rows(s):
    """Rows admission finds for s: before its prompt forks, every sequence its request will run."""
    return 1 if len(s.request.sequences) > 1 else width(s.request)  # forks never fall back to one


def is_beam(s):
    return s.request.params.num_beams > 1


class Forks:
    """n samples and beam search, for an Engine subclass that defines fork_kv(parent, child)."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.forked = []  # (parent, child) of the forks made this step: they take the K/V once it is written
        self.beam_logprobs = None  # the step's beams' next-token log-probabilities, on the host

    def add(self, r):
        if r.params.num_beams > 1 and not isinstance(r.sequences[0], Beam):
            r.sequences = [Beam(r, r.prompt, r.params.seed)]
        super().add(r)

    def check_forks(self, r):  # the core calls it for n or num_beams other than 1
        p = r.params
        beam_ready = p.n == 1 and p.temperature == 0 and p.top_k is None and p.eos is None
        if min(p.n, p.num_beams) < 1 or (p.num_beams > 1 and not beam_ready):
            why = f"n {p.n} and num_beams {p.num_beams} must be at least 1"
            raise ValueError(f"{why}; beam search is greedy and runs max_new_tokens: no n, temperature, top_k or eos")
        if width(r) > self.max_batch:
            raise ValueError(f"{width(r)} sequences of one request exceed the {self.max_batch} that run at once")

    def samplers(self, plan):
        """Fork each prompt of n samples whose last chunk is planned, so that its forks draw in this step too,
        from its logits."""
        samplers = []
        for s, i, _ in super().samplers(plan):
            r = s.request
            if r.params.n > 1 and len(r.sequences) == 1:
                seeds = range(r.params.seed + 1, r.params.seed + r.params.n)
                r.sequences += [self.fork(s, seed) for seed in seeds]
                self.forked += [(s, x) for x in r.sequences[1:]]
                samplers += [Sampler(x, i) for x in r.sequences]
            else:
                samplers.append(Sampler(s, i))
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
        plain = [x for x in samplers if not is_beam(x.sequence)]
        plain_tokens = [token for x, token in zip(samplers, tokens) if not is_beam(x.sequence)]
        super().append_tokens(plain, plain_tokens)
        beams = [x for x in samplers if is_beam(x.sequence)]
        for (s, _, _), logprobs in zip(beams, self.beam_logprobs):
            s.status = SequenceStatus.DECODING
            s.logprobs = logprobs
            if all(b.logprobs is not None for b in s.request.sequences):
                self.step_beams(s.request)

    def step_beams(self, r):
        """One step of beam search for r's group, as HF's: the num_beams likeliest continuations of its
        live beams by summed log-probability (float32) survive, best first; a beam continued more than once
        forks, and a beam not continued dies and frees its blocks. Ends when the beams reach max_new_tokens."""
        beams = r.sequences
        logprobs = torch.stack([b.logprobs for b in beams])  # (B, V)
        scores = logprobs + torch.tensor([b.score for b in beams])[:, None]
        # fewer than num_beams only when the vocabulary is smaller
        top = scores.flatten().topk(min(r.params.num_beams, scores.numel()))
        V = scores.shape[1]
        indices = top.indices.tolist()
        values = top.values.tolist()
        picks = [(beams[i // V], i % V, score) for i, score in zip(indices, values)]
        parents = [parent for parent, _, _ in picks]
        for b in beams:
            if b not in parents:
                self.stop(b, SequenceStatus.DEAD)
        r.sequences = self.continue_beams(parents)
        for b, (_, token, score) in zip(r.sequences, picks):
            b.tokens.append(token)
            b.score = score
            b.logprobs = None
        if len(r.generated) == r.max_new_tokens:
            for b in r.sequences:
                b.score /= r.max_new_tokens**r.params.length_penalty  # as HF scores a finished beam
                self.stop(b, SequenceStatus.DONE)
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
        if k == len(s.block_table) or self.allocator.ref_count[s.block_table[k]] == 1:
            return super().reserve_slot(s)
        if not self.make_room(s):
            return
        shared = s.block_table[k]
        [block] = self.allocator.allocate(1)
        self.kv_pool[:, :, block] = self.kv_pool[:, :, shared]
        self.allocator.free([shared])
        self.place_blocks(s, k, [block])
        self.notify("copied", block)

    def group(self, s, sequences):
        """s, with the rest of its beam group among `sequences`, in their order."""
        return [x for x in sequences if x.request is s.request] if is_beam(s) else [s]

    def preempt(self, s):
        """s, with its whole beam group."""
        for x in reversed(self.group(s, self.running)):
            if isinstance(x, Beam):  # a beam that held its logprobs computes its last token again, for them
                x.num_computed = min(x.num_computed, len(x.tokens) - 1)
                x.logprobs = None
            super().preempt(x)

    def admit_next(self):
        """A preempted beam group heads the queue, and is admitted whole."""
        group = self.group(self.waiting[0], self.waiting)
        if len(group) == 1:
            return super().admit_next()
        hits = [self.allocator.cached_prefix(x, self.cacheable(x)) if self.prefix_cache else [] for x in group]
        # a free block that several members hit is counted for each: admission waits for more than it takes
        need = sum(self.blocks_to_admit(x, cached) for x, cached in zip(group, hits))
        if sum(num_rows(x) for x in self.running + group) > self.max_batch or need > self.spare_blocks():
            return []
        # NOTE: every hit is shared before any member allocates, which could evict a free cached block
        # that another member of the group is about to share
        for block in (block for cached in hits for block in cached):
            self.allocator.share(block)
        for s, cached in zip(group, hits):
            self.waiting.popleft()  # the group heads the queue
            self.admit(s, cached)
        self.notify("admitted", group)
        return group

    def can_admit(self, s, cached, copies=0):
        """Rows for every sequence s's request will run, and blocks for its forks' copies of a shared last block."""
        if sum(num_rows(x) for x in self.running) + num_rows(s) > self.max_batch:
            return False
        # the forks of a prompt each copy its last block, if partly filled, on their first write; alone, a
        # sequence's forks may preempt each other
        if self.running and len(s.tokens) % self.block_size:
            copies += num_rows(s) - 1
        return super().can_admit(s, cached, copies)
