"""Short chunks after cached K/V attend together: each a row padded to the longest, in one call a layer, as the
core's one-token entries do. A chunk of a few tokens after a long cached context otherwise costs a gather and an
attention call of its own in every layer (PagedBatch.attend_chunk). Two extensions make many such chunks:
speculation, whose verify rows are a sequence's next token and its proposals (ext/speculative.py), and prompt
logprobs, whose scored continuations follow a context in the prefix cache (ext/logprobs.py; a multiple-choice
question's later choices). Each composes it into the engine's batch class (padded_batch_class); a plain engine
attends each chunk alone. The CUDA extension's switch pad_chunks=True (off until a GPU has measured it) pads
every chunk of a step, prompts from their start too, where padding at most doubles the rows: on a GPU a step's
prompt chunks then cost one attention call a layer instead of one each.

Prompts from their start that sit side by side in a step with one length each (the windows of a text scored
for perplexity, or a batch of equal prompts) attend together too, on a CPU: one causal call a layer over
(count, length) rows, no padding, instead of one call each (fresh_runs; a step of eight 256-token windows at
the shipped model's heads: 1.55 ms a layer against 1.96, the same values). On CUDA they attend one at a time
until a GPU has measured it.

A step whose one padded chunk is its sequence's alone (batch-1 speculation's verify rows) reads its keys in
place where its blocks follow each other, as the core's lone decode row does (slots_in_place): no gather, no
padding, its mask built once a step: 1.16x a batch-1 speculating run (docs/speculation.md). On a CPU; on CUDA once a GPU has measured it.

Padding changes nothing a row's real tokens see: a padding query repeats its row's last token, and a row's keys
past its own are masked (model.attend), as in the one-token call. The products run over a padded shape, so a
token's attention equals its chunk's alone up to rounding (2.4e-7 in float32; the tests compare in float64)."""

import functools
import itertools

import numpy as np
import torch
import torch.nn.functional as F

from batch import longs
from model import attend, visible_keys
from paged import blocks_for, gather_kv

SHORT = 32  # the most new tokens of a chunk that attends padded: padding costs at most the longest's


def is_short(chunk):
    """Whether a chunk attends padded: a few new tokens after cached K/V."""
    return chunk.num_cached > 0 and chunk.end - chunk.start <= SHORT


def few_padding(chunks):
    """Whether padding every chunk to the longest at most doubles their rows."""
    lengths = [c.end - c.start for c in chunks]
    return len(lengths) * max(lengths, default=0) <= 2 * sum(lengths)


def slots_in_place(blocks, num_keys, block_size):
    """blocks: (W,) a sequence's block table, a host array -> the slots of its first num_keys keys as one slice of
    the pool's (flattened) slots, where its blocks follow each other (as the LIFO allocator hands a lone sequence
    them, and as PagedBatch checks a lone decode row's); else None."""
    blocks = blocks[: blocks_for(num_keys, block_size)]
    if not (np.diff(blocks) == 1).all():
        return None
    return slice(int(blocks[0]) * block_size, int(blocks[0]) * block_size + num_keys)


def fresh_runs(chunks, skip):
    """Runs of at least two chunks side by side, none of them in skip, each a prompt from its start (no cached
    K/V) and all of one length: [(the run's first chunk, its chunks, their length)]."""

    def length(i):  # None: the chunk attends on its own
        c = chunks[i]
        return c.end - c.start if c.num_cached == 0 and i not in skip else None

    runs = [(n, list(run)) for n, run in itertools.groupby(range(len(chunks)), length)]
    return [(run[0], len(run), n) for n, run in runs if n is not None and len(run) > 1]


