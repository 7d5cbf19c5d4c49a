"""What makes the engine fast on a CPU and changes things outside it: oneDNN's prepacked weights in the model's
linears, PyTorch's own GELU kernel on small inputs, and the process's allocator and attention settings.
prepare(model) does all; the command line and example.py call it, and a script that builds its own model calls
it too."""

import ctypes
import gc
import sys

import torch
from torch import nn
from torch.nn import functional as F


def intel_cpu():
    """Whether the CPU is Intel's, as /proc/cpuinfo names its vendor (elsewhere: no)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read()
    except OSError:
        return False


# float32 weights of at most this many inputs multiply through MKL, K-major, not oneDNN: on an Intel CPU only. On
# an AMD EPYC Zen 4 MKL's product is the slower (the tiny lm_head, 128 -> 50,304: 10.6 against oneDNN's 6.2 ms at
# 64 rows, 1.15 against 0.76 at one; tiny decoding 1.6x as fast without it: docs/vllm.md#the-lm-head-through-mkl-2026-11-28)
MKL_MAX_INPUTS = 128 if intel_cpu() else 0


class PackedLinear(nn.Linear):
    """nn.Linear that multiplies by a copy of its weight reordered once into oneDNN's blocked layout, as
    inductor's freezing does (eager F.linear pays that reorder on every call). It shares the weight and bias of
    the nn.Linear it replaces, so weight tying and checkpoints are unchanged. A float32 weight of at most
    MKL_MAX_INPUTS inputs (an Intel CPU's rule) is copied K-major instead and multiplied by MKL: oneDNN's call
    costs ~20 us, and at so few inputs its layout gains nothing back (the shipped model's lm_head, 128 -> 2,048,
    on a Xeon with AMX: 26 against 7 us at one row, 127 against 96 at 64; batch-1 decoding 1.12x:
    docs/vllm.md#the-lm-head-through-mkl-2026-11-28)."""

    packed_version = None  # the weight's version the packed copy was made from: a weight changed since is not used

    def _apply(self, fn, *args):  # .to(), .double(), ... make a new weight: the copy is stale
        self.packed_weight = self.packed_version = None
        return super()._apply(fn, *args)

    def forward(self, x):
        # training takes F.linear: the packed copy is detached, and no gradient would reach the weight; so does
        # a compiled graph, which packs its own (ext/compiled_steps.py)
        if torch.compiler.is_compiling() or self.packed_version != self.weight._version or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        weight = self.packed_weight
        if self.k_major:  # (in, out): F.linear hands MKL a row-major right operand, no transpose
            return F.linear(x, weight.t(), self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, self.packed_bias, "none", [], "")
        return y.to(x.dtype)  # a bf16 x into a float32 copy and back: exact, then rounded once

    def pack(self, dtype):
        self.k_major = dtype == self.weight.dtype == torch.float32 and self.in_features <= MKL_MAX_INPUTS
        if self.k_major:
            self.packed_weight = self.weight.detach().t().contiguous()
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().to(dtype), None)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(dtype)
        self.packed_version = self.weight._version


def worth_packing(linear):
    """A CPU weight in bf16, or in float32 from 2**17 elements: smaller float32 ones run slower packed, as
    oneDNN's call costs ~20 us more than F.linear's (1.0-3.2x below that size, 0.6-1.0x above, on an AMX Xeon:
    docs/bf16.md#prepacked-weights)."""
    w = linear.weight
    if w.device.type != "cpu":
        return False
    return w.dtype == torch.bfloat16 or w.dtype == torch.float32 and w.numel() >= 1 << 17


def prepack(model):
    """Swap each CPU linear worth packing for a PackedLinear that shares its parameters, and pack each whose
    weight changed since it was packed. A bf16 weight is packed as it is where oneDNN has bf16 kernels
    (AVX512-BF16 or AMX); elsewhere as a float32 copy, which computes what a bf16 GEMM does (bf16 inputs,
    float32 sums, a bf16 result) several times faster than PyTorch's bf16 GEMM there (docs/bf16.md), for twice
    the bf16 weight's memory."""
    dtype = None if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    for parent in list(model.modules()):
        for name, m in parent.named_children():
            if type(m) is nn.Linear and worth_packing(m):
                packed = PackedLinear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
                packed.weight, packed.bias = m.weight, m.bias
                setattr(parent, name, packed)
    for m in model.modules():
        if isinstance(m, PackedLinear) and worth_packing(m) and m.packed_version != m.weight._version:
            m.pack(dtype or m.weight.dtype)


SMALL_GELU = 1 << 14  # elements: below, PyTorch's own CPU GELU kernel beats oneDNN's


class SmallGELU(nn.GELU):
    """nn.GELU that runs PyTorch's own CPU kernel on inputs below SMALL_GELU elements. PyTorch hands a contiguous
    float32 or bf16 CPU GELU to oneDNN, whose call costs ~8 us: 8x the own kernel's time on a decode row of the
    shipped model (1 x 512 values); its batch-1 decoding runs 1.04x faster. From ~2**16 elements oneDNN's kernel
    is the faster, 1.4-1.8x from 2**17 (docs/vllm.md#gelu-on-small-steps). The two round differently, within
    1.2e-6."""

    def forward(self, x):
        # a compiled graph takes nn.GELU as it is: asked first, so that dynamo never guards on x's size here
        if torch.compiler.is_compiling() or x.device.type != "cpu" or x.numel() >= SMALL_GELU:
            return super().forward(x)
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)  # the switch F.gelu reads to choose oneDNN
        try:
            return super().forward(x)
        finally:
            torch._C._set_mkldnn_enabled(enabled)


def small_gelus(model):
    """Swap each of the model's nn.GELU for a SmallGELU of the same approximation (a GELU holds nothing else)."""
    for parent in list(model.modules()):
        for name, m in parent.named_children():
            if type(m) is nn.GELU:
                setattr(parent, name, SmallGELU(m.approximate))


def keep_freed_memory():
    """On Linux, memory a step frees stays in the process, for the next step's activations of the same sizes:
    by default glibc unmaps large blocks on free, and every step page-faults them back in (docs/vllm.md)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        libc.mallopt(-4, 0)  # M_MMAP_MAX: large blocks come from the heap, not from mmap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GiB of the heap's free top is kept


def prepare(model):
    """Set the process up for serving `model`, pack its CPU linears (prepack) and give its GELUs PyTorch's own
    kernel on small inputs (small_gelus). Process-wide, so the engine never does it: glibc's allocator keeps freed
    memory (keep_freed_memory); on a GPU, SDPA's cuDNN backend is off, as it builds a plan for each new shape and
    a step's shapes change every step (7x slower end to end in bf16 on an H200: docs/compile.md#on-a-gpu), while
    flash and memory-efficient attention take any shape."""
    prepack(model)
    small_gelus(model)
    # after packing, as the engine did before prepare existed: the packed weights come from mmap, with the
    # allocator's defaults
    keep_freed_memory()
    torch.backends.cuda.enable_cudnn_sdp(False)
    return model


def freeze_heap():
    """Once warmed up: the objects alive now (torch's, the model's, and the graphs torch.compile built, ~460k after
    a first compile) leave the cyclic collector's generations, as vLLM freezes its heap after start-up, so that a
    full collection no longer walks them: one took 0.2 s on the Xeon AMX, 5% of a perplexity run it fell in
    (docs/scoring.md). Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
