"""Speculative verification in the Gated DeltaNet layers: keep a state per verified position.

A verification step runs a request's known token and its k drafts (rows qsl[i]:qsl[i+1] of the flat batch) through
every layer at once. Attention layers simply write the drafts' KV (a rejected draft's slot is written again later);
a GDN layer's recurrent state instead would absorb every draft. So here each drafting request keeps the state after
each of its positions but the last in its checkpoint rows (voltllm.model.state_cache), and the sampler's verdicts
later select the one after the last accepted draft (StateCache.keep_accepted):
  conv state   after position j = the last K-1 rows of [old conv state | x_0 .. x_j] (the conv's inputs): gathered
               from the step's inputs before the conv moves the slot on (save_conv_checkpoints)
  SSM state    the delta rule walks the request's rows token by token (gdn_ref.gated_delta_rule_checkpointed, or
               the Triton kernel gdn_decode.gated_delta_rule_verify), writing S after each row
The step's one-row requests (plain decode rows) walk with them (one row, no checkpoint); longer rows without drafts
(prompt chunks) keep the chunked form (`rest`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from voltllm.host_to_device import to_device


@dataclass
class VerifyRows:
    """A verification step's split of the batch, built once per forward (HybridBatch.verify)."""
    walk_tokens: torch.Tensor  # long [Tw]: the flat rows of the requests walked token by token, in order
    walk_qsl: list[int]  # their query start locations within walk_tokens (host)
    walk_qsl_dev: torch.Tensor  # the same on the device
    walk_slots: torch.Tensor  # long [m]
    walk_init: torch.Tensor  # bool [m]
    # conv checkpoints of the drafting requests: gather indices into [old states (K-1 rows each) | their rows]
    draft_slots: torch.Tensor  # long [d]: the drafting requests' slots
    draft_tokens: torch.Tensor  # long: their flat rows, in order
    conv_src: Optional[torch.Tensor]  # long [P * (K-1)]: rows of the gathered table, checkpoint by checkpoint
    conv_dst: torch.Tensor  # long [P]: each checkpoint's row in the cache's row space
    rest_tokens: Optional[torch.Tensor]  # long: the other requests' flat rows, or None
    rest: Any  # HybridBatch of the other requests, or None

    @classmethod
    def build(cls, batch: Any, drafts: Sequence[int], slots: Sequence[int], init: Sequence[bool],
              kernel: int) -> "VerifyRows":
        """batch: the step's HybridBatch; drafts[i]: request i's drafts (its rows are its known token and the
        drafts); slots[i], init[i]: its slot and whether it resumes a state (host values of batch.slots /
        batch.has_initial_state); kernel: the conv's width K."""
        cache = batch.state_cache
        qsl = batch.query_start_loc
        n = len(qsl) - 1
        if len(drafts) != n:
            raise ValueError(f"state_drafts has {len(drafts)} entries for {n} requests")
        lens = [qsl[i + 1] - qsl[i] for i in range(n)]
        if max(drafts) > cache.checkpoints:
            raise RuntimeError(f"a request verifies {max(drafts)} drafts but the state cache keeps "
                               f"{cache.checkpoints} checkpoints per slot")
        walk = [i for i in range(n) if drafts[i] > 0 or lens[i] == 1]
        others = [i for i in range(n) if i not in set(walk)]
        for i in walk:
            if drafts[i] and lens[i] != drafts[i] + 1:
                raise ValueError(f"request {i} verifies {drafts[i]} drafts in {lens[i]} rows (known token + drafts)")
            if drafts[i] and not init[i]:
                raise ValueError(f"request {i} verifies drafts without a state to resume")
        walk_tokens, walk_qsl = [], [0]
        for i in walk:
            walk_tokens.extend(range(qsl[i], qsl[i + 1]))
            walk_qsl.append(len(walk_tokens))
        rest_tokens, rest_qsl = [], [0]
        for i in others:
            rest_tokens.extend(range(qsl[i], qsl[i + 1]))
            rest_qsl.append(len(rest_tokens))
        drafting = [i for i in range(n) if drafts[i] > 0]
        draft_tokens = [r for i in drafting for r in range(qsl[i], qsl[i + 1])]
        # the gathered table: drafting request c's old state rows at c*(K-1) .., then its rows after all states
        w, d = kernel - 1, len(drafting)
        src, ckpt = [], []  # ckpt: (request, position) of each checkpoint
        at = d * w
        for c, i in enumerate(drafting):
            xp = [c * w + r for r in range(w)] + list(range(at, at + lens[i]))
            at += lens[i]
            for j in range(drafts[i]):  # the state after position j: xp[j + 1 : j + K]
                src.extend(xp[j + 1:j + 1 + w])
                ckpt.append((c, j))
        dst = [cache.checkpoint_base + slots[drafting[c]] * cache.checkpoints + j for c, j in ckpt]
        dev = batch.slots.device
        flat = to_device(walk_tokens + walk + rest_tokens + others + drafting + draft_tokens + src + dst,
                         torch.long, dev)
        cuts = [len(walk_tokens), len(walk), len(rest_tokens), len(others), len(drafting), len(draft_tokens),
                len(src), len(dst)]
        parts, at = [], 0
        for c in cuts:
            parts.append(flat[at:at + c])
            at += c
        wt, wr, rt, orq, dr, dt, sr, ds = parts
        rest = None
        if others:
            from voltllm.model.layers.gdn import HybridBatch

            rest = HybridBatch(state_cache=cache, slots=batch.slots.index_select(0, orq),
                               has_initial_state=batch.has_initial_state.index_select(0, orq),
                               query_start_loc=rest_qsl, decode_only=False)
        return cls(wt, walk_qsl, to_device(walk_qsl, torch.int32, dev), batch.slots.index_select(0, wr),
                   batch.has_initial_state.index_select(0, wr), batch.slots.index_select(0, dr), dt,
                   sr if src else None, ds, rt if others else None, rest)

    def save_conv_checkpoints(self, x: torch.Tensor, conv_states: torch.Tensor, conv_rows: torch.Tensor) -> None:
        """Before the conv runs (it moves the slots on): the drafting requests' conv states after each position
        but the last, from the slots' old states and the step's conv inputs x [T, C], into their checkpoint rows
        (conv_rows: the layer's whole row space)."""
        if self.conv_src is None:
            return
        w, c = conv_states.shape[1], conv_states.shape[2]
        table = torch.cat([conv_states.index_select(0, self.draft_slots).reshape(-1, c),
                           x.index_select(0, self.draft_tokens).to(conv_states.dtype)])
        conv_rows.index_copy_(0, self.conv_dst, table.index_select(0, self.conv_src).reshape(-1, w, c))

    def delta_rule(self, q, k, v, g, beta, cache: Any, layer: int, use_triton: bool) -> torch.Tensor:
        """The walked requests' delta rule (their rows, packed in order), checkpoints written."""
        wt = self.walk_tokens
        args = (q.index_select(0, wt), k.index_select(0, wt), v.index_select(0, wt), g.index_select(0, wt),
                beta.index_select(0, wt), cache.ssm_rows[layer], self.walk_slots)
        if use_triton:
            from voltllm.kernels import gdn_decode

            return gdn_decode.gated_delta_rule_verify(*args, self.walk_qsl_dev[:-1], self.walk_qsl_dev[1:],
                                                      self.walk_init, cache.checkpoint_base, cache.checkpoints)
        from voltllm.kernels import gdn_ref

        return gdn_ref.gated_delta_rule_checkpointed(*args, self.walk_qsl, self.walk_init, cache.checkpoint_base,
                                                     cache.checkpoints)


