"""The residual stream after chosen decoder layers, for every token of every forward, in one fixed buffer: what a
DFlash drafter or an EAGLE-3 head reads of its target (worker/dflash_runner.py, worker/eagle3_runner.py). Shared by
the llama-family and the hybrid decoders.

Layer i's entry is Hugging Face's hidden_states[i + 1]: the residual stream after layer i (its mixer and MLP outputs
added), after the final norm for the last layer. The buffer has a fixed address so CUDA graphs (decode, prompt,
a hybrid's verification walks) capture the writes; with no buffer set the forward pays one check per layer.

Under pipeline parallelism (distributed/pipeline.py) each stage on the chain of tensor-parallel rank 0 holds the
whole buffer but writes only the columns of its own layers; the rows travel with the hand-over (PipelineStage.receive
/ pass_on), so rank 0 gets every stage's columns back with the last stage's output, and writes the last layer's after
the final norm, which it alone applies.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class AuxHiddenCapture:
    """Mixed into a decoder whose forward calls `keep_layer_output` after each layer and `keep_final_output` after the
    final norm; it needs `config.hidden_size`, `config.num_hidden_layers`, `dtype`, `layers`, `norm` and `pp` (its
    pipeline stage or None)."""

    aux_hidden: Optional[torch.Tensor] = None  # None: off, nothing is written
    _aux_cols: dict = {}  # local index of a layer of this stage -> its column block in aux_hidden
    _aux_final: Optional[slice] = None  # the last layer's column block, written after the final norm (rank 0)

    def set_aux_hidden(self, layer_ids: Iterable[int], max_tokens: int) -> torch.Tensor:
        """Keep the outputs of decoder layers `layer_ids` (global indices) of each forward's first max_tokens tokens,
        in that order, in the returned buffer [max_tokens, len(layer_ids) * hidden]. A pipeline stage writes the
        columns of the layers it holds (and rank 0 the last layer's); the hand-overs carry the others."""
        ids = list(layer_ids)
        hidden = self.config.hidden_size
        last = int(self.config.num_hidden_layers) - 1
        pp = getattr(self, "pp", None)
        first = 0 if pp is None else pp.start
        cols = {i: slice(j * hidden, (j + 1) * hidden) for j, i in enumerate(ids)}
        self._aux_cols = {i - first: c for i, c in cols.items()
                          if i != last and first <= i < first + len(self.layers)}
        self._aux_final = cols.get(last) if pp is None or pp.first else None
        self.aux_hidden = torch.zeros(max_tokens, len(ids) * hidden, dtype=self.dtype,
                                      device=self.norm.weight.device)
        return self.aux_hidden

    def keep_layer_output(self, i: int, x: Optional[torch.Tensor], residual: torch.Tensor) -> None:
        """After layer i (this stage's local index) returned (x, residual) (x None: a fused layer already added it
        into residual). Copied before the next layer's norm adds x into residual in place; the model's last layer's
        output is kept after the final norm."""
        cols = self._aux_cols.get(i) if self.aux_hidden is not None else None
        if cols is not None:
            self.aux_hidden[:residual.shape[0], cols] = residual if x is None else x + residual

    def keep_final_output(self, x: torch.Tensor) -> None:
        """The final norm's output x, as the last layer's entry."""
        if self.aux_hidden is not None and self._aux_final is not None:
            self.aux_hidden[:x.shape[0], self._aux_final] = x
