"""Batch-invariant forwards: every token's values, to the bit, a function of its own sequence's tokens only,
whatever else the step holds, the chunk the token sat in, what the prefix cache had, or the engine's token
budget. With invariant=True a choice scores the same with the cache on or off, alone or among 800 requests, and
a request's logprobs and tokens do not depend on what runs beside it (docs/scoring.md). On a CPU only.

The plain forward rounds by the step's shape, as every engine's does: CPU kernels pick their blocking by the
sizes they see. What torch 2.13's CPU kernels do (measured on an Intel Xeon with AMX, 2026-11-28):
- a linear layer gives a row other bits in a call of few rows (below 4-16 rows at the shipped model's sizes in
  float32, below 128 for one of them in bf16), and some change again at large counts (GPT-2 small's 3,072 ->
  768 projection from 511 rows); the prepared GELU (harness/tuning.py) takes another kernel below 2**14 values;
- the flash attention kernel gives a query other bits when its last visible key sits in a partial vector (16
  float32 keys, 32 bf16), when its block of queries (32, 64 or 256 by the call's count) holds it alone, and in
  a causal call, which cuts the keys at the query block's end; at GPT-2 small's heads also by the queries' count
  modulo 8 and by the keys' 512-key blocks.
So each step runs at least min_rows tokens and logits rows (the last repeated), and every token attends with an
explicit mask over keys padded to a multiple of key_multiple, in calls of a multiple of query_multiple queries
(invariant_attend). Norms, embeddings and the scores' log-sum-exp reduce within a row. All three are measured
when the engine starts, on the model's own layers and head shapes: min_rows by fewest_rows (the fewest rows from
which each row-wise layer gives a row the bits it gets at 2,048 rows, or the budget's count if larger), the
paddings by attention_paddings (the least of a few that keep a query's values in every call tried). Where none
holds, the engine refuses invariant=True in one line.

What it costs: chunks lose the causal kernel's skipped half and attend over padded keys, chunks after cached
K/V read them back padded (bench/scoring.py --invariant). Plugs into the engine at batch_class and forward."""

import functools

import torch
import torch.nn.functional as F

from model import attend, visible_keys
from paged import gather_kv

SMALL_COUNTS = 64  # fewest_rows tries every row count up to this, then LARGE_COUNTS
LARGE_COUNTS = (96, 128, 255, 256, 257, 511, 512, 513, 1024, 2047, 2048)
PADDINGS = [(keys, queries) for keys in (32, 64, 128, 256, 512) for queries in (2, 8, 32)]  # tried in this order


def pad_rows(t, rows):
    """t (N, ...) -> (max(N, rows), ...): the last row repeated (an empty t stays empty)."""
    if len(t) >= rows or not len(t):
        return t
    return torch.cat([t, t[-1:].expand(rows - len(t), *t.shape[1:])])


def pad_to(t, multiple):
    """t (B, L, H, D) -> (B, L', H, D): zeros after its L rows, up to a multiple of `multiple`."""
    extra = -t.size(1) % multiple
    return F.pad(t, (0, 0, 0, 0, 0, extra)) if extra else t  # F.pad copies even when it pads nothing


def invariant_attend(q, k, v, q_pos, key_multiple, query_multiple):
    """model.attend, each query's values independent of the queries beside it and of the keys past its own:
    keys padded with zeros (masked) to a multiple of key_multiple, queries to a multiple of query_multiple (the
    last repeated). q: (B, Q, H, D), k/v: (B, L, H, D), q_pos: (B, Q) -> (B, Q, H, D)."""
    k, v = pad_to(k, key_multiple), pad_to(v, key_multiple)
    Q = q.size(1)
    padding = -Q % query_multiple
    if padding:  # none of the kernel's query blocks (32, 64 or 256) is then left with one query
        q = torch.cat([q, q[:, -1:].expand(-1, padding, -1, -1)], 1)
        q_pos = torch.cat([q_pos, q_pos[:, -1:].expand(-1, padding)], 1)
    return attend(q, k, v, visible_keys(k, q_pos))[:, :Q]


def invariant_causal(q, k, v, key_multiple):
    """Prompts from their start, each attending causally over itself, q, k, v: (B, L, H, D) -> (B, L, H, D): the
    values invariant_attend gives, from a causal call over q, k, v padded with zeros to a multiple of
    key_multiple, so that every query block's keys end on a whole vector; it skips the keys past each block."""
    L = q.size(1)
    q, k, v = (pad_to(t, key_multiple).transpose(1, 2) for t in (q, k, v))  # (B, H, L', D) each
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)[:, :L]


