"""Small steps as one compiled graph, on the CPU (compile="step"). Where a step is a few sequences of a few
tokens each (decoding at batch 1, speculative verify steps), its time goes to the forward's hundred-odd small
ops, their Python, and the building of the batch, not to arithmetic. Inductor compiles the whole forward into
one graph of fused C++ loops and GEMMs, with the weights frozen in and a C++ wrapper; the batch is built from
lists, in a few tensor calls (docs/compile.md#small-steps-as-one-graph---compile-step).

Each of the step's entries becomes a row of Q tokens, the shorter ones padded by repeating their last token;
rows and tokens are padded to two at least, and the logits read two more rows, so that no size of 0 or 1
specializes the graph: one graph serves every small step. The graph never writes the pool, as inductor would
copy a whole tensor that a graph writes into: each row attends over its cached K/V, gathered from the pool,
with its own new K/V laid over them in their places, and the step writes every layer's new K/V after the
graph, in one indexed copy.
NOTE: the weights are frozen into the graph: a weight changed in place after the first small step is not seen
(compile="step" serves fixed weights).
Plugs into the paged engine at make_batch and forward; a step with more rows or a longer entry (a prefill
chunk) runs as before."""

import torch

from batch import longs
from model import attend, visible_keys
from paged import blocks_for

MAX_ROWS = 8  # steps of at most this many entries...
MAX_ROW_TOKENS = 16  # ...of at most this many tokens each


def graph_settings():
    """torch's private configuration (as of torch 2.13) that the small steps' graph compiles under, read only once
    compile="step" is asked for: other torch versions may lack it.
    NOTE: two sizes equal at the first call would share one symbol in the graph (dynamo's duck shaping), and a
    later step where they differ would compile a second graph: use_duck_shape off. The weights frozen into the
    graph as constants (torch.compile's options do not reach freezing), its GEMMs inductor's own C++ kernels where
    they time faster than oneDNN's (max_autotune: 1.2-1.3x the forward's speed at batch 1, for a first compile of
    ~60 s, ~35 s once cached), and its kernels called from C++, not Python."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    distinct_sizes = fx_config.patch(use_duck_shape=False)
    inductor = inductor_config.patch(
        freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", cpp_wrapper=True
    )
    return distinct_sizes, inductor


class RowBatch:
    """A step as R rows of Q tokens, R, Q >= 2: the forward's T = R * Q tokens are the rows', flattened.
    Padding repeats a row's last token, and a step of one row takes a padding copy of it; padding's K/V go
    to the padding block, in the pool and in the rows' gathered copies, where no query sees them. It has what
    the engine reads of a StepBatch (idx, positions, logit_rows, sample_rows, sample_pos; two more logits rows
    than samplers), and:
        row_pos: (R, Q) the rows' positions; row_slots: (R, L) their W blocks' slots, then the padding block's;
        token_row, overlay_pos: (T,) where each token's new K/V go in its row's gathered copy;
        slots: (T,) where they go in the pool.
    It reads the pool as slots (CompiledSteps.slot_pool), not blocks: no size the graph sees is the block size,
    which would specialize it at 1."""

    def __init__(self, plan, samplers, slot_pool, block_size):
        self.k_pool, self.v_pool = slot_pool  # (n_layer, slots, H, D) each
        padding = slot_pool.shape[2] // block_size - 1  # the padding block
        Q = max(2, *(n for _, n in plan))
        longest = max(s.num_computed + n for s, n in plan)
        W = blocks_for(longest, block_size)
        rows = [row(s, n, Q, W, padding) for s, n in plan]
        if len(rows) < 2:  # a padding row: a copy of the one row, whose K/V go to the padding block
            rows.append(row(*plan[0], Q, W, padding, real=False))
        idx, positions, real, table = columns(rows, 4)  # (R, Q) 3 times, (R, W + 1)
        real = real.bool().flatten()
        block = table.gather(1, positions // block_size)
        slots = block * block_size + positions % block_size
        padding_slot = padding * block_size
        self.slots = torch.where(real, slots.flatten(), padding_slot)
        self.idx = idx.flatten()
        self.positions = positions.flatten()
        unseen = W * block_size  # the padding block's first place in a row's copy: past every query
        self.overlay_pos = torch.where(real, self.positions, unseen)
        self.row_pos = positions
        # no view of a (R, W + 1, block_size) tensor: dynamo guards on a view's base's sizes
        first_slots = table.repeat_interleave(block_size, 1) * block_size  # (R, L)
        in_block = torch.arange(block_size).repeat(W + 1)  # (L,)
        self.row_slots = first_slots + in_block
        self.token_row = torch.arange(len(rows)).repeat_interleave(Q)
        picks = [pick(plan, x, Q) for x in samplers]
        logit_rows, self.sample_rows, self.sample_pos = columns(picks, 3)
        two_more = torch.zeros(2, dtype=torch.long)  # never a size of 0 or 1
        self.logit_rows = torch.cat([logit_rows, two_more])

    def attend(self, layer, q, k, v):
        """q, k, v: (T, H, D) -> (T, H, D), each row over its cached K/V and its own new K/V, causal."""
        self.new_k.append(k)
        self.new_v.append(v)
        keys = self.overlay(self.k_pool[layer], k)
        values = self.overlay(self.v_pool[layer], v)
        R, Q = self.row_pos.shape
        q = q.unflatten(0, (R, Q))
        y = attend(q, keys, values, visible_keys(keys, self.row_pos))  # (R, Q, H, D)
        return y.flatten(0, 1)

    def overlay(self, pool, new):
        """The rows' cached K/V (R, L, H, D), with the step's new K/V (T, H, D) laid over them in their places."""
        cached = pool[self.row_slots]
        return cached.index_put((self.token_row, self.overlay_pos), new)


def row(s, n, Q, W, padding, real=True):
    """Sequence s's next n tokens as a row of Q: its tokens, their positions, which are real, and its W blocks
    and the padding block."""
    first = s.num_computed
    tokens = s.next_tokens(n)
    positions = list(range(first, first + n))
    blocks = s.block_table[:W]
    pad = Q - n
    tokens += tokens[-1:] * pad
    positions += positions[-1:] * pad
    blocks += blocks[-1:] * (W - len(blocks))  # a row reads no key past its last: any block pads its table
    reals = [real] * n + [False] * pad
    return tokens, positions, reals, blocks + [padding]


def columns(rows, width):
    """Rows of `width` fields each -> a tensor of each field."""
    fields = [[r[i] for r in rows] for i in range(width)]
    return [torch.from_numpy(longs(field)) for field in fields]


def pick(plan, sampler, Q):
    """-> the place, in the rows, of the token whose logits the sampler reads; the sampler's sequence's row in
    the engine's per-sequence tensors; and the position it draws."""
    s, n = plan[sampler.entry]
    logit_row = sampler.entry * Q + n - 1 - sampler.back
    return logit_row, sampler.sequence.row, s.num_computed + n - sampler.back


