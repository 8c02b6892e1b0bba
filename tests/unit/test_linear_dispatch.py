"""Which GEMM a Linear runs (voltllm.model.layers.linear): cuBLAS unless start-up tuning chose a Triton GEMM
for that row count (skinny at one row, decode-batch at the tuned batch sizes), the MLP's silu*mul fused
into whichever Triton GEMM runs. The kernels are replaced by recorders here (their numerics are checked
under the interpreter and on the GPU)."""
import torch

from voltllm.model.layers import linear as L


def _recorders(monkeypatch):
    calls = []
    import voltllm.kernels.batch_gemm as B
    import voltllm.kernels.gemv as G

    def fake(kind):
        def run(x, w, bias=None, config=None, silu_mul=False, **_):
            calls.append((kind, x.shape[0], config, silu_mul))
            return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)
        return run
    monkeypatch.setattr(G, "gemv", fake("gemv"))
    monkeypatch.setattr(B, "batch_gemm", fake("batch"))
    return calls


def test_linear_dispatch_by_row_count(monkeypatch):
    calls = _recorders(monkeypatch)
    layer = L.Linear(8, 4, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.skinny, layer.batch_gemm = ("s",), {16: ("b16",), 64: ("b64",)}
    for rows in (1, 2, 16, 17, 64):
        x = torch.randn(rows, 8)
        y = layer(x)
        assert y.shape == (rows, 4)
        if rows in (2, 17):  # no tuned choice: cuBLAS / torch
            assert torch.allclose(y, x @ layer.weight.t())
    assert calls == [("gemv", 1, ("s",), False), ("batch", 16, ("b16",), False), ("batch", 64, ("b64",), False)]


def test_down_proj_silu_mul_dispatch(monkeypatch):
    calls = _recorders(monkeypatch)
    layer = L.Linear(8, 4, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.batch_gemm = {32: ("b32",)}
    gu = torch.randn(32, 16)
    L.down_proj_silu_mul(layer, gu)
    gu3 = torch.randn(3, 16)
    y = L.down_proj_silu_mul(layer, gu3)  # untuned row count: silu_and_mul, then the layer
    act = torch.nn.functional.silu(gu3[:, :8]) * gu3[:, 8:]
    assert torch.allclose(y, act @ layer.weight.t(), atol=1e-6)
    assert calls == [("batch", 32, ("b32",), True)]


def test_down_proj_one_row_silu_split(monkeypatch):
    """skinny_silu_fused=False (start-up timing found it faster): the SiLU*mul runs first, then the plain GEMV,
    in down_proj_silu_mul and in the fused decode layer's residual-add GEMV alike."""
    calls = _recorders(monkeypatch)
    layer = L.Linear(8, 4, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.skinny = ("s",)
    gu = torch.randn(1, 16)
    L.down_proj_silu_mul(layer, gu)
    layer.skinny_silu_fused = False
    L.down_proj_silu_mul(layer, gu)
    assert calls == [("gemv", 1, ("s",), True), ("gemv", 1, ("s",), False)]
    seen = []
    import voltllm.kernels.gemv as G
    monkeypatch.setattr(G, "gemv", lambda x, w, bias=None, out=None, config=None, silu_mul=False, accumulate=False:
                        seen.append((tuple(x.shape), silu_mul, accumulate)))
    L.linear_add_(layer, gu, torch.zeros(1, 4), silu_mul=True)
    assert seen == [((1, 8), False, True)]


def test_down_proj_batch_silu_split(monkeypatch):
    """batch_silu_fused[rows]=False: at that row count the SiLU*mul kernel runs first and the decode-batch GEMM gets
    the [rows, I] activation; other row counts keep the prologue."""
    calls = _recorders(monkeypatch)
    layer = L.Linear(8, 4, dtype=torch.float32)
    layer.batch_gemm, layer.batch_silu_fused = {16: ("b16",), 32: ("b32",)}, {32: False}
    for rows in (16, 32):
        L.down_proj_silu_mul(layer, torch.randn(rows, 16))
    assert calls == [("batch", 16, ("b16",), True), ("batch", 32, ("b32",), False)]


def test_gated_mlp_one_row(monkeypatch):
    """skinny_gated on gate_up: at one row the gate_up GEMV writes silu(gate) * up (gated=True) and the down
    projection runs the plain GEMV on it; at other row counts, or without the flag, down_proj_silu_mul as before.
    The fused decode layer passes the same choice to the norm GEMV and the residual-add GEMV."""
    seen = []
    import voltllm.kernels.gemv as G

    def fake(x, w, bias=None, out=None, config=None, silu_mul=False, accumulate=False, norm=None, gated=False):
        seen.append((config, tuple(x.shape), silu_mul, gated, norm is not None, accumulate))
        return torch.zeros(x.shape[0], w.shape[0] // 2 if gated else w.shape[0], dtype=torch.float32)
    monkeypatch.setattr(G, "gemv", fake)
    gu, down = L.Linear(4, [8, 8], dtype=torch.float32), L.Linear(8, 4, dtype=torch.float32)
    gu.skinny, down.skinny = ("g",), ("d",)
    x = torch.randn(1, 4)
    L.gated_mlp(gu, down, x)
    # not gated: the plain gate_up GEMV, then the down projection with the activation in its prologue
    assert seen == [(("g",), (1, 4), False, False, False, False), (("d",), (1, 16), True, False, False, False)]
    seen.clear()
    gu.skinny_gated = True
    L.gated_mlp(gu, down, x)
    assert seen == [(("g",), (1, 4), False, True, False, False), (("d",), (1, 8), False, False, False, False)]
    seen.clear()
    y = L.gated_mlp(gu, down, torch.randn(3, 4))  # three rows: torch, with the SiLU*mul kernel between
    assert seen == [] and y.shape == (3, 4)
    assert L.one_row_gated(gu, x) and not L.one_row_gated(gu, torch.randn(2, 4))
    L.norm_linear(gu, torch.randn(1, 4), type("N", (), {"weight": torch.ones(4), "eps": 1e-6, "offset": 0.0}),
                  gated=True)
    assert seen[-1] == (("g",), (1, 4), False, True, True, False)


def test_gated_mlp_decode_batch(monkeypatch):
    """batch_gated[rows] on gate_up: at that row count the decode-batch GEMM writes silu(gate) * up (gated=True)
    and the down projection runs plain (its own tuned GEMM or cuBLAS); other row counts keep gate_up plain and the
    activation for the down projection."""
    seen = []
    import voltllm.kernels.batch_gemm as B

    def fake(x, w, bias=None, config=None, silu_mul=False, gated=False, **_):
        seen.append((config, tuple(x.shape), silu_mul, gated))
        return torch.zeros(x.shape[0], w.shape[0] // 2 if gated else w.shape[0], dtype=torch.float32)
    monkeypatch.setattr(B, "batch_gemm", fake)
    gu, down = L.Linear(4, [8, 8], dtype=torch.float32), L.Linear(8, 4, dtype=torch.float32)
    gu.batch_gemm, gu.batch_gated = {16: ("g16",), 32: ("g32",)}, {32: True}
    down.batch_gemm = {32: ("d32",)}
    for rows in (16, 32):
        assert L.gated_mlp(gu, down, torch.randn(rows, 4)).shape == (rows, 4)
    assert seen == [(("g16",), (16, 4), False, False),  # 16 rows: plain gate_up; down (cuBLAS) after the SiLU kernel
                    (("g32",), (32, 4), False, True), (("d32",), (32, 8), False, False)]


def _tiny_causal_lm(kind: str, tie: bool):
    import transformers

    from voltllm.model.models.llama import LlamaForCausalLM
    from voltllm.model.models.qwen3_next import Qwen3NextForCausalLM

    common = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, intermediate_size=24, tie_word_embeddings=tie)
    if kind == "qwen3":
        return LlamaForCausalLM(transformers.Qwen3Config(**common), torch.float32, 64)
    cfg = transformers.Qwen3NextConfig(**common, linear_num_key_heads=2, linear_num_value_heads=2,
                                       linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0,
                                       layer_types=["full_attention"])
    return Qwen3NextForCausalLM(cfg, torch.float32, 64)


import pytest  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("tie", [False, True], ids=["own_head", "tied"])
def test_lm_head_runs_the_tuned_gemm_by_row_count(monkeypatch, kind, tie):
    """compute_logits takes the LM head's start-up choices (logits_skinny at one row, logits_batch by decode-batch
    row count; tied heads too), cuBLAS elsewhere: the decode-batch choice used to be timed and then never run."""
    calls = _recorders(monkeypatch)
    model = _tiny_causal_lm(kind, tie)
    w = model.logits_weight
    assert w is not None and w.shape == (40, 16)
    assert (w is model.embed_tokens.weight) == tie
    w.data.normal_()  # (built uninitialised)
    model.logits_skinny, model.logits_batch = ("s",), {4: ("b4",)}
    for rows in (1, 3, 4):
        h = torch.randn(rows, 16)
        logits = model.compute_logits(h)
        assert logits.shape == (rows, 40)
        if rows == 3:  # no tuned choice at 3 rows
            assert torch.allclose(logits, h @ w.t(), atol=1e-5)
    assert calls == [("gemv", 1, ("s",), False), ("batch", 4, ("b4",), False)]


def test_greedy_tokens_only_where_the_tuner_chose_the_epilogue(monkeypatch):
    """LlamaForCausalLM.greedy_tokens (the LM head's argmax epilogue) answers None, so the runner computes logits,
    without a start-up choice for the row count and on the CPU; no GEMM runs then. (Its positive path and the other
    guards need CUDA tensors: tests/gpu/test_head_argmax_gpu.py.)"""
    calls = _recorders(monkeypatch)
    model = _tiny_causal_lm("qwen3", False)
    h = torch.randn(4, 16)
    assert model.greedy_tokens(h) is None  # no choice
    model.logits_argmax = {4: ("b4",)}
    assert model.greedy_tokens(h) is None  # the CPU: no decode-batch Triton GEMM there
    assert model.greedy_tokens(h[0]) is None  # not a [rows, hidden] batch
    assert calls == []
