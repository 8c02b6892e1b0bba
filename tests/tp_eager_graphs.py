"""Decode-graph stand-ins for every tensor-parallel rank on the CPU: ModelRunner.capture_cuda_graphs installs a
DecodeGraphs whose graphs run the captured forward eagerly on the same persistent buffers and context (as
tests/unit/test_hybrid_graph_path.py's EagerReplay), so rank 0's and the workers' replay paths (state-slot buffers,
note_step, snapshot restores and saves around a replay; with speculation, a hybrid's verification walks; a split
drafter's graphs, tests/graph_stand_ins.py's padded passes) run as on the GPU. Rank 0 calls install() itself; spawned
workers import this module through the sitecustomize that `worker_env` writes (VOLTLLM_TEST_EAGER_GRAPHS set)."""
from __future__ import annotations

import os

SITE = "import os\nif os.environ.get('VOLTLLM_TEST_EAGER_GRAPHS'):\n    import tp_eager_graphs\n    " \
       "tp_eager_graphs.install()\n"


DRAFTER_GRAPH_ROWS = 16  # the largest batch a split drafter's stand-in graphs take (past it: its eager form)


class EagerReplay:
    def __init__(self, graphs, batch_size: int):
        self.graphs, self.batch_size = graphs, batch_size

    def replay(self):
        r, bs = self.graphs.runner, self.batch_size
        ctx = self.graphs.context(bs)
        ctx.meta.seq_lens_cpu = ctx.meta.seq_lens.tolist()  # (the torch reference attention reads host lengths)
        ctx.meta.max_seq_len = max(ctx.meta.seq_lens_cpu)
        return r.model(r.buffers.input_ids[:bs], r.buffers.positions[:bs], ctx)


def _capture(runner) -> None:
    from voltllm.worker.cuda_graphs import DecodeGraphs

    runner._ensure_buffers()
    graphs = DecodeGraphs(runner)
    graphs.graphs = {bs: EagerReplay(graphs, bs) for bs in graphs.sizes}
    runner.graphs = graphs
    if runner.is_hybrid and runner.config.speculative is not None:  # the verification's walks set too
        walks = DecodeGraphs(runner, walks=True)
        walks.graphs = {bs: EagerReplay(walks, bs) for bs in walks.sizes}
        runner.verify_graphs = walks
    draft = runner.draft
    # a split drafter's graphs, on every rank
    if getattr(draft, "group", None) is not None and (hasattr(draft, "graph_view") or hasattr(draft, "graph_extra")):
        from graph_stand_ins import PaddedDecodeGraphs  # (MTP / EAGLE: their view; DFlash: itself)

        view = draft.graph_view() if hasattr(draft, "graph_view") else draft
        draft.graphs = PaddedDecodeGraphs(view, DRAFTER_GRAPH_ROWS)
    elif getattr(draft, "group", None) is not None:  # a draft model: its DecodeGraphs over its view, replayed eagerly
        from voltllm.worker.draft_runner import _GraphView

        draft._graph_view = _GraphView(draft, runner)  # (DecodeGraphs holds it weakly)
        graphs = DecodeGraphs(draft._graph_view)
        graphs.graphs = {bs: EagerReplay(graphs, bs) for bs in graphs.sizes}
        draft.graphs = graphs


def install() -> None:
    from voltllm.worker.runner import ModelRunner

    ModelRunner.capture_cuda_graphs = _capture


def worker_env(monkeypatch, tmp_path, sys_path: list) -> None:
    """Make spawned workers install the stand-ins too (a sitecustomize on their PYTHONPATH)."""
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("VOLTLLM_TEST_EAGER_GRAPHS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path)] + list(sys_path)))