def forward_rows(model, batch):
    """-> logits (S + 2, V), and every layer's new K and V: (2, n_layer, T, H, D), as the pool holds them."""
    batch.new_k = []  # each layer's, as the forward computes them
    batch.new_v = []
    logits = model(batch.idx, batch=batch)[0]
    new_k = torch.stack(batch.new_k)
    new_v = torch.stack(batch.new_v)
    del batch.new_k, batch.new_v  # so that the graph returns no layer's on its own
    return logits, torch.stack([new_k, new_v])


def alias(t):
    """The memory of view t as a tensor that is no view: dynamo guards on a view's base's sizes, and the pool's
    (its block size) would specialize the graph."""
    memory = t.untyped_storage()
    t_alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return t_alias.set_(memory, t.storage_offset(), t.shape, t.stride())


def reads_another_rows_writes(plan, block_size):
    """Whether a row reads a block that another row writes in this step: a prompt admitted beside the one
    computing its shared prefix (PagedEngine.schedule). The graph reads the pool before the step's K/V are
    written, so such a step runs as the core runs it, each layer writing before it attends."""
    writer = {}  # block -> the entry writing it
    for i, (s, n) in enumerate(plan):
        for position in range(s.num_computed, s.num_computed + n):
            writer[s.block_table[position // block_size]] = i
    for i, (s, n) in enumerate(plan):
        read = s.block_table[: blocks_for(s.num_computed + n, block_size)]
        if any(writer.get(block, i) != i for block in read):
            return True
    return False


class CompiledSteps:
    """A PagedEngine mixin: compile="step" runs small steps on a CPU as one compiled graph (RowBatch)."""

    compile_modes = ("auto", "on", "off", "step")  # steps too large for the graph run as with auto

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        if self.compile == "step" and self.device.type != "cpu":
            raise ValueError("compile 'step' compiles small steps on a CPU; on CUDA, ask for 'graph'")
        if self.compile == "step":
            self.graph_settings = graph_settings()
            self.compiled_forward = torch.compile(forward_rows, dynamic=True)
            self.slot_pool = alias(self.kv_pool.flatten(2, 3))  # (2, n_layer, slots, H, D)

    def make_batch(self, plan, samplers):
        longest = max(n for _, n in plan)
        small = len(plan) <= MAX_ROWS and longest <= MAX_ROW_TOKENS
        if self.compile == "step" and small and not reads_another_rows_writes(plan, self.block_size):
            return RowBatch(plan, samplers, self.slot_pool, self.block_size)
        return super().make_batch(plan, samplers)

    def forward(self, batch):
        if not isinstance(batch, RowBatch):
            return super().forward(batch)
        distinct_sizes, inductor = self.graph_settings
        with distinct_sizes, inductor:
            logits, new_kv = self.compiled_forward(self.model, batch)
        self.slot_pool.index_copy_(2, batch.slots, new_kv)  # every layer's K and V in one indexed copy
        return logits[:-2]  # the samplers' rows, without the two that keep the graph's sizes above 1
