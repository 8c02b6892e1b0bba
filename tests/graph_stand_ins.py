"""CPU stand-ins for the decode graphs a draft model, DFlash drafter or MTP module (its graph_view) replays on the
GPU: what a replay computes, over the graph's padded rows read from the runner's input buffers (padding rows: no slot,
position 0, one token of context), so the host side of the graph form (padding, buffer copies) is checked against the
eager form."""
from __future__ import annotations


class PaddedDecodePass:
    """One captured batch size of `draft` (anything with .runner, .model, .kv_caches, .backend)."""

    def __init__(self, draft, batch_size):
        self.draft, self.batch_size = draft, batch_size

    def replay(self):
        from voltllm.attention.backend import AttentionMetadata
        from voltllm.model.forward_context import ForwardContext

        d, bs = self.draft, self.batch_size
        buf = d.runner.buffers
        lens = buf.seq_lens[:bs].tolist()
        meta = AttentionMetadata(
            num_tokens=bs, query_start_loc=buf.query_start_loc[:bs + 1], seq_lens=buf.seq_lens[:bs],
            block_tables=buf.block_tables[:bs], slot_mapping=buf.slot_mapping[:bs], max_query_len=1,
            max_seq_len=max(lens), query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=lens)
        return d.model(buf.input_ids[:bs], buf.positions[:bs],
                       ForwardContext(meta=meta, kv_caches=d.kv_caches, backend=d.backend))


class PaddedDecodeGraphs:
    """DecodeGraphs' for_batch over power-of-two batch sizes up to max_rows (None past it: the eager form)."""

    def __init__(self, draft, max_rows: int):
        self.draft, self.max_rows = draft, max_rows
        self.replays = 0

    def for_batch(self, n: int):
        bs = 1 << (n - 1).bit_length() if n else 0
        if not 0 < bs <= self.max_rows:
            return None
        self.replays += 1
        return PaddedDecodePass(self.draft, bs)