class PaddedChunks:
    """A mixin of the engine's batch class: the step's chunks of at most SHORT new tokens after cached K/V attend
    in one call; on a CPU, each run of prompts from their start side by side and of one length in one more (runs:
    fresh_runs'); the others, long chunks and lone prompts, one at a time. On the device, besides the batch's:
        padded_index: (R, Q) each padded chunk's tokens in the step's, its last repeated as padding;
        padded_pos: (R, Q) their positions; padded_table: (R, W) the chunks' blocks;
        padded_real: the real tokens' places in the flattened (R * Q) rows."""

    every_chunk = False  # pad_chunks=True (ext/cuda.py): every chunk, where few_padding
    lone_in_place = True  # a lone chunk reads its keys in place (the batch-invariant forward's keep their shapes)

    def __init__(self, plan, samplers, *args):
        super().__init__(plan, samplers, *args)
        every = self.every_chunk and few_padding(self.chunks)
        self.padded = [i for i, chunk in enumerate(self.chunks) if every or is_short(chunk)]
        self.runs = [] if self.k_pool.is_cuda else fresh_runs(self.chunks, set(self.padded))
        self.lone_slots = None
        # in place, unpadded, where its blocks follow each other; on a CPU (on CUDA once a GPU has measured it)
        if len(self.padded) == 1 and self.lone_in_place and self.k_pool.device.type == "cpu":
            chunk = self.chunks[self.padded[0]]
            blocks = self.table[chunk.entry].numpy()  # on a CPU, the host array it was staged from
            num_keys = chunk.num_cached + chunk.end - chunk.start
            self.lone_slots = slots_in_place(blocks, num_keys, self.k_pool.shape[2])
        if self.lone_slots:  # its mask once a step, not once a layer: 0 where a query sees a key, else -inf
            unseen = np.arange(num_keys) > np.arange(chunk.num_cached, num_keys)[:, None]  # (n, L)
            self.lone_mask = torch.from_numpy(np.where(unseen, -np.inf, 0.0)).to(self.k_pool.dtype)[None, None]
        if not self.padded or self.lone_slots:
            return
        chunks = [self.chunks[i] for i in self.padded]
        self.lengths = [c.end - c.start for c in chunks]
        lengths = longs(self.lengths)[:, None]  # (R, 1)
        columns = np.arange(max(self.lengths))  # (Q,)
        offsets = np.minimum(columns, lengths - 1)  # (R, Q): a row's last token repeated as padding
        starts = longs([c.start for c in chunks])[:, None]  # (R, 1) in the step's tokens
        num_cached = longs([c.num_cached for c in chunks])[:, None]  # (R, 1)
        index, positions = starts + offsets, num_cached + offsets  # (R, Q) each
        longest = int(positions[:, -1].max()) + 1  # keys
        num_blocks = blocks_for(longest, self.k_pool.shape[2])
        real = (columns < lengths).flatten().nonzero()[0]  # the real tokens' places in the (R * Q) rows
        self.padded_index, self.padded_pos, self.padded_real = self.stage(index, positions, real)
        # the chunks' rows of the batch's table, already on the device (staging takes host arrays)
        entries = torch.from_numpy(longs([c.entry for c in chunks])).to(self.table.device)
        self.padded_table = self.table[entries, :num_blocks]

    def attend_chunks(self, layer, q, k, v):
        """The padded chunks in one call, each run of fresh chunks in one, the others one at a time: the chunks'
        outputs in order, in pieces: each chunk's (n, H, D), or a run's together."""
        if not (self.padded or self.runs):
            return super().attend_chunks(layer, q, k, v)
        pieces = self.attend_padded(layer, q) if self.padded else {}  # first chunk index -> its output
        covered = set(pieces)
        for first, count, length in self.runs:
            pieces[first] = self.attend_run(q, k, v, self.chunks[first].start, count, length)
            covered.update(range(first, first + count))
        for i, chunk in enumerate(self.chunks):
            if i not in covered:
                pieces[i] = self.attend_chunk(layer, chunk, q, k, v)
        return [pieces[i] for i in sorted(pieces)]

    def attend_run(self, q, k, v, start, count, length):
        """count prompts from their start, each of length tokens, side by side from the step's token start: one
        causal call -> their outputs in one piece, (count * length, H, D)."""
        rows = (t[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(*rows, is_causal=True).transpose(1, 2)  # (count, length, H, D)
        return y.flatten(0, 1)  # a view: CPU SDPA writes (count, length, H, D) in place

    def attend_padded(self, layer, q):
        """The padded chunks in one call -> {chunk index: its (n, H, D)}."""
        if self.lone_slots:  # one chunk, its keys in place: (L, H, D) each
            a, b = self.chunks[self.padded[0]].start, self.chunks[self.padded[0]].end
            keys, values = (pool[layer].flatten(0, 1)[self.lone_slots] for pool in (self.k_pool, self.v_pool))
            rows = (t.transpose(0, 1)[None] for t in (q[a:b], keys, values))  # (1, H, n or L, D)
            y = F.scaled_dot_product_attention(*rows, attn_mask=self.lone_mask)
            return {self.padded[0]: y[0].transpose(0, 1)}
        keys = gather_kv(self.k_pool[layer], self.padded_table)  # (R, L, H, D)
        values = gather_kv(self.v_pool[layer], self.padded_table)
        y = attend(q[self.padded_index], keys, values, visible_keys(keys, self.padded_pos))  # (R, Q, H, D)
        y = y.flatten(0, 1).index_select(0, self.padded_real)  # (n, H, D): the real tokens
        return dict(zip(self.padded, y.split(self.lengths)))


@functools.cache
def padded_batch_class(batch_class, every_chunk=False):
    """The engine's batch class (PagedBatch, or on CUDA one-copy staging's) with padded chunks, once; every_chunk:
    every chunk of a step padded, where few_padding."""
    padded = issubclass(batch_class, PaddedChunks)
    if padded and (batch_class.every_chunk or not every_chunk):  # padded before, as widely
        return batch_class
    name = ("PaddedEvery" if every_chunk else "Padded") + batch_class.__name__
    bases = (batch_class,) if padded else (PaddedChunks, batch_class)  # padded before, short chunks only: widened
    return type(name, bases, {"every_chunk": every_chunk})
