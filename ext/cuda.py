"""The paged engine on a CUDA GPU, as nano-vllm's model runner: each step's small tensors are staged in one copy
from pinned memory, and with compile="graph" (auto's choice on CUDA: harness/serving.py) a decode-only step is
padded to a fixed shape, whose CUDA graph was captured once and is replayed instead of launching every kernel from
Python. On a CPU, compile="graph" pads the same shapes without capturing them, which the tests check there. Plugs
into the paged engine at batch_class, make_batch and forward; its two switches, each "auto" by default, on where
a GPU measured that it pays: async_steps at step (ext/async_steps.py) and decode_attention at a padded step's
decode attention (flex_attention in the large buckets: ext/flex_decode.py)."""

import math

import numpy as np
import torch

from ext.async_steps import AsyncSteps
from ext.flex_decode import flex_attend, flex_block_mask
from ext.padded_chunks import padded_batch_class
from paged import PagedBatch


def stage(arrays, device):
    """Host int64 arrays -> views of one device tensor, copied in one go (from pinned memory on CUDA)."""
    sizes = [a.size for a in arrays]
    pinned = device.type == "cuda"
    # NOTE: a new host buffer each step: a step that samples nothing does not wait for the device, and the
    # caching host allocator hands a pinned buffer out again only once its copy is done
    host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=pinned)
    torch.cat([torch.from_numpy(a).flatten() for a in arrays], out=host)
    staged = host.to(device, non_blocking=True)  # the step's end waits for the sampled tokens, and so for this
    pieces = staged.split(sizes)
    return [piece.view(a.shape) for a, piece in zip(arrays, pieces)]


class StagedBatch(PagedBatch):
    """A step on the GPU: its tensors in one copy each time the batch stages."""

    def stage(self, *arrays):
        return stage(arrays, self.device)


def pad_rows(a, rows, value=0):
    """a: (n,) -> (rows,), the new places holding value."""
    return np.pad(a, (0, rows - len(a)), constant_values=value)


class GraphInputs:
    """What a captured decode step of B rows, each reading W blocks, reads: device tensors allocated once, so
    that every replay of its graph reads the same addresses; a step copies its own values in."""

    def __init__(self, B, W, device):
        self.idx = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.idx)
        self.logit_rows = torch.zeros_like(self.idx)
        self.slots = torch.zeros_like(self.idx)
        self.one_token_len = torch.zeros_like(self.idx)
        self.one_token_table = torch.zeros(B, W, dtype=torch.long, device=device)

    def fields(self):
        return [self.idx, self.positions, self.logit_rows, self.slots, self.one_token_len, self.one_token_table]


class GraphBatch(PagedBatch):
    """A decode-only step padded to its graph's shape (B, W) = inputs': rows past the step's hold token 0 at
    position 0, written to and read from the padding block. What the graph reads is in `inputs`."""

    def __init__(self, plan, samplers, device, kv_pool, block_tables, inputs):
        # built on the host (stage), then padded to the graph's shape
        super().__init__(plan, samplers, device, kv_pool, block_tables, compiled=False)
        self.compiled = True
        self.lone = None  # a graph reads its fixed inputs, never a lone row's slots in place
        self.inputs = inputs
        B, W = inputs.one_token_table.shape
        self.padded_shape = (B, W)
        self.num_one_token = B
        padding_block = self.k_pool.shape[1] - 1
        block_size = self.k_pool.shape[2]
        table, kv_len = self.pad(self.one_token_table, self.one_token_len, B, W)
        idx = pad_rows(self.idx, B)
        positions = pad_rows(self.positions, B)
        logit_rows = pad_rows(self.logit_rows, B)
        slots = pad_rows(self.slots, B, padding_block * block_size)
        read = [idx, positions, logit_rows, slots, kv_len, table]  # what the graph reads, as inputs.fields()
        staged = stage(read + [self.sample_rows, self.sample_pos], device)
        torch._foreach_copy_(inputs.fields(), staged[:6])
        self.idx = inputs.idx
        self.positions = inputs.positions
        self.logit_rows = inputs.logit_rows
        self.slots = inputs.slots
        self.one_token_len = inputs.one_token_len
        self.one_token_table = inputs.one_token_table
        self.sample_rows, self.sample_pos = staged[6:]

    def stage(self, *arrays):  # the host arrays: the constructor pads and stages them
        return arrays

    def pad(self, table, kv_len, rows, width):
        """table (B, W), kv_len (B,) -> (rows, width), (rows,): padding rows read one key of the padding block."""
        padding = self.k_pool.shape[1] - 1  # the padding block
        table = np.pad(table, ((0, rows - len(table)), (0, width - table.shape[1])), constant_values=padding)
        return table, np.pad(kv_len, (0, rows - len(kv_len)), constant_values=1)


class FlexBatch(GraphBatch):
    """decode_attention="flex": a padded step attends through flex_attention, its block mask built at the first
    layer from the graph's fixed inputs, so that a captured graph builds it too."""

    def attend_one_token(self, layer, q):
        if layer == 0:
            num_pool_blocks, block_size = self.k_pool.shape[1:3]
            table, kv_len = self.one_token_table, self.one_token_len
            self.block_mask = flex_block_mask(table, kv_len, num_pool_blocks, block_size)
        attend = flex_attend(self.device)
        return attend(q, self.k_pool[layer], self.v_pool[layer], self.block_mask)


