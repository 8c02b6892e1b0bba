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
        ctx = ForwardContext(meta=meta, kv_caches=d.kv_caches, backend=d.backend)
        graph_extra = getattr(d, "graph_extra", None)  # (as DecodeGraphs.context: a DFlash drafter's rings)
        if graph_extra is not None:
            ctx.extra.update(graph_extra(meta, bs))
        return d.model(buf.input_ids[:bs], buf.positions[:bs], ctx)


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


def stand_in_graphs(llm, max_rows: int) -> None:
    """The target's decode graphs (decode and verification token rows; a hybrid's verification-walks graphs too) and
    its MTP-style drafter's (an EAGLE-1 / EAGLE-3 head's: its graph_view) up to max_rows, as CPU stand-ins."""
    from tp_eager_graphs import EagerReplay
    from voltllm.worker.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    runner._ensure_buffers()
    for walks in (False, True) if runner.state_cache is not None else (False,):
        graphs = DecodeGraphs(runner, walks=walks)
        graphs.graphs = {bs: EagerReplay(graphs, bs) for bs in graphs.sizes}
        setattr(runner, "verify_graphs" if walks else "graphs", graphs)
    runner.draft.graphs = PaddedDecodeGraphs(runner.draft.graph_view(), max_rows)
