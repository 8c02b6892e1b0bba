"""Gated DeltaNet reference ops (chunked == recurrent, any chunk size / split), conv1d state carry, the varlen
entry points over a slot pool, the MoE reference, and the StateCache bookkeeping."""
import pytest
import torch
import torch.nn.functional as F

from voltllm.kernels import gdn_ref as R
from voltllm.model.layers.moe import fused_experts_ref, route
from voltllm.model.state_cache import StateCache


def _inputs(L, hk=2, hv=4, dk=16, dv=8, seed=0, decay=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, hk, dk, generator=g)
    k = torch.randn(L, hk, dk, generator=g)
    v = torch.randn(L, hv, dv, generator=g)
    gl = -torch.rand(L, hv, generator=g) * decay
    beta = torch.rand(L, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g)
    return q, k, v, gl, beta, s0


@pytest.mark.parametrize("L", [1, 5, 64, 131])
@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_chunked_equals_recurrent(L, chunk):
    q, k, v, g, beta, s0 = _inputs(L, seed=L * 7 + chunk)
    for init in (None, s0):
        o_r, s_r = R.recurrent_gated_delta_rule(q, k, v, g, beta, init)
        o_c, s_c = R.chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=chunk)
        torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s_c, s_r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [[0, 1, 2, 100], [0, 37, 38, 100], [0, 64, 100], [0, 3, 70, 99, 100]])
@pytest.mark.parametrize("chunk", [16, 64])
def test_split_calls_carry_state(splits, chunk):
    q, k, v, g, beta, s0 = _inputs(100, hk=1, hv=3, seed=len(splits) + chunk)
    o_full, s_full = R.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    s, outs = s0, []
    for a, b in zip(splits[:-1], splits[1:]):
        fn = R.recurrent_gated_delta_rule if b - a == 1 else R.chunk_gated_delta_rule
        o, s = fn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), o_full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_full, atol=2e-5, rtol=1e-4)


def test_strong_decay_is_finite_and_matches():
    q, k, v, g, beta, s0 = _inputs(150, seed=3, decay=60.0)  # exp(sum g) underflows inside a chunk
    o_r, s_r = R.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = R.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=64)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    torch.testing.assert_close(o_c, o_r, atol=2e-5, rtol=1e-4)


def test_half_inputs_keep_fp32_state():
    q, k, v, g, beta, s0 = _inputs(40, seed=5)
    o, s = R.chunk_gated_delta_rule(q.half(), k.half(), v.half(), g, beta, s0, chunk_size=16)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    o_ref, _ = R.recurrent_gated_delta_rule(q.half().float(), k.half().float(), v.half().float(), g, beta, s0)
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=1e-2)


def _full_conv(x, w):
    K = w.shape[1]
    return F.silu(F.conv1d(x.t()[None], w[:, None], padding=K - 1, groups=x.shape[1])[0, :, :x.shape[0]].t())


