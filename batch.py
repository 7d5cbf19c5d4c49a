"""What one forward reads: the step's new tokens, their positions, and where each sequence's earlier K/V are.
The model calls batch.attend(layer, q, k, v) and never sees the cache: PagedBatch (paged.py) keeps K/V in
the block pool, ContiguousBatch (contiguous.py) in each sequence's own tensors."""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from model import attend


class Chunk(NamedTuple):
    """A prefill chunk: plan entry `entry`'s new tokens sit at [start, end) of the step's tokens, after
    num_cached tokens of its sequence whose K/V are already in the cache."""

    entry: int
    start: int
    end: int
    num_cached: int


class Staging:
    """The device buffer every step's small tensors are copied into, in one copy from a host buffer (pinned on
    CUDA). The device buffer is allocated once: a field sits at the same address in every step of the same
    shape, which a captured graph needs."""

    def __init__(self, device, size):
        self.pin_memory = device.type == "cuda"
        self.device_buffer = torch.zeros(size, dtype=torch.long, device=device)

    def load(self, tensors):
        """{name: host tensor} -> {name: a view of the device buffer}."""
        sizes = [t.numel() for t in tensors.values()]
        # NOTE: a new host buffer each step: a step that samples nothing does not wait for the device, and the
        # caching host allocator hands a pinned buffer out again only once its copy is done
        host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=self.pin_memory)
        torch.cat([t.flatten() for t in tensors.values()], out=host)
        device = self.device_buffer[: sum(sizes)]
        device.copy_(host, non_blocking=True)  # the step's end waits for the sampled tokens, and so for this
        return {name: piece.view(t.shape) for (name, t), piece in zip(tensors.items(), device.split(sizes))}


class StepBatch:
    """Where one forward's new tokens sit. Plan entry i, (sequence, num_tokens), brings num_tokens new tokens
    after its sequence's num_computed cached ones. One-token entries (decodes, and prefill chunks of one
    token) come first and attend together in one call; then each longer chunk attends alone. A sampler
    (sequence, entry) reads the logits of its entry's last token: the forks of a prompt share its entry.
    Built on the host, then staged to the device in one copy, from which it has, on the device:
        idx, positions: (N,) the step's new tokens and their positions in their sequences;
        logit_rows: (S,) the token whose logits each of the S samplers reads;
        sample_rows: (S,) each sampler's row in the engine's per-sequence tensors;
        sample_pos: (S,) the position of the token each sampler draws;
    and a subclass's own tables (host_tensors). The constructor changes nothing but the staging buffer.
    A subclass keeps the K/V: store(layer, k, v) keeps one layer's new K/V, k, v: (N, H, D);
    attend_one_token(layer, q) attends the B one-token entries, q: (B, H, D) -> (B, H, D); chunk_kv(layer,
    chunk) -> the keys and values a chunk attends, its own too: (1, L, H, D) each."""

    def __init__(self, plan, samplers, staging):
        num_cached = torch.tensor([s.num_computed for s, _ in plan], dtype=torch.long)  # (R,)
        num_new = torch.tensor([n for _, n in plan], dtype=torch.long)  # (R,)
        ends = num_new.cumsum(0)  # (R,) each entry's end in the step's tokens
        starts = ends - num_new
        self.token_entry = torch.repeat_interleave(torch.arange(len(plan)), num_new)  # (N,) each token's plan entry
        self.host_positions = (num_cached - starts)[self.token_entry] + torch.arange(len(self.token_entry))  # (N,)
        self.kv_lens = num_cached + num_new  # (R,) keys each entry has after this step
        self.num_one_token = int((num_new == 1).sum())  # NOTE: the plan puts them first
        self.last_token = ends - 1  # (R,) each entry's last token in the step's tokens
        self.spans = list(zip(starts.tolist(), ends.tolist()))  # (start, end) of each entry's new tokens
        self.chunks = [Chunk(i, *self.spans[i], int(num_cached[i])) for i in range(self.num_one_token, len(plan))]
        vars(self).update(staging.load(self.host_tensors(plan, samplers)))

    def host_tensors(self, plan, samplers):
        """{name: host tensor} of what the forward reads; a subclass adds its own tables."""
        tokens = [t for s, n in plan for t in s.tokens[s.num_computed : s.num_computed + n]]
        entries = torch.tensor([x.entry for x in samplers], dtype=torch.long)  # (S,) each sampler's plan entry
        return dict(
            idx=torch.tensor(tokens, dtype=torch.long),
            positions=self.host_positions,
            logit_rows=self.last_token[entries],
            sample_rows=torch.tensor([x.sequence.row for x in samplers], dtype=torch.long),
            sample_pos=self.kv_lens[entries],
        )

    def attend(self, layer, q, k, v):
        """q, k, v: (N, H, D) for the step's new tokens -> (N, H, D)."""
        self.store(layer, k, v)
        out = []
        if self.num_one_token:
            out.append(self.attend_one_token(layer, q[: self.num_one_token]))
        for chunk in self.chunks:
            out.append(self.attend_chunk(layer, chunk, q, k, v))
        return torch.cat(out) if len(out) > 1 else out[0]

    def attend_chunk(self, layer, chunk, q, k, v):
        """One prefill chunk's attention: q, k, v: (N, H, D) -> (n, H, D) for its n new tokens."""
        a, b = chunk.start, chunk.end
        if chunk.num_cached == 0:  # a fresh chunk sees only itself: causal attention over its own new K/V
            qc, kc, vc = (t[None, a:b].transpose(1, 2) for t in (q, k, v))  # (1, H, n, D): CPU flash needs 4-D
            y = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
            return y[0].transpose(0, 1)
        keys, values = self.chunk_kv(layer, chunk)  # a chunk after cached tokens reads them back
        return attend(q[None, a:b], keys, values, self.positions[None, a:b])[0]
