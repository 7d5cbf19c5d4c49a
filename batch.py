"""What one forward reads: the step's new tokens, their positions, and where each sequence's earlier K/V are.
The model calls batch.attend(layer, q, k, v) and never sees the cache: PagedBatch (paged.py) keeps K/V in
the block pool, ContiguousBatch (harness/contiguous.py) in each sequence's own tensors."""

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from model import attend, visible_keys


def longs(values):
    """A list of ints -> an int64 array on the host, an empty list too (np.array([]) is float)."""
    return np.array(values, dtype=np.int64)


class Chunk(NamedTuple):
    """A prefill chunk: plan entry `entry`'s new tokens sit at [start, end) of the step's tokens, after
    num_cached tokens of its sequence whose K/V are already in the cache."""

    entry: int
    start: int
    end: int
    num_cached: int


class StepBatch:
    """Where one forward's new tokens sit. Plan entry i, (sequence, num_tokens), brings num_tokens new tokens
    after its sequence's num_computed cached ones. One-token entries (decodes, and prefill chunks of one
    token) come first and attend together in one call; then each longer chunk attends alone. A sampler
    (sequence, entry, back) reads the logits of its entry's last token, or of the one back tokens before it;
    the forks of a prompt share its entry.
    Built on the host in numpy (its small ops cost a third of torch's: docs/vllm.md), then staged to the device
    (stage), where it has:
        idx, positions: (N,) the step's new tokens and their positions in their sequences;
        logit_rows: (S,) the token whose logits each of the S samplers reads (its entry's last, or `back` before);
        sample_rows: (S,) each sampler's row in the engine's per-sequence tensors;
        sample_pos: (S,) the position of the token each sampler draws;
    and a subclass's own tables. The constructor changes nothing outside the batch.
    A subclass keeps the K/V: store(layer, k, v) keeps one layer's new K/V, k, v: (N, H, D);
    attend_one_token(layer, q) attends the B one-token entries, q: (B, H, D) -> (B, H, D); chunk_kv(layer,
    chunk) -> the keys and values a chunk attends, its own too: (1, L, H, D) each."""

    def __init__(self, plan, samplers, device):
        self.device = device
        num_cached = longs([s.num_computed for s, _ in plan])  # (R,)
        num_new = longs([n for _, n in plan])  # (R,)
        ends = num_new.cumsum()  # (R,) each entry's end in the step's tokens
        starts = ends - num_new
        self.token_entry = np.repeat(np.arange(len(plan)), num_new)  # (N,) each token's plan entry
        offsets = (num_cached - starts)[self.token_entry]  # (N,) each token's position less its place in the step
        self.host_positions = offsets + np.arange(len(self.token_entry))  # (N,)
        self.kv_lens = num_cached + num_new  # (R,) keys each entry has after this step
        self.num_one_token = int((num_new == 1).sum())  # NOTE: the plan puts them first
        self.spans = list(zip(starts.tolist(), ends.tolist()))  # (start, end) of each entry's new tokens
        # the other entries: prefill chunks, each attended alone
        self.chunks = [Chunk(i, *self.spans[i], int(num_cached[i])) for i in range(self.num_one_token, len(plan))]
        tokens = longs([t for s, n in plan for t in s.next_tokens(n)])
        entries = longs([x.entry for x in samplers])  # (S,) each sampler's plan entry
        rows = longs([x.sequence.row for x in samplers])
        backs = longs([x.back for x in samplers])
        logit_rows = (ends - 1)[entries] - backs
        sample_pos = self.kv_lens[entries] - backs
        staged = self.stage(tokens, self.host_positions, logit_rows, rows, sample_pos)
        self.idx, self.positions, self.logit_rows, self.sample_rows, self.sample_pos = staged

    def stage(self, *arrays):
        """Host arrays -> tensors on the device (the CUDA extension copies them in one: ext/cuda.py)."""
        return [torch.from_numpy(a).to(self.device) for a in arrays]

    def attend(self, layer, q, k, v):
        """q, k, v: (N, H, D) for the step's new tokens -> (N, H, D)."""
        self.store(layer, k, v)
        out = [self.attend_one_token(layer, q[: self.num_one_token])] if self.num_one_token else []
        out += self.attend_chunks(layer, q, k, v)
        return out[0] if len(out) == 1 else torch.cat(out)  # one piece: no copy

    def attend_chunks(self, layer, q, k, v):  # each chunk alone (speculation verifies its together: ext/speculative.py)
        return [self.attend_chunk(layer, chunk, q, k, v) for chunk in self.chunks]

    def attend_chunk(self, layer, chunk, q, k, v):
        """One prefill chunk's attention: q, k, v: (N, H, D) -> (n, H, D) for its n new tokens."""
        a, b = chunk.start, chunk.end
        if chunk.num_cached == 0:  # a fresh chunk sees only itself: causal attention over its own new K/V
            qc, kc, vc = (t[None, a:b].transpose(1, 2) for t in (q, k, v))  # (1, H, n, D): CPU flash needs 4-D
            y = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
            return y[0].transpose(0, 1)
        keys, values = self.chunk_kv(layer, chunk)  # a chunk after cached tokens reads them back
        return attend(q[None, a:b], keys, values, visible_keys(keys, self.positions[None, a:b]))[0]
