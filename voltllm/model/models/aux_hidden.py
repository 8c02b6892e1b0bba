"""The residual stream after chosen decoder layers, for every token of every forward, in one fixed buffer: what a
DFlash drafter reads of its target (worker/dflash_runner.py). Shared by the llama-family and the hybrid decoders.

Layer i's entry is Hugging Face's hidden_states[i + 1]: the residual stream after layer i (its mixer and MLP outputs
added), after the final norm for the last layer. The buffer has a fixed address so CUDA graphs (decode, prompt,
a hybrid's verification walks) capture the writes; with no buffer set the forward pays one check per layer.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class AuxHiddenCapture:
    """Mixed into a decoder whose forward calls `keep_layer_output` after each layer and `keep_final_output` after the
    final norm; it needs `config.hidden_size`, `dtype`, `layers` and `norm`."""

    aux_hidden: Optional[torch.Tensor] = None  # None: off, nothing is written
    _aux_cols: dict = {}  # layer index -> its column block in aux_hidden

    def set_aux_hidden(self, layer_ids: Iterable[int], max_tokens: int) -> torch.Tensor:
        """Keep the outputs of decoder layers `layer_ids` of each forward's first max_tokens tokens, in that order,
        in the returned buffer [max_tokens, len(layer_ids) * hidden]."""
        ids = list(layer_ids)
        hidden = self.config.hidden_size
        self._aux_cols = {i: slice(j * hidden, (j + 1) * hidden) for j, i in enumerate(ids)}
        self.aux_hidden = torch.zeros(max_tokens, len(ids) * hidden, dtype=self.dtype,
                                      device=self.norm.weight.device)
        return self.aux_hidden

    def keep_layer_output(self, i: int, x: Optional[torch.Tensor], residual: torch.Tensor) -> None:
        """After layer i returned (x, residual) (x None: a fused layer already added it into residual). Copied before
        the next layer's norm adds x into residual in place; the last layer's output is kept after the final norm."""
        if self.aux_hidden is not None and i in self._aux_cols and i != len(self.layers) - 1:
            self.aux_hidden[:residual.shape[0], self._aux_cols[i]] = residual if x is None else x + residual

    def keep_final_output(self, x: torch.Tensor) -> None:
        """The final norm's output x, as the last layer's entry."""
        last = len(self.layers) - 1
        if self.aux_hidden is not None and last in self._aux_cols:
            self.aux_hidden[:x.shape[0], self._aux_cols[last]] = x
