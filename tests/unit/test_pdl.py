"""Programmatic dependent launch (voltllm/kernels/pdl.py): the decode kernels compiled for sm_90 with PDL on
carry griddepcontrol.wait before their first global access and let their successor launch (paged decode
attention reads the step's inputs, sequence lengths and block tables, before it: no kernel writes them; the GDN
decode kernels their slots, flags and recurrent state, but store nothing before it); with PDL
off (the registry's specs, which the sm_70/75 gate compiles) they carry none; the CPU engine leaves it off."""
import pytest

from voltllm.kernels.registry import REGISTRY

DECODE_KERNELS = ("gemv.skinny", "gemm.decode_batch", "gemm.decode_batch_tma", "fused.rms_norm",
                  "fused.qk_norm_rope", "fused.silu_and_mul", "fused.sigmoid_gate_mul", "attention.paged_decode",
                  "attention.paged_decode_reduce", "moe.route_topk", "moe.small_gate_up", "moe.small_down",
                  "gdn.decode_delta_rule", "gdn.decode_conv1d")

# (these read what no kernel of the step writes before their wait: the step's inputs; the GDN decode also its
# recurrent state, which only it writes, a step earlier)
READ_INPUTS_BEFORE_WAIT = ("attention.paged_decode", "gdn.decode_delta_rule", "gdn.decode_conv1d")


def _ptx(fn, spec, pdl_on, **constexprs):
    """The sm_90 PTX (no ptxas run: only the PTX is read)."""
    from voltllm.check.sm70_gate import compile_for
    from voltllm.kernels.registry import CompileSpec

    spec = CompileSpec(spec.signature, {**spec.constexprs, "PDL": pdl_on, **constexprs})
    return compile_for(fn, spec, 90, {"launch_pdl": True} if pdl_on else None, assemble=False)[1]


@pytest.mark.parametrize("name", DECODE_KERNELS)
def test_decode_kernels_wait_then_release(name):
    import voltllm.kernels.attention  # noqa: F401  (registers)
    import voltllm.kernels.batch_gemm  # noqa: F401
    import voltllm.kernels.fused  # noqa: F401
    import voltllm.kernels.gdn_decode  # noqa: F401
    import voltllm.kernels.gemv  # noqa: F401
    import voltllm.kernels.moe_decode  # noqa: F401
    entry = REGISTRY[name]
    spec = entry.specs[0]
    assert spec.constexprs["PDL"] is False
    on = _ptx(entry.fn, spec, True)
    body = on[on.index("griddepcontrol.wait"):]
    assert "griddepcontrol.launch_dependents" in body
    loads = ("st.global", "cp.async.bulk") if name in READ_INPUTS_BEFORE_WAIT else ("ld.global", "st.global",
                                                                                    "cp.async.bulk")
    first_global = min(i for i in (on.find(op) for op in loads) if i >= 0)
    assert on.index("griddepcontrol.wait") < first_global
    assert "griddepcontrol" not in _ptx(entry.fn, spec, False)


def test_decode_attention_prefetches_kv_before_waiting():
    import voltllm.kernels.attention  # noqa: F401  (registers)
    entry = REGISTRY["attention.paged_decode"]
    for spec in entry.specs[:2]:  # the FMA and the tl.dot route
        assert spec.constexprs["PREFETCH_N"] == 0
        on = _ptx(entry.fn, spec, True, PREFETCH_N=128)
        wait = on.index("griddepcontrol.wait")
        assert 0 <= on.find("prefetch.global.L2") < wait and "prefetch" not in on[wait:]
        assert "prefetch" not in _ptx(entry.fn, spec, True)  # PREFETCH_N 0


@pytest.mark.parametrize("name", ("gemv.skinny", "gemm.decode_batch", "gemm.decode_batch_tma"))
def test_gemms_prefetch_weights_before_waiting(name):
    import voltllm.kernels.batch_gemm  # noqa: F401  (registers)
    import voltllm.kernels.gemv  # noqa: F401
    entry = REGISTRY[name]
    spec = entry.specs[0]
    assert spec.constexprs["PREFETCH_K"] == 0
    on = _ptx(entry.fn, spec, True, PREFETCH_K=1024)
    wait = on.index("griddepcontrol.wait")
    assert 0 <= on.find("prefetch.global.L2") < wait
    assert "prefetch" not in on[wait:]
    assert "prefetch" not in _ptx(entry.fn, spec, False)


def test_prefetch_only_small_weights_with_pdl():
    from voltllm.kernels import pdl
    try:
        pdl.configure(True)
        assert pdl.prefetch_elements(3072, 576, 2) == 1024  # SmolLM2 gate_up: whole rows
        assert pdl.prefetch_elements(16, 40, 2) == 64
        assert pdl.prefetch_elements(4096, 4096, 2) == 0  # 8B o_proj: bandwidth-bound, none
        assert pdl.gemm_launch_options(256) == {"PDL": True, "launch_pdl": True, "PREFETCH_K": 256}
        with pytest.raises(ValueError, match="power of two"):
            pdl.gemm_launch_options(192)
    finally:
        pdl.configure(False)
    assert pdl.prefetch_elements(3072, 576, 2) == 0
    assert pdl.gemm_launch_options(1024) == {"PDL": False, "PREFETCH_K": 0}


def test_cpu_engine_leaves_pdl_off(tmp_path):
    from tiny_models import make_model
    from voltllm import LLM, SamplingParams
    from voltllm.kernels import pdl

    llm = LLM(make_model(str(tmp_path), "llama"), device="cpu")
    assert not pdl.enabled() and pdl.launch_options() == {"PDL": False}
    try:  # another engine in the process switched it on: this one's steps set it back to its own setting
        pdl.configure(True)
        llm.generate("hello", SamplingParams(max_tokens=2))
        assert not pdl.enabled()
    finally:
        pdl.configure(False)


def test_tuner_rule_credits_triton_with_pdl_overlap():
    from voltllm.kernels import pdl
    from voltllm.worker.skinny_tuning import PDL_OVERLAP_MS, _triton_wins

    assert _triton_wins(0.0960, 0.1) and not _triton_wins(0.0980, 0.1)  # no PDL: 3% faster alone
    try:
        pdl.configure(True)
        assert _triton_wins(0.1 + PDL_OVERLAP_MS * 0.9, 0.1) and not _triton_wins(0.1 + PDL_OVERLAP_MS * 1.1, 0.1)
    finally:
        pdl.configure(False)
    try:
        pdl.configure(True)
        assert not _triton_wins(0.1 + PDL_OVERLAP_MS * 0.9, 0.1, credit_pdl=False)  # decode-batch GEMM
    finally:
        pdl.configure(False)
