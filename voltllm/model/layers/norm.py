"""RMSNorm, with the residual add fused in (the residual stream is kept in the norm's input dtype)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32. `offset=1.0` gives the (1 + weight) variant (Qwen3-Next)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The output has x's dtype; the residual keeps its own (fp32 residual streams for fp16 models)."""
        if x.is_cuda:  # one fused Triton launch instead of ~10 elementwise kernels
            from voltllm.kernels import fused

            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps, self.offset)
            # residual updated in place; the normed rows overwrite x (a fresh GEMM output), keeping its dtype
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, out=x)
        out_dtype = x.dtype
        if residual is not None:
            x = (x + residual).to(residual.dtype)
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (self.weight.float() + self.offset)).to(out_dtype)
        return out if residual is None else (out, residual)
