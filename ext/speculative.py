"""Speculative decoding by prompt lookup (vLLM's "ngram" method, Hugging Face's prompt_lookup_num_tokens), with
outputs identical to plain decoding, token for token.

Each decoding sequence may propose up to k tokens: those that followed the latest earlier occurrence of its
longest suffix of at most prompt_lookup_max tokens. Its plan entry then brings 1 + k tokens, its last token and
the proposals, which the forward attends over its cached K/V, every speculating sequence in one call. The step
draws, at each of the entry's positions, the token plain decoding would draw there: the sampler hashes (seed,
position), so a draw depends only on the logits and the position. The proposals are kept up to the first that
differs from its draw, and that draw is kept too. The rest is rolled back exactly: the rejected tokens leave the
sequence, its num_computed counts only the kept K/V, blocks past the one its next token goes in go back to the
allocator at once, and only blocks whose every token was kept enter the prefix cache.

Plugs into the paged engine at schedule_decodes (proposals get slots, never by preempting, and wait in
Sequence.proposed until verified), samplers (a sampler for each of an entry's positions), batch_class (verify
rows attend together, padded: ext/padded_chunks.py), mark_computed, append_tokens (verify and roll back) and
release.
Speculation never preempts and never runs for beams. num_speculative_tokens "auto" speculates only while
few sequences decode, where a verify step costs about what a decode step costs (AUTO_MAX_DECODING), each
sequence as many tokens as its own acceptance earns (proposals_for)."""

from engine import PlanEntry, Sampler
from ext.padded_chunks import padded_batch_class
from paged import blocks_for
from sequence import SequenceStatus

# num_speculative_tokens "auto": speculation while at most AUTO_MAX_DECODING sequences decode (bench/speculation.py
# measures where it stops paying on a CPU: docs/speculation.md), each sequence proposing AUTO_TOKENS at first,
# then as many as its own acceptance earns, up to AUTO_MAX_TOKENS (Speculative.proposals_for)
AUTO_TOKENS = 4
AUTO_MAX_TOKENS = 8
AUTO_MAX_DECODING = 8


