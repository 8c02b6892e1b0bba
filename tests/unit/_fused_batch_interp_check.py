"""Run under TRITON_INTERPRET=1 (see test_fused_decode_interp.py): the decode-batch layer stack with the RMSNorms and
residual adds folded into the batch GEMMs (LlamaForCausalLM.fused_batch) computes the unfused stack's hidden
states, on tiny fp16 qwen2 (qkv bias) and qwen3 (QK-norm) models on the CPU at 16 and 33 rows, with the batch GEMM
forced on every projection (pointer and split-K tiles), gate_up plain and gated. The attention is replaced by a
slice of q, as the start-up timing does (voltllm.worker.norm_fusion_tuning); the engine-level check with real
attention is on the GPU (tests/gpu/test_gemv_cuda.py). Prints "ok fused batch"."""
import sys
import tempfile
import types

import torch

from interp_util import patch_interpreter_index

patch_interpreter_index()
from tiny_models import make_model  # noqa: E402

import voltllm.model.models.llama as llama  # noqa: E402
from voltllm import LLM  # noqa: E402
from voltllm.worker.norm_fusion_tuning import _attention_stand_in  # noqa: E402

calls = {"norm_linear": 0}
_norm_linear = llama.norm_linear


def counting_norm_linear(*args, **kwargs):
    calls["norm_linear"] += 1
    return _norm_linear(*args, **kwargs)


llama.norm_linear = counting_norm_linear
for kind in ("qwen2", "qwen3"):
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(make_model(d, kind, num_hidden_layers=2), device="cpu", dtype="float16", enforce_eager=True,
                  max_model_len=64)
        model = llm.engine.runner.model
        for layer in model.layers:
            layer.self_attn.attend = types.MethodType(_attention_stand_in, layer.self_attn)
        for rows, cfg, gated in ((16, (32, 64, 4, 1, 1), False), (33, (16, 32, 4, 1, 2), False),
                                 (16, (16, 64, 4, 1, 1), True)):
            for layer in model.layers:
                for p in layer.projections():
                    p.batch_gemm[rows] = cfg if not (gated and p is layer.mlp.gate_up_proj) else (16, 64, 4, 1, 1)
                layer.mlp.gate_up_proj.batch_gated[rows] = gated
            ids = torch.randint(0, model.config.vocab_size, (rows,))
            with torch.inference_mode():
                plain = model(ids, ids, None).float()
                model.fused_batch = lambda ids_: True  # the CPU run takes the CUDA-only path
                before = calls["norm_linear"]
                fused = model(ids, ids, None).float()
                del model.fused_batch
            ran = calls["norm_linear"] - before
            err = ((fused - plain).norm() / plain.norm()).item()
            if err > 5e-3 or ran != 2 * len(model.layers) - 1:
                print(f"FAIL {kind} rows={rows} cfg={cfg} gated={gated}: relative error {err:.2e}, "
                      f"{ran} folded norm GEMMs")
                sys.exit(1)
            print(f"ok {kind} rows={rows} gated={gated}: relative error {err:.1e}")
print("ok fused batch")