@pytest.mark.parametrize("splits", [[0, 50], [0, 1, 2, 3, 50], [0, 2, 30, 31, 50], [0, 49, 50]])
def test_conv1d_state_carry_equals_full_conv(splits):
    g = torch.Generator().manual_seed(len(splits))
    x = torch.randn(50, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    ref = _full_conv(x, w)
    state, outs = None, []
    for a, b in zip(splits[:-1], splits[1:]):
        if b - a == 1 and state is not None:
            o, state = R.causal_conv1d_step(x[a:b], w, None, state[None])
            state = state[0]
        else:
            o, state = R.causal_conv1d(x[a:b], w, None, state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, x[-3:])


@pytest.mark.parametrize("kernel", [4, 2, 1])
def test_conv_varlen_one_conv_equals_per_request(kernel):
    """The one-conv varlen form == causal_conv1d per request: lengths shorter than K-1, a request without
    tokens (its slot untouched, even without initial state), slots out of order, padding rows past the batch."""
    g = torch.Generator().manual_seed(20 + kernel)
    lens = [5, 0, 1, 2, 33, 3, 0]
    n, C = len(lens), 6
    qsl = [0]
    for length in lens:
        qsl.append(qsl[-1] + length)
    T = qsl[-1]
    x = torch.randn(T + 3, C, generator=g)
    w = torch.randn(C, kernel, generator=g)
    bias = torch.randn(C, generator=g)
    pool = torch.randn(n + 2, kernel - 1, C, generator=g)
    slots = torch.randperm(n + 2, generator=g)[:n]
    init = torch.tensor([i % 3 != 0 for i in range(n)])
    before = pool.clone()
    plan = R.conv_plan(qsl, kernel, x.device)
    y = R.causal_conv1d_varlen(x, w, bias, pool, slots, qsl, init, plan=plan)
    assert (y[T:] == 0).all()
    for i in range(n):
        s, e, sl = qsl[i], qsl[i + 1], int(slots[i])
        if e == s:
            assert torch.equal(pool[sl], before[sl])
            continue
        yr, st = R.causal_conv1d(x[s:e], w, bias, before[sl] if init[i] else None)
        torch.testing.assert_close(y[s:e], yr, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(pool[sl], st)
    others = [j for j in range(n + 2) if j not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
    # without a plan the call builds the same one; a batch of empty requests changes nothing
    pool2 = before.clone()
    torch.testing.assert_close(R.causal_conv1d_varlen(x, w, bias, pool2, slots, qsl, init), y)
    torch.testing.assert_close(pool2, pool)
    assert R.conv_plan([0, 0, 0], kernel, x.device) is None
    # one live request (after an empty one): no gathers, the same result as the general form
    one = R.conv_plan([0, 0, 7], kernel, x.device)
    assert one.single and one.tokens == 7 and not plan.single
    pool4, pool5 = before.clone(), before.clone()
    y4 = R.causal_conv1d_varlen(x, w, bias, pool4, slots[:2], [0, 0, 7], init[1:3], plan=one)
    y5, st5 = R.causal_conv1d(x[:7], w, bias, before[int(slots[1])] if init[2] else None)
    torch.testing.assert_close(y4[:7], y5, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool4[int(slots[1])], st5)
    assert torch.equal(pool4[int(slots[0])], pool5[int(slots[0])])
    pool3 = before.clone()
    assert (R.causal_conv1d_varlen(x, w, bias, pool3, slots[:2], [0, 0, 0], init[:2]) == 0).all()
    assert torch.equal(pool3, before)


def test_varlen_entry_points_match_per_request():
    """Three requests in one flat batch, slots out of order, one without initial state; then a decode batch."""
    hk, hv, dk, dv, C, K = 2, 4, 8, 8, 10, 4
    lens = [7, 1, 20]
    slots = torch.tensor([2, 0, 3])
    init = torch.tensor([True, False, True])
    g = torch.Generator().manual_seed(11)
    conv_pool = torch.randn(4, K - 1, C, generator=g)
    ssm_pool = torch.randn(4, hv, dk, dv, generator=g)
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    T = sum(lens)
    x = torch.randn(T + 2, C, generator=g)  # 2 padding rows past the batch
    w = torch.randn(C, K, generator=g)
    q, k = torch.randn(T + 2, hk, dk, generator=g), torch.randn(T + 2, hk, dk, generator=g)
    v = torch.randn(T + 2, hv, dv, generator=g)
    gl, beta = -torch.rand(T + 2, hv, generator=g), torch.rand(T + 2, hv, generator=g)
    qsl = [0, 7, 8, 28]
    y = R.causal_conv1d_varlen(x, w, None, conv_pool, slots, qsl, init)
    o = R.gated_delta_rule_varlen(q, k, v, gl, beta, ssm_pool, slots, qsl, init, chunk_size=8)
    assert (y[T:] == 0).all() and (o[T:] == 0).all()
    for i in range(3):
        s, e, sl = qsl[i], qsl[i + 1], int(slots[i])
        yr, cs = R.causal_conv1d(x[s:e], w, None, conv0[sl] if init[i] else None)
        orr, ss = R.recurrent_gated_delta_rule(q[s:e], k[s:e], v[s:e], gl[s:e], beta[s:e],
                                               ssm0[sl] if init[i] else None)
        torch.testing.assert_close(y[s:e], yr)
        torch.testing.assert_close(conv_pool[sl], cs)
        torch.testing.assert_close(o[s:e], orr, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ssm_pool[sl], ss, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(conv_pool[1], conv0[1])  # untouched slot
    # decode batch through the vectorized path == the general path
    qsl1, init1 = [0, 1, 2, 3], torch.tensor([True, False, True])
    pools = [(conv_pool.clone(), ssm_pool.clone()) for _ in range(2)]
    res = []
    for (cp, sp), dec in zip(pools, (True, False)):
        yy = R.causal_conv1d_varlen(x[:3], w, None, cp, slots, qsl1, init1, decode_only=dec)
        oo = R.gated_delta_rule_varlen(q[:3], k[:3], v[:3], gl[:3], beta[:3], sp, slots, qsl1, init1,
                                       decode_only=dec)
        res.append((yy, oo, cp, sp))
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_moe_reference_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 6, 16, 8, 13, 2
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.3
    w2 = torch.randn(E, H, I, generator=g) * 0.3
    logits = torch.randn(T, E, generator=g)
    logits[:, 5] = -1e4  # expert 5 never chosen: skipped
    for renorm in (True, False):
        w, ids = route(logits, k, renorm)
        if renorm:
            torch.testing.assert_close(w.sum(-1), torch.ones(T))
        out = fused_experts_ref(x, w13, w2, w, ids)
        ref = torch.zeros_like(x)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                gate, up = (x[t] @ w13[e].t()).chunk(2)
                ref[t] += w[t, j] * ((F.silu(gate) * up) @ w2[e].t())
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_state_cache_slots():
    c = StateCache(num_layers=2, num_slots=3, conv_shape=(3, 8), ssm_shape=(2, 4, 4), conv_dtype=torch.float32)
    a, b = c.allocate("a"), c.allocate("b")
    assert a != b and c.allocate("a") == a and c.num_free == 1
    c.allocate("c")
    with pytest.raises(RuntimeError, match="exhausted"):
        c.allocate("d")
    c.check_integrity()
    c.ssm[1][a].fill_(3.0)
    c.copy_slot(a, b)
    assert (c.ssm[1][b] == 3.0).all()
    c.reset(b)
    assert (c.ssm[1][b] == 0).all() and (c.ssm[1][a] == 3.0).all()
    c.free("a")
    c.free("a")  # no-op
    assert c.slot_of("a") is None and c.allocate("d") == a
    c.check_integrity()
    assert c.ssm[0].dtype == torch.float32 and c.conv[0].shape == (4, 3, 8) and c.pad_slot == 3  # + scratch row


def test_state_cache_note_step():
    c = StateCache(num_layers=1, num_slots=2, conv_shape=(3, 8), ssm_shape=(2, 4, 4), conv_dtype=torch.float32)
    a, b = c.allocate("a"), c.allocate("b")
    c.note_step([a, b, -1, -1], [0, 0, 0, 0], [5, 3, 1, 1])
    c.note_step([a, b], [5, 3], [6, 9])
    assert c.num_tokens[a] == 6 and c.num_tokens[b] == 9
    with pytest.raises(RuntimeError, match="covers 6 tokens"):
        c.note_step([a], [7], [8])
    with pytest.raises(ValueError, match="share"):
        c.note_step([a, a], [0, 0], [1, 1])
    c.note_step([b], [0], [4])  # restart from token 0 (preemption) is always allowed
    c.free("a")
    assert c.num_tokens[c.allocate("c")] == 0


def test_triton_prefill_routing():
    """Exact products: a step of long prompts only goes to the torch chunked form; a short request (a decode row, a
    short prompt) keeps the Triton kernels. Tensor-core products: the kernels always."""
    from types import SimpleNamespace

    from voltllm.model.layers.gdn import LONG_PREFILL_TOKENS as N, GatedDeltaNet

    def fits(qsl, precision="ieee"):
        return GatedDeltaNet._triton_prefill_fits(SimpleNamespace(query_start_loc=qsl), precision)

    assert not fits([0, N])
    assert not fits([0, 8192])
    assert not fits([0, N, 2 * N, 4 * N + 5])  # several long prompts
    assert fits([0, N - 1])
    assert fits([0, N, N + 1])  # a decode row beside a long prompt
    assert fits([128 * i for i in range(65)])  # 64 x 128
    # tensor-core products: the kernels win every batch timed, the single long prefill too
    assert fits([0, 8192], "tf32x3")
    assert GatedDeltaNet.chunk_precision == "ieee"  # exact products unless the runner says otherwise


def test_gdn_chunk_precision_choice():
    """Tensor-core (3xTF32) products only for half-precision activations on sm_80+ off the compat route."""
    from voltllm.kernels.gdn_chunk import TILES, precision_for

    assert precision_for(torch.float16, (9, 0)) == "tf32x3"
    assert precision_for(torch.bfloat16, (8, 0)) == "tf32x3"
    assert set(TILES) == {"ieee", "tf32", "tf32x3"}
    assert precision_for(torch.float16, (9, 0), compat=True) == "ieee"  # --compat sm70 on an H200
    assert precision_for(torch.float16, (7, 0)) == "ieee"  # V100: no tf32
    assert precision_for(torch.float16, (7, 5)) == "ieee"
    assert precision_for(torch.float32, (9, 0)) == "ieee"  # fp32 models keep exact products
    assert precision_for(torch.float16, None) == "ieee"  # CPU


def test_runner_sets_gdn_precision_on_cpu(tmp_path):
    """The runner sets every GDN layer's precision from its device and route (the CPU keeps exact products)."""
    from tiny_models import make_tiny_hybrid
    from voltllm import LLM
    from voltllm.model.layers.gdn import GatedDeltaNet, set_chunk_precision

    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", 702, 703)
    if path is None:
        pytest.skip("qwen3_5 not in this transformers")
    model = LLM(path, device="cpu", skip_tokenizer_init=True, mamba_cache_mode="none").engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(m.chunk_precision == "ieee" for m in layers)
    assert set_chunk_precision(model, "tf32x3") == len(layers)
    assert all(m.chunk_precision == "tf32x3" for m in layers)


def _tiny_gdn_layer():
    from types import SimpleNamespace

    from voltllm.model.layers.gdn import GatedDeltaNet

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6)
    gen = torch.Generator().manual_seed(5)
    layer = GatedDeltaNet(cfg, 0, torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.empty(4).uniform_(0.02, 0.5, generator=gen).log())
    return layer


def test_chunk_kernels_that_do_not_fit_raise_their_own_error(monkeypatch):
    """Every tile out of shared memory (a V100, T4 or 99-KB consumer card) -> ChunkKernelsDoNotFit, after trying
    each tile of the precision and then the "ieee" ones."""
    from triton.runtime.errors import OutOfResources

    from voltllm.kernels import gdn_chunk

    tried = []

    def no_room(precision, tile, *args):
        tried.append((precision, tile))
        raise OutOfResources(114688, 98304, "shared memory")

    monkeypatch.setattr(gdn_chunk, "_launch", no_room)
    q, k, v, g, beta, _ = _inputs(70, hk=2, hv=4, dk=16, dv=16)
    states = torch.zeros(2, 4, 16, 16)
    with pytest.raises(gdn_chunk.ChunkKernelsDoNotFit, match="no tile fits"):
        gdn_chunk.gated_delta_rule_chunked(q, k, v, g, beta, states, torch.tensor([1]), [0, 70],
                                           torch.tensor([False]), precision="tf32x3")
    assert tried == [("tf32x3", t) for t in gdn_chunk.TILES["tf32x3"]] + [("ieee", t) for t in gdn_chunk.TILES["ieee"]]
    assert states.abs().sum() == 0


def test_layer_runs_the_torch_form_where_the_chunk_kernels_do_not_fit(monkeypatch):
    """GatedDeltaNet: when the chunk kernels report ChunkKernelsDoNotFit, the step runs the torch chunked form
    (same outputs and states as a layer set to it) and later steps on that device do not try the kernels again."""
    from voltllm.kernels import gdn_chunk
    from voltllm.model.layers import gdn as gdn_layer
    from voltllm.model.layers.gdn import HybridBatch

    calls = []

    def do_not_fit(*args, **kwargs):
        calls.append(1)
        raise gdn_chunk.ChunkKernelsDoNotFit("Gated DeltaNet chunk kernels: no tile fits the shared memory of cpu")

    monkeypatch.setattr(gdn_chunk, "gated_delta_rule_chunked", do_not_fit)
    monkeypatch.setattr(gdn_layer, "_CHUNK_UNFIT_DEVICES", set())
    layer = _tiny_gdn_layer()
    outs = {}
    for flag in (False, True):
        layer.triton_prefill = flag
        cache = StateCache(1, 3, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, "cpu")
        x = torch.randn(70, 32, generator=torch.Generator().manual_seed(6))
        ys = []
        for rows, qsl, init in ((x[:50], [0, 30, 50], [False, False]), (x[50:], [0, 12, 20], [True, True])):
            batch = HybridBatch(state_cache=cache, slots=torch.tensor([2, 0]), has_initial_state=torch.tensor(init),
                                query_start_loc=qsl, decode_only=False)
            ys.append(layer(rows, batch))
        outs[flag] = (torch.cat(ys), cache.ssm[0].clone(), cache.conv[0].clone())
    assert len(calls) == 1  # the second step went straight to the torch form
    assert gdn_layer._CHUNK_UNFIT_DEVICES == {torch.device("cpu")}
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_memory_sizing_counts_the_chunk_workspaces_a_step_can_add():
    """A step of max_num_seqs requests has up to that many chunks more than the profiled single-sequence forward:
    the KV budget sets aside their workspaces (T, the decayed Q K^T, Wk, Wv: fp32), for the widest GDN layer; a
    model without GDN layers sets aside nothing. Checked against a real call's allocations."""
    from torch import nn

    from voltllm.kernels import gdn_chunk
    from voltllm.worker.memory import chunk_workspace_slack_bytes

    model = nn.ModuleList([_tiny_gdn_layer(), nn.Linear(4, 4)])  # 4 value heads, dims 16
    want = 64 * 4 * 64 * (64 + 64 + 16 + 16) * 4  # 64 chunks x 4 heads x (T + Q K^T + Wk + Wv) rows x fp32
    assert chunk_workspace_slack_bytes(model, 64) == want
    assert chunk_workspace_slack_bytes(nn.Sequential(nn.Linear(4, 4)), 64) == 0
    # the bound is what _launch allocates (kernels replaced by no-ops, the fp32 workspaces counted)
    made = []
    real_empty = torch.empty

    def counting_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        made.append(t.numel() * t.element_size())
        return t

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    q, k, v, g, beta, _ = _inputs(3 * 64, hk=2, hv=4, dk=16, dv=16)
    meta = gdn_chunk.chunk_meta([0, 3 * 64], torch.tensor([False]))
    tile = gdn_chunk.TILES["ieee"][0]
    assert tile.hoist
    with pytest.MonkeyPatch.context() as mp:
        for name in ("_gdn_chunk_prep_kernel", "_gdn_chunk_hoist_kernel", "_gdn_chunk_fwd_kernel"):
            mp.setattr(gdn_chunk, name, NoLaunch())
        mp.setattr(torch, "empty", counting_empty)
        mp.setattr(torch, "empty_like", lambda t: counting_empty(*t.shape, dtype=t.dtype))
        gdn_chunk._launch("ieee", tile, None, q, k, v, g, beta, torch.zeros(1, 4, 16, 16), torch.tensor([0]),
                          meta, torch.zeros_like(v), None, True, 1)
    assert sum(made) == gdn_chunk.workspace_bytes(3, 4, 16, 16)