def next_auto_tokens(k, proposed, accepted):
    """auto's count for a sequence that proposed k tokens and had `accepted` of the `proposed` verified: 2 more if
    it accepted every one (up to AUTO_MAX_TOKENS), 1 fewer (down to 1) if some, half if none, as Hugging Face's
    heuristic schedule for its assistant's tokens, with the halving added. At 0 the sequence guesses instead
    (Speculative.guess), which costs no forward, and proposes 1 token again once a guess is the token drawn."""
    if accepted == proposed:
        return min(k + 2, AUTO_MAX_TOKENS)
    return max(k - 1, 1) if accepted else k // 2


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, for n up to max_n: ends[gram] is the position just
    after its latest occurrence that some token follows. Grows with the sequence's kept tokens, which only grow."""

    def __init__(self, max_n):
        self.max_n = max_n
        self.ends = {}
        self.indexed = 0  # the positions below it are indexed as an n-gram's end

    def propose(self, tokens, k):
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        while self.indexed < len(tokens) - 1:  # a gram ending at the last token has no token after it yet
            self.indexed += 1
            for n in range(1, min(self.max_n, self.indexed) + 1):
                self.ends[tuple(tokens[self.indexed - n : self.indexed])] = self.indexed
        for n in range(min(self.max_n, len(tokens)), 0, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


class Speculative:
    """A PagedEngine mixin: prompt-lookup speculation, off while num_speculative_tokens is 0."""

    def __init__(self, model, *, num_speculative_tokens=0, prompt_lookup_max=3, **kw):
        super().__init__(model, **kw)
        auto = num_speculative_tokens == "auto"
        if not auto and not (isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 0):
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens!r} must be an int >= 0 or 'auto'")
        if prompt_lookup_max < 1:
            raise ValueError(f"prompt_lookup_max is {prompt_lookup_max}; it must be at least 1")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.batch_class = padded_batch_class(self.batch_class)  # verify rows attend together
        self.indexes = {}  # sequence -> its NgramIndex
        self.proposing = []  # the sequences whose proposals (s.proposed) this step verifies
        self.auto_tokens = {}  # sequence -> how many it may propose, with auto
        self.guesses = {}  # sequence -> the token it would propose, while auto lets it propose none

    def speculating(self, num_decoding):
        """Whether sequences propose this step: not while speculation is off; with auto, not while more than
        AUTO_MAX_DECODING sequences decode, nor while a prompt waits to prefill, whose tokens would share the
        step's budget with the proposals."""
        if self.num_speculative_tokens != "auto":
            return self.num_speculative_tokens > 0
        if num_decoding > AUTO_MAX_DECODING:
            return False
        prefilling = any(s.status is SequenceStatus.PREFILLING for s in self.running)
        admissible = self.waiting and len(self.running) < self.max_batch
        return not (prefilling or admissible)

    def proposals_for(self, s, num_decoding):
        """How many tokens s may propose, in a step that speculates: num_speculative_tokens; with auto, a count of
        its own (next_auto_tokens), AUTO_TOKENS at first, past AUTO_TOKENS only for a sequence decoding alone.
        A sequence readmitted after preemption starts again at AUTO_TOKENS."""
        if self.num_speculative_tokens != "auto":
            return self.num_speculative_tokens
        # NOTE: a verify step pads its rows to the longest, so beside other sequences none proposes past AUTO_TOKENS
        most = AUTO_MAX_TOKENS if num_decoding == 1 else AUTO_TOKENS
        return min(self.auto_tokens.get(s, AUTO_TOKENS), most)

    def schedule_decodes(self):
        """Each decoding sequence's next token, then its proposals, while the token budget and free blocks
        above the watermark last: speculation never preempts."""
        plan = super().schedule_decodes()
        if not self.speculating(len(plan)):
            return plan
        budget = self.token_budget - len(plan)
        speculating = []
        for s, n in plan:
            k = self.proposals_for(s, len(plan))
            if self.num_speculative_tokens == "auto":
                self.auto_tokens[s] = k  # what it proposes: its verify step adjusts this
            if not k:
                self.guess(s)
            proposal = self.propose(s, min(k, budget))
            proposal = proposal[: self.reserve_proposals(s, len(proposal))]
            if proposal:
                s.proposed = proposal
                self.proposing.append(s)
            budget -= len(proposal)
            speculating.append(PlanEntry(s, n + len(proposal)))
        return speculating

    def propose(self, s, k):
        """Up to k tokens for s, no more than plain decoding would still append: the step appends 1 + accepted."""
        r = s.request
        if r.params.num_beams > 1 or k < 1:
            return []
        room = r.max_new_tokens - (len(s.tokens) - len(r.prompt)) - 1
        if s not in self.indexes:
            self.indexes[s] = NgramIndex(self.prompt_lookup_max)
        index = self.indexes[s]
        return index.propose(s.tokens, min(k, room))

    def guess(self, s):
        """Auto's measure of acceptance for a sequence that proposes nothing: the token it would propose."""
        guess = self.propose(s, 1)
        if guess:
            self.guesses[s] = guess[0]

    def check_guesses(self, samplers, tokens):
        """A sequence whose guess is the token drawn proposes 1 token again."""
        for x, token in zip(samplers, tokens):
            if self.guesses.pop(x.sequence, None) == token:
                self.auto_tokens[x.sequence] = 1

    def reserve_proposals(self, s, k):
        """Slots for up to k proposed tokens after s's next token, in free blocks above the watermark -> how many."""
        held = len(s.block_table)
        while k and blocks_for(s.num_computed + 1 + k, self.block_size) - held > self.spare_blocks():
            k -= 1
        num_new = blocks_for(s.num_computed + 1 + k, self.block_size) - held
        self.place_blocks(s, held, self.allocator.allocate(max(0, num_new)))
        return k

    def samplers(self, plan):
        """A speculating sequence draws at each of its entry's positions: back = 0 reads its last proposal's
        logits, back = k its next token's."""
        samplers = super().samplers(plan)
        for i, (s, _) in enumerate(plan):
            if s.proposed:
                samplers += [Sampler(s, i, back) for back in range(len(s.proposed) + 1)]
        return samplers

    def mark_computed(self, plan):
        """Only the tokens known to be kept count: each speculating entry's first, its next token; the
        proposals count once verified, so that no block holding one enters the prefix cache before."""
        if not self.proposing:
            return super().mark_computed(plan)
        verified = [n - len(s.proposed) for s, n in plan]
        super().mark_computed([PlanEntry(s, n) for (s, _), n in zip(plan, verified)])

    def append_tokens(self, samplers, tokens):
        """Verify each speculating sequence's proposals against its draws, roll back the rejected, and append
        the kept draws one at a time, as plain decoding would."""
        if self.guesses:
            self.check_guesses(samplers, tokens)
        if not self.proposing:
            return super().append_tokens(samplers, tokens)
        drawn = {}  # a speculating sequence -> its draws, at positions num_computed, num_computed + 1, ...
        plain, plain_tokens = [], []
        for x, token in zip(samplers, tokens):
            if x.sequence.proposed:
                drawn.setdefault(x.sequence, {})[x.back] = (x, token)
            else:
                plain.append(x)
                plain_tokens.append(token)
        super().append_tokens(plain, plain_tokens)
        for s, by_back in drawn.items():
            in_order = sorted(by_back, reverse=True)  # back k first: the draw at s's next position
            self.verify(s, [by_back[back] for back in in_order])
        self.proposing = []

    def verify(self, s, draws):
        """draws: (sampler, token) at s's positions num_computed, ... -> the kept: the draws up to and including
        the first that differs from the proposal before it; the K/V of the kept proposals stay computed."""
        proposal = s.proposed
        s.proposed = []
        kept = 1
        tokens = [token for _, token in draws]
        while kept < len(draws) and tokens[kept - 1] == proposal[kept - 1]:
            kept += 1
        if self.num_speculative_tokens == "auto":
            self.auto_tokens[s] = next_auto_tokens(self.auto_tokens[s], len(proposal), kept - 1)
        num_before = s.num_computed
        s.num_computed += kept - 1  # the accepted proposals' K/V: they are the kept draws before the last
        appended = 0
        for sampler, token in draws[:kept]:
            if s.status is not SequenceStatus.DONE:  # eos or max_new_tokens drops the rest
                super().append_tokens([sampler], [token])
                appended += 1
        # a Meter counts them, per request and in all: the accepted that became tokens, before an eos among them
        self.notify("verified", s, len(proposal), appended - 1)
        if s.status is not SequenceStatus.DONE:
            self.roll_back(s, num_before)

    def roll_back(self, s, num_before):
        """Blocks past the one the next token goes in, which held only rejected slots, go back to the allocator;
        blocks that filled with kept tokens join the prefix cache."""
        keep = blocks_for(s.num_computed + 1, self.block_size)
        self.allocator.free(s.block_table[keep:])
        del s.block_table[keep:]
        if self.prefix_cache:
            self.allocator.register_filled(s, num_before, s.num_computed)

    def release(self, s):
        self.indexes.pop(s, None)
        self.auto_tokens.pop(s, None)
        self.guesses.pop(s, None)
        super().release(s)
