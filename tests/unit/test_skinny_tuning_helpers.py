"""The start-up GEMM tuner's helpers (voltllm.worker.skinny_tuning): the weight rotation (enough distinct weights
of the shape to stream L2_FLUSH_BYTES between two reads of the same one, the model's own weights first) and the
config choice (wrong results and tiles the GPU cannot hold are never chosen)."""
import torch

from voltllm.worker import skinny_tuning as T


def test_rotation_pads_small_weights_to_the_flush_size(monkeypatch):
    monkeypatch.setattr(T, "L2_FLUSH_BYTES", 1 << 20)
    own = [torch.zeros(64, 64, dtype=torch.float16) for _ in range(3)]  # 8 KB each
    rot = T._rotation(own)
    assert all(a is b for a, b in zip(rot, own)) and len(rot) == (1 << 20) // (64 * 64 * 2)
    assert all(w.shape == (64, 64) and w.dtype == torch.float16 for w in rot)
    scratch = torch.stack(rot[3:])
    assert scratch.abs().sum() > 0 and not torch.equal(scratch[0], scratch[1])  # filled, distinct
    assert len({w.data_ptr() for w in rot}) == len(rot)


def test_rotation_keeps_enough_or_large_weights():
    big = [torch.zeros(1024, 1024, dtype=torch.float16)] * 2
    many = big * 200  # 400 x 2 MiB >= 256 MiB
    assert T._rotation(many) is many
    huge = torch.zeros(1, dtype=torch.float16).expand(T.L2_FLUSH_BYTES)  # one weight past the flush size
    one = [huge]
    assert T._rotation(one) is one