def row_counts(most):
    return [n for n in [*range(1, SMALL_COUNTS + 1), *LARGE_COUNTS] if n <= most]


def fewest_rows_of(layer, x):
    """layer: a row-wise module, x: (most, C) random rows -> the fewest row counts from which layer(x[:n]) equals
    layer(x)[:n] at each count tried (row_counts), or None if the largest tried differs."""
    whole, counts = layer(x), row_counts(len(x))
    differs = [n for n in counts if not torch.equal(layer(x[:n]), whole[:n])]
    if counts[-1] in differs:
        return None
    return next(n for n in counts if n > max(differs, default=0))


def fewest_rows(model, most):
    """The fewest rows from which each of the model's row-wise layers gives a row the same values in a call of up
    to `most` rows; None if some layer differs at a count that padding cannot step over. The layers: the first
    block's (every block repeats them), the final norm and the lm_head, each fed random rows of its width."""
    block, width = model.transformer.h[0], model.config.n_embd
    hidden = block.mlp.c_fc.out_features
    layers = [
        (block.ln_1, width),
        (block.attn.c_attn, width),
        (block.attn.c_proj, width),
        (block.mlp.c_fc, width),
        (block.mlp.gelu, hidden),
        (block.mlp.c_proj, hidden),
        (model.transformer.ln_f, width),
        (model.lm_head, width),
    ]
    generator = torch.Generator().manual_seed(0)
    fewest = 1
    for layer, n in layers:
        x = torch.randn(most, n, generator=generator).to(model.lm_head.weight.dtype)
        rows = fewest_rows_of(layer, x)
        if rows is None:
            return None
        fewest = max(fewest, rows)
    return fewest


def attention_is_invariant(q, k, v, paddings):
    """Whether invariant_attend, with paddings (key_multiple, query_multiple), gives a query the same values in
    calls of other queries and keys, and invariant_causal too. q, k, v: (1, window, H, D) at the model's head
    shapes. The queries: one every 21 positions (each at another place in a 32-key vector), each alone, last in a
    prompt that ends with it (both calls), among the keys of a longer one, first in a chunk of 45, beside another
    row's queries, and in the whole window (both calls)."""
    window = q.size(1)
    positions = torch.arange(window)[None]

    def call(a, b, keys):  # queries a..b-1 over the first `keys` keys -> (b - a, H, D)
        return invariant_attend(q[:, a:b], k[:, :keys], v[:, :keys], positions[:, a:b], *paddings)[0]

    def causal(end):  # a prompt of `end` tokens from its start -> (end, H, D)
        return invariant_causal(q[:, :end], k[:, :end], v[:, :end], paddings[0])[0]

    def beside_another_row(p):  # query p last of two, in a call of two rows -> (H, D)
        rows = torch.cat([q[:, p - 1 : p + 1], q[:, :2]])
        keys, values = (t[:, : p + 1].expand(2, -1, -1, -1) for t in (k, v))
        rows_positions = torch.stack([positions[0, p - 1 : p + 1], positions[0, :2]])
        return invariant_attend(rows, keys, values, rows_positions, *paddings)[0, 1]

    whole_window, whole_prompt = call(0, window, window), causal(window)
    for p in range(1, window, 21):
        alone = call(p, p + 1, p + 1)[0]
        chunk_end = min(p + 45, window)
        others = [
            call(0, p + 1, p + 1)[p],  # last of a prompt
            causal(p + 1)[p],  # the same, causally
            call(max(p - 32, 0), p + 1, window)[-1],  # among a longer prompt's keys
            call(p, chunk_end, chunk_end)[0],  # first of a chunk
            beside_another_row(p),
            whole_window[p],
            whole_prompt[p],
        ]
        if not all(torch.equal(other, alone) for other in others):
            return False
    return True