# decode_attention="auto" on CUDA: flex_attention in padded steps of at least this many rows, gather_attend in
# smaller ones. On an H200 flex ran one layer's decode attention 1.1-1.5x faster at 64 and 256 rows, and up to
# 2.9x slower at 16 rows and 4,096 keys (docs/gpu.md)
FLEX_FROM_ROWS = 64
FLEX_MIN_BLOCK_SIZE = 16  # flex's GPU kernel multiplies blocks of keys with triton's dot, which takes 16 or more


class CudaGraphs(AsyncSteps):
    """A PagedEngine mixin. compile="graph": decode-only steps padded to batch buckets 1, 2, 4, 8, then steps of
    16, each row reading as many blocks as the longest context has (narrower tables, in graphs of their own, ran
    no faster end to end on an H200: docs/gpu.md); on CUDA one graph per bucket, captured largest first in one
    memory pool. With it, on CUDA, every step stages in one copy.
    Its switches, each measured on an H200 (docs/gpu.md): async_steps leaves each step's tokens on the device
    until the next step has launched (AsyncSteps); decode_attention attends a padded step's decodes through
    gather_attend or flex_attention (FlexBatch): "auto" is flex in the buckets of FLEX_FROM_ROWS rows or more on
    CUDA, "flex" in every bucket. A candidate, off until a GPU has measured it: pad_chunks=True attends a step's
    prompt chunks in one padded call a layer (ext/padded_chunks.py), where the GPU path runs each alone."""

    compile_modes = ("auto", "on", "off", "graph")  # steps it does not pad run as with auto

    def __init__(self, model, *, decode_attention="auto", pad_chunks=False, **kw):
        super().__init__(model, **kw)
        self.flex_from = self.flex_from_rows(decode_attention)  # the smallest padded batch that attends via flex
        if self.device.type == "cuda" and self.compile == "graph":  # the GPU path
            self.batch_class = StagedBatch
        if pad_chunks:  # the steps with prompt chunks: one attention call a layer
            self.batch_class = padded_batch_class(self.batch_class, every_chunk=True)
        largest = self.max_batch
        buckets = [1, 2, 4, 8, *range(16, largest, 16)]
        self.graph_batches = [b for b in buckets if b < largest] + [largest]
        width = self.block_tables.shape[1]
        padded = self.compile == "graph"
        self.graph_inputs = {}  # batch -> the inputs its graph reads
        for b in self.graph_batches if padded else []:
            self.graph_inputs[b] = GraphInputs(b, width, self.device)
        self.graphs = {}  # batch -> (its CUDA graph, the logits it writes)
        if padded and self.device.type == "cuda":
            self.capture_graphs()

    def flex_from_rows(self, decode_attention):
        """decode_attention -> the fewest rows of a padded step that attends through flex (inf: none does)."""
        flex_fits = self.device.type != "cuda" or self.block_size >= FLEX_MIN_BLOCK_SIZE
        on_gpu_path = self.device.type == "cuda" and self.compile == "graph"
        if decode_attention == "auto":
            return FLEX_FROM_ROWS if on_gpu_path and flex_fits else math.inf
        if decode_attention == "gather":
            return math.inf
        if decode_attention == "flex" and self.compile == "graph" and flex_fits:
            return 1
        why = f"'auto', 'gather', or 'flex' with compile 'graph' and, on CUDA, blocks of {FLEX_MIN_BLOCK_SIZE} or more"
        raise ValueError(
            f"decode_attention {decode_attention!r} with compile {self.compile!r}, block_size {self.block_size}: "
            f"must be {why}"
        )

    def make_batch(self, plan, samplers):
        if not self.graph_inputs:  # not padding: compile is not "graph"
            return super().make_batch(plan, samplers)
        num_one_token = sum(n == 1 for _, n in plan)
        if not len(samplers) <= len(plan) == num_one_token:  # not decode-only
            return super().make_batch(plan, samplers)
        inputs = self.graph_inputs[self.graph_batch(len(plan))]
        return self.padded_batch(plan, samplers, inputs)

    def graph_batch(self, num_rows):  # the smallest bucket that holds num_rows
        return next(b for b in self.graph_batches if b >= num_rows)

    def padded_batch(self, plan, samplers, inputs):
        """The step's batch padded to inputs' shape; capture_graphs records each graph from one with no plan."""
        batch_class = FlexBatch if len(inputs.idx) >= self.flex_from else GraphBatch
        return batch_class(plan, samplers, self.device, self.kv_pool, self.block_tables, inputs)

    @torch.no_grad()
    def capture_graphs(self):
        pool = None
        for b in reversed(self.graph_batches):
            batch = self.padded_batch([], [], self.graph_inputs[b])
            super().forward(batch)  # warm-up: compiles and allocates outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = super().forward(batch)  # every padded row's: forward drops the padding's
            pool = graph.pool()
            self.graphs[b] = (graph, logits)

    def forward(self, batch):
        """The logits of the step's samplers: a padded step's padding rows are dropped here."""
        if not isinstance(batch, GraphBatch):
            return super().forward(batch)
        if len(batch.idx) not in self.graphs:  # not captured (on a CPU): launch the forward's kernels one by one
            return super().forward(batch)[: len(batch.sample_rows)]
        graph, logits = self.graphs[len(batch.idx)]
        graph.replay()
        return logits[: len(batch.sample_rows)]
