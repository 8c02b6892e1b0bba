"""Run under TRITON_INTERPRET=1 (see test_fused_decode_interp.py): the one-row decode path that folds the
RMSNorms and residual adds into the skinny GEMMs (LlamaForCausalLM.fused_decode) generates the same greedy
tokens as the unfused path, on tiny qwen2 (qkv bias, tied embeddings) and qwen3 (QK-norm) models in fp32 on the
CPU, with the skinny GEMM forced on every projection, and again with gate_up's SiLU*mul in its epilogue (fused and
unfused layers); and it really ran. Arguments: the model kinds to check (default both)."""
import sys
import tempfile

from interp_util import patch_interpreter_index

patch_interpreter_index()
from tiny_models import make_model  # noqa: E402

import voltllm.model.models.llama as llama  # noqa: E402
from voltllm import LLM, SamplingParams  # noqa: E402

calls = {"norm_linear": 0}
_norm_linear = llama.norm_linear


def counting_norm_linear(*args, **kwargs):
    calls["norm_linear"] += 1
    return _norm_linear(*args, **kwargs)


llama.norm_linear = counting_norm_linear
import voltllm.kernels.gemv as gemv_mod  # noqa: E402

calls["gated"] = 0
_gemv = gemv_mod.gemv


def counting_gemv(*args, **kwargs):
    calls["gated"] += bool(kwargs.get("gated"))
    return _gemv(*args, **kwargs)


gemv_mod.gemv = counting_gemv
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
for kind in sys.argv[1:] or ("qwen2", "qwen3"):
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(make_model(d, kind, num_hidden_layers=2, tie_word_embeddings=kind == "qwen2"), device="cpu", dtype="float32", enforce_eager=True)
        model = llm.engine.runner.model
        for layer in model.layers:
            for p in layer.projections():
                p.skinny = (16, 64, 4, 1)
        prompts = ["hello world, this is", "a b c"]
        plain = [o.outputs[0].token_ids for o in (llm.generate(p, params)[0] for p in prompts)]
        before = calls["norm_linear"]
        model.fused_decode = lambda ids: ids.numel() == 1  # the CPU run takes the CUDA-only path
        fused = [o.outputs[0].token_ids for o in (llm.generate(p, params)[0] for p in prompts)]
        ran = calls["norm_linear"] - before
        layers = len(model.layers)
        if plain != fused or ran < 2 * layers * 5 * len(prompts):
            print(f"FAIL {kind}: plain {plain} fused {fused} fused norm_linear calls {ran}")
            sys.exit(1)
        # gate_up with the SiLU*mul in its epilogue (skinny_gated), in the fused layer and in the unfused MLP
        calls["gated"] = 0
        for layer in model.layers:
            layer.mlp.gate_up_proj.skinny_gated = True
        gated_fused = [o.outputs[0].token_ids for o in (llm.generate(p, params)[0] for p in prompts)]
        model.fused_decode = lambda ids: False
        gated_plain = [o.outputs[0].token_ids for o in (llm.generate(p, params)[0] for p in prompts)]
        if gated_fused != plain or gated_plain != plain or calls["gated"] < 2 * layers * 5 * len(prompts):
            print(f"FAIL {kind} gated: plain {plain} gated fused {gated_fused} gated unfused {gated_plain} "
                  f"gated GEMVs {calls['gated']}")
            sys.exit(1)
        print(f"ok {kind} ({ran} fused norm GEMVs; {calls['gated']} gated gate_up GEMVs)")
print("ok fused decode")