def attention_paddings(num_heads, head_size, window, dtype):
    """The first of PADDINGS with which attention_is_invariant holds at these head shapes, or None."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, window, num_heads, head_size, generator=generator).to(dtype) for _ in range(3))
    for paddings in PADDINGS:
        if attention_is_invariant(q, k, v, paddings):
            return paddings
    return None


class InvariantRows:
    """A mixin of the engine's batch class: every token attends through invariant_attend with paddings (key_multiple,
    query_multiple), and the step's tokens and logits rows are padded to min_rows (num_tokens, num_logit_rows: the
    real ones)."""

    min_rows, paddings = 1, (32, 2)

    lone_in_place = False  # padded_chunks': a lone chunk too attends in the padded call's shapes

    def __init__(self, plan, samplers, *args):
        super().__init__(plan, samplers, *args)
        self.num_tokens, self.num_logit_rows = len(self.idx), len(self.logit_rows)
        padded = (pad_rows(t, self.min_rows) for t in (self.idx, self.positions, self.logit_rows))
        self.idx, self.positions, self.logit_rows = padded

    def attend(self, layer, q, k, v):
        n = self.num_tokens
        return pad_rows(super().attend(layer, q[:n], k[:n], v[:n]), len(q))

    def attend_one_token(self, layer, q):
        table, kv_len = self.one_token_table, self.one_token_len
        keys, values = (gather_kv(pool[layer], table) for pool in (self.k_pool, self.v_pool))  # (B, L, H, D)
        return invariant_attend(q[:, None], keys, values, kv_len[:, None] - 1, *self.paddings)[:, 0]

    def attend_chunk(self, layer, chunk, q, k, v):
        a, b = chunk.start, chunk.end
        if not chunk.num_cached:  # a prompt from its start: causally over its own K/V
            return invariant_causal(q[None, a:b], k[None, a:b], v[None, a:b], self.paddings[0])[0]
        keys, values = self.chunk_kv(layer, chunk)  # its own K/V too, stored before
        return invariant_attend(q[None, a:b], keys, values, self.positions[None, a:b], *self.paddings)[0]

    def attend_run(self, q, k, v, start, count, length):
        """padded_chunks' prompts of one length, side by side, in one call through invariant_causal."""
        rows = (t[start : start + count * length].unflatten(0, (count, length)) for t in (q, k, v))
        return invariant_causal(*rows, self.paddings[0]).flatten(0, 1)

    def attend_padded(self, layer, q):
        """padded_chunks' short chunks, together, through invariant_attend -> {chunk index: its (n, H, D)}."""
        keys, values = (gather_kv(pool[layer], self.padded_table) for pool in (self.k_pool, self.v_pool))
        y = invariant_attend(q[self.padded_index], keys, values, self.padded_pos, *self.paddings)  # (R, Q, H, D)
        y = y.flatten(0, 1).index_select(0, self.padded_real)
        return dict(zip(self.padded, y.split(self.lengths)))


@functools.cache
def invariant_batch_class(batch_class, min_rows, paddings):
    settings = {"min_rows": min_rows, "paddings": paddings}
    return type("Invariant" + batch_class.__name__, (InvariantRows, batch_class), settings)


class Invariant:
    """An engine mixin: with invariant=True, the batch-invariant forward (InvariantRows), the logits of the real
    rows only; refused in one line where it cannot hold."""

    def __init__(self, model, *, invariant=False, **kw):
        super().__init__(model, **kw)
        self.invariant = invariant
        if invariant:
            self.batch_class = invariant_batch_class(self.batch_class, *self.check_kernels(model))

    def check_kernels(self, model):
        """min_rows and paddings as this CPU's kernels need them (fewest_rows, attention_paddings), or
        ValueError, in one line, where invariance cannot hold."""
        if self.kv_pool.is_cuda or self.compile in ("graph", "step", "kernel"):
            why = "a GPU" if self.kv_pool.is_cuda else f"compile {self.compile!r}"
            raise ValueError(f"invariant=True runs on a CPU, with compile auto, on or off (not with {why})")
        # against the largest count tried, whatever the budget: a token's values do not depend on it either
        most = max(self.token_budget, LARGE_COUNTS[-1])
        min_rows = fewest_rows(model, most)
        if min_rows is None:
            why = f"a linear layer, norm or GELU of this model rounds a row by the rows beside it, up to {most} rows"
            raise ValueError(f"invariant=True cannot hold: {why}, on this CPU")
        config, dtype = model.config, self.kv_pool.dtype
        paddings = attention_paddings(config.n_head, config.n_embd // config.n_head, self.window, dtype)
        if paddings is None:
            why = f"this CPU's attention kernel rounds a query by the queries and keys beside it, in {dtype}"
            raise ValueError(f"invariant=True cannot hold: {why}")
        return min_rows, paddings

    def forward(self, batch):
        logits = super().forward(batch)
        return logits[: batch.num_logit_rows] if self.invariant else logits