def test_fastest_skips_configs_the_gpu_cannot_run(monkeypatch):
    """A tile that does not fit this GPU (Triton raises OutOfResources before launching) is skipped, not fatal."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(T, "graph_replay_ms", lambda fn, weights: 1.0 if fn(weights[0]) is not None else 9.0)
    w = torch.randn(8, 16)
    x = torch.randn(2, 16)

    def run(x_, w_, cfg):
        if cfg == "big":
            raise OutOfResources(300000, 232448, "shared memory")
        return x_ @ w_.t() if cfg == "good" else torch.zeros(2, 8)  # "wrong" computes something else
    t_lib, best, t_tri = T._fastest([w], x, ["big", "wrong", "good"], run)
    assert best == "good" and t_tri == 1.0 and t_lib == 1.0


def _mlp_pair(n_inter=8, hidden=4):
    from voltllm.model.models.llama import MLP

    mlp = MLP(hidden, n_inter, torch.float16)
    return mlp, mlp.gate_up_proj, mlp.down_proj


def test_gated_mlp_choice_follows_the_summed_timings():
    """The MLP-level choice: gate_up with the SiLU*mul in its epilogue + plain down replaces the separate choices
    only when its summed time is lower; it needs both projections on the Triton GEMV, and it takes each side's
    best config for that form."""
    mlp, gu, down = _mlp_pair()
    assert T._gated_pairs(torch.nn.Sequential(mlp)) == [(gu, down)]
    g = {"best": "gu-plain", "t_tri": 48.0, "best_gated": "gu-gated", "t_gated": 49.0, "t_silu": 3.0}
    d = {"best": "d-pro", "t_tri": 36.0, "best_split": "d-plain", "t_split": 29.0}
    timings = {(16, 4, False): g, (4, 8, True): d}

    def setup(down_fused):
        gu.skinny, gu.skinny_gated = "gu-plain", False
        down.skinny, down.skinny_silu_fused = ("d-pro" if down_fused else "d-plain"), down_fused

    setup(False)  # as chosen: 48 + 29 (SiLU kernel included); gated: 49 + (29 - 3) = 75 < 77
    lines = T._choose_gated_mlps([(gu, down)], timings)
    assert (gu.skinny, gu.skinny_gated, down.skinny, down.skinny_silu_fused) == ("gu-gated", True, "d-plain", False)
    assert "-> gated" in lines[0]
    setup(False)
    g["t_gated"] = 52.0  # 52 + 26 = 78 > 77: keep the separate choices
    assert "-> as chosen" in T._choose_gated_mlps([(gu, down)], timings)[0]
    assert (gu.skinny, gu.skinny_gated, down.skinny) == ("gu-plain", False, "d-plain")
    setup(True)  # down with the prologue: as chosen 48 + 36 = 84; gated 52 + 26 = 78
    T._choose_gated_mlps([(gu, down)], timings)
    assert gu.skinny_gated and down.skinny == "d-plain" and not down.skinny_silu_fused
    setup(False)
    down.skinny = None  # the down projection on cuBLAS: no gated form (it would need the plain GEMV)
    assert T._choose_gated_mlps([(gu, down)], timings) == [] and not gu.skinny_gated


def test_gated_batch_mlp_choice_per_row_count():
    """The decode-batch form of the MLP-level choice, per row count: gate_up gated (its best split-free tile) +
    plain down where the sum is lower than gate_up and the down side (SiLU included) as chosen alone, whichever
    library each side chose; other row counts keep their choices. One log line per shape and row count."""
    mlp, gu, down = _mlp_pair()
    gu.batch_gemm, down.batch_gemm = {16: "gu16"}, {}
    timings = {(16, 4, False, 16): {"t_chosen": 40.0, "best_gated": "g16", "t_gated": 41.0, "t_silu": 2.0},
               (4, 8, True, 16): {"t_chosen": 30.0},  # cuBLAS + SiLU kernel
               (16, 4, False, 64): {"t_chosen": 50.0, "best_gated": "g64", "t_gated": 53.0, "t_silu": 2.0},
               (4, 8, True, 64): {"t_chosen": 31.0},
               (16, 4, False, 32): {"t_chosen": 45.0, "best_gated": None}}  # no gated tile compiled
    lines = T._choose_gated_batch_mlps([(gu, down), (gu, down)], timings, [16, 32, 64])
    # 16 rows: 41 + (30 - 2) = 69 < 70 -> gated; 64 rows: 53 + 29 = 82 > 81 -> as chosen; 32: not timed
    assert gu.batch_gemm == {16: "g16"} and gu.batch_gated == {16: True} and down.batch_gemm == {}
    assert len(lines) == 2 and lines[0].startswith("M=16 MLP 16x4 -> 4x8") and lines[0].endswith("-> gated")
    assert lines[1].startswith("M=64 ") and lines[1].endswith("-> as chosen")


def test_prologue_or_silu_kernel_keeps_the_faster(monkeypatch):
    """A down projection keeps the activation in the GEMM's prologue unless SiLU kernel + plain GEMM times lower;
    the plain GEMM is timed on the activation (run_plain gets silu(gate) * up) against SiLU + cuBLAS."""
    seen = {}

    def fake_fastest(weights, x, configs, run, silu_mul=False):
        seen["silu_mul"] = silu_mul
        seen["run_input"] = run(x, "w", "cfg").shape
        return 5.0, "split-cfg", seen["t"]
    monkeypatch.setattr(T, "_fastest", fake_fastest)
    x = torch.randn(1, 8)
    for t_split, expect in ((0.030, (False, "split-cfg", 0.030)), (0.040, (True, "pro-cfg", 0.036))):
        seen["t"] = t_split
        got = T._prologue_or_silu_kernel([], x, (), lambda x_, w_, cfg: x_, "pro-cfg", 0.036, "GEMV")
        assert got[:3] == expect and "SiLU kernel + GEMV" in got[3]
    assert seen["silu_mul"] is True and seen["run_input"] == (1, 4)


def test_small_weights_time_the_short_candidate_list():
    """Weights under SMALL_WEIGHT_BYTES are timed on SMALL_WEIGHT_CONFIGS (start-up compile time); TMA tiles only
    where the device has TMA; larger weights (or no size) get every candidate."""
    from voltllm.kernels import batch_gemm as B

    cpu = torch.device("cpu")  # no TMA
    small = B.configs_for(cpu, B.SMALL_WEIGHT_BYTES - 1)
    assert small and set(small) <= set(B.SMALL_WEIGHT_CONFIGS) and all(len(c) == 5 for c in small)
    assert B.configs_for(cpu, B.SMALL_WEIGHT_BYTES) == B.CONFIGS == B.configs_for(cpu)
    assert all(c in B.CONFIGS + B.TMA_CONFIGS for c in B.SMALL_WEIGHT_CONFIGS)


def test_time_group_without_the_prologue_times_only_silu_kernel_plus_gemm(monkeypatch):
    """prologue=False (the decode-batch tuner's default): a down projection is timed once, as SiLU kernel + plain
    GEMM (the GEMM gets silu(gate) * up, never silu_mul=True) against SiLU + cuBLAS; its result is the split form's
    (activation not in the prologue), recorded as the split choice too for the MLP-level gated choice."""
    calls = []

    def fake_fastest(weights, x, configs, run, silu_mul=False):
        calls.append((silu_mul, run(x, "w", "cfg")))
        return 7.0, "split-cfg", 0.005
    monkeypatch.setattr(T, "_fastest", fake_fastest)
    gemm = lambda x_, w_, config, silu_mul=False: (x_.shape, silu_mul)  # noqa: E731
    x, t_lib, best, t_tri, fused, note, rec = T._time_group([torch.zeros(4, 8)], 8, True, 16, ("cfg",), gemm, "GEMM",
                                                            prologue=False)
    assert calls == [(True, ((16, 8), False))] and x.shape == (16, 16)
    assert (t_lib, best, t_tri, fused) == (7.0, "split-cfg", 0.005, False) and "SiLU kernel + GEMM" in note
    assert rec["best_split"] == rec["best"] == "split-cfg" and rec["t_split"] == rec["t_tri"] == 0.005
    assert T.BATCH_SILU_PROLOGUE is False
