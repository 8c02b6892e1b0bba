"""Decode-graph stand-ins for every tensor-parallel rank on the CPU: ModelRunner.capture_cuda_graphs installs a
DecodeGraphs whose graphs run the captured forward eagerly on the same persistent buffers and context (as
tests/unit/test_hybrid_graph_path.py's EagerReplay), so rank 0's and the workers' replay paths (state-slot buffers,
note_step, snapshot restores and saves around a replay; with speculation, a hybrid's verification walks; a split
drafter's graphs, tests/graph_stand_ins.py's padded passes) run as on the GPU. Rank 0 calls install() itself; the
workers import this module through the sitecustomize that `worker_env` writes (VOLTLLM_TEST_EAGER_GRAPHS set), which
their forkserver (voltllm/distributed/executor.py) runs as it starts: `worker_env` puts a new one in place for the test,
which starts with that environment, and tests/conftest.py stops it after the test."""
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


FRESH = []  # forkservers worker_env made (tests/conftest.py stops them after the test)


def _fresh_forkserver(monkeypatch) -> None:
    """Until monkeypatch undoes it, workers start from a new forkserver, which starts with the environment of its first
    use; the running one (whose children may be the workers of a module's engines) is left alone."""
    from multiprocessing import forkserver

    fresh = forkserver.ForkServer()
    FRESH.append(fresh)
    monkeypatch.setattr(forkserver, "_forkserver", fresh)
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload"):
        monkeypatch.setattr(forkserver, name, getattr(fresh, name))


def stop_fresh_forkservers() -> None:
    while FRESH:
        FRESH.pop()._stop()  # (CPython's own tests stop a forkserver this way)


def worker_env(monkeypatch, tmp_path, sys_path: list) -> None:
    """Make the workers install the stand-ins too (a sitecustomize on their PYTHONPATH)."""
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("VOLTLLM_TEST_EAGER_GRAPHS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path)] + list(sys_path)))
    _fresh_forkserver(monkeypatch)
