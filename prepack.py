"""For inference on a CPU: each linear layer multiplies a copy of its weight reordered once into oneDNN's blocked
layout, as inductor's freezing does; eager F.linear pays that reorder on every call. The engine prepacks the
model it serves; training never uses the packed copy."""

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Linear):
    """nn.Linear that multiplies by a copy of its weight prepacked for oneDNN (packed_weight, packed_bias), once
    prepack() made one."""

    packed_version = None  # the weight's version the packed copy was made from: a weight changed since is not used

    def _apply(self, fn, *args):  # .to(), .double(), ... make a new weight: the copy is stale
        self.packed_weight = self.packed_version = None
        return super()._apply(fn, *args)

    def forward(self, x):
        # training takes F.linear: the packed copy is detached, and no gradient would reach the weight
        if self.packed_version != self.weight._version or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        weight = self.packed_weight
        y = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, self.packed_bias, "none", [], "")
        return y.to(x.dtype)  # a bf16 x into a float32 copy and back: exact, then rounded once


def prepack(model):
    """Pack each CPU linear weight not packed since it last changed. A bf16 weight is packed as it is where
    oneDNN has bf16 kernels (AVX512-BF16 or AMX); elsewhere as a float32 copy, which computes what a bf16
    GEMM does (bf16 inputs, float32 sums, a bf16 result) several times faster than PyTorch's bf16 GEMM there
    (docs/bf16.md), for twice the bf16 weight's memory."""
    bf16_kernels = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for m in model.modules():
        if (
            isinstance(m, Linear)
            and m.weight.device.type == "cpu"
            # a float32 weight smaller than 2**17 runs slower packed: oneDNN's call costs ~20 us more than F.linear's
            # (1.0-3.2x below that size, 0.6-1.0x above, on an AMX Xeon: docs/bf16.md#prepacked-weights)
            and (m.weight.dtype == torch.bfloat16 or m.weight.dtype == torch.float32 and m.weight.numel() >= 1 << 17)
            and m.packed_version != m.weight._version
        ):
            dtype = m.weight.dtype if bf16_kernels else torch.float32
            m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(dtype), None)
            m.packed_bias = None if m.bias is None else m.bias.detach().to(dtype)
            m.packed_version = m.weight._version