@dataclass
class WindowCheckpoints:
    """A verification step's checkpoints of a per-slot sliding-window state other than GDN's conv: a state that is
    the last `width` rows of a request's inputs (Qwen4-Exp's PLE n-gram context and dilated-conv rows). As the GDN
    conv's (VerifyRows.save_conv_checkpoints): the state after drafting request i's position j (j < its drafts) is
    the last `width` rows of [its old state | its rows 0 .. j], written into checkpoint row j of its slot, whence
    StateCache.keep_accepted takes the last accepted position's."""
    draft_slots: torch.Tensor  # long [d]: the drafting requests' slots
    draft_tokens: torch.Tensor  # long: their flat rows, in order
    src: torch.Tensor  # long [P * width]: rows of the gathered table [old states | rows], checkpoint by checkpoint
    dst: torch.Tensor  # long [P]: each checkpoint's row in the cache's row space
    width: int

    @classmethod
    def build(cls, batch: Any, width: int) -> Optional["WindowCheckpoints"]:
        """batch: a verification step's HybridBatch (batch.drafts set); None when no request drafts."""
        if batch.drafts is None or not any(batch.drafts) or width < 1:
            return None
        cache, qsl, drafts = batch.state_cache, batch.query_start_loc, batch.drafts
        slots = batch.host_rows[0]
        drafting = [i for i, k in enumerate(drafts) if k > 0]
        if max(drafts) > cache.checkpoints:
            raise RuntimeError(f"a request verifies {max(drafts)} drafts but the state cache keeps "
                               f"{cache.checkpoints} checkpoints per slot")
        tokens, src, dst = [], [], []
        at = len(drafting) * width
        for c, i in enumerate(drafting):
            n = qsl[i + 1] - qsl[i]
            if n != drafts[i] + 1:
                raise ValueError(f"request {i} verifies {drafts[i]} drafts in {n} rows (known token + drafts)")
            tokens.extend(range(qsl[i], qsl[i + 1]))
            xp = [c * width + r for r in range(width)] + list(range(at, at + n))
            at += n
            for j in range(drafts[i]):  # the state after position j: xp[j + 1 : j + 1 + width]
                src.extend(xp[j + 1:j + 1 + width])
                dst.append(cache.checkpoint_base + slots[i] * cache.checkpoints + j)
        d = len(drafting)
        flat = to_device([slots[i] for i in drafting] + tokens + src + dst, torch.long, batch.slots.device)
        return cls(flat[:d], flat[d:d + len(tokens)], flat[d + len(tokens):d + len(tokens) + len(src)],
                   flat[d + len(tokens) + len(src):], width)

    def save(self, x: torch.Tensor, states: torch.Tensor, rows: torch.Tensor) -> None:
        """Before the step moves the slots on: states [slots + 1, width, C] (the slots' old states), x [T, C] (the
        step's inputs to the window), rows: the same state's whole row space [.., width, C] (checkpoints written)."""
        c = states.shape[2]
        table = torch.cat([states.index_select(0, self.draft_slots).reshape(-1, c),
                           x.index_select(0, self.draft_tokens).to(states.dtype)])
        rows.index_copy_(0, self.dst, table.index_select(0, self.src).reshape(-1, self.width, c))
