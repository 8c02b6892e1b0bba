"""Run under TRITON_INTERPRET=1 (see test_norm_fold_interp.py): decode batches and short prompts through the
norm-folded layers (voltllm.model.norm_fold: the RMSNorms inside the decode-batch TMA GEMMs, the residual adds in
their epilogues) give the tokens and logprobs of the unfused layers, on tiny fp16 qwen2 (qkv bias) and qwen3
(QK-norm) models on the CPU, with the plan forced at every row count the batches take; the weight fold alone
(unfused layers on folded weights) too; and the folded layers really ran. Argument: the model kind."""
import sys
import tempfile

from interp_util import patch_interpreter_index

patch_interpreter_index()
from tiny_models import make_model  # noqa: E402

import voltllm.model.norm_fold as nf  # noqa: E402
from voltllm import LLM, SamplingParams  # noqa: E402

calls = {"folded": 0}
_add = nf.NormFoldStep.add_to_residual


def counting_add(self, *args, **kwargs):
    calls["folded"] += 1
    return _add(self, *args, **kwargs)


nf.NormFoldStep.add_to_residual = counting_add
_embed_first = nf.NormFoldStep.embed_first
calls["embed_first"] = 0


def counting_embed_first(self, *args, **kwargs):
    first = _embed_first(self, *args, **kwargs)
    calls["embed_first"] += first is not None
    return first


nf.NormFoldStep.embed_first = counting_embed_first
# the folded batch's first inputs in one kernel (kernels/embed_rows.py): bit for bit the unfused ops' values
import torch  # noqa: E402

from voltllm.kernels.embed_rows import embed_rows, embed_rows_ref  # noqa: E402

table = torch.randn(300, 96, dtype=torch.float16) * 4
table[7, :5] = torch.tensor([6e4, -6e4, 1e-7, 3e-5, 0.0])  # fp16's range edges: the scale makes some subnormal
ids = torch.tensor([7, 0, 299, 7, 150])
got, want = embed_rows(table, ids, torch.float32, 2.0 ** -4), embed_rows_ref(table, ids, torch.float32, 2.0 ** -4)
assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].dtype == torch.float32, "embed_rows"
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
prompts = ["hello world, this is", "a b c", "The quick brown fox jumps over the lazy dog"]
kind = sys.argv[1]


def run(llm):
    outs = llm.generate(prompts, params)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


with tempfile.TemporaryDirectory() as d:
    llm = LLM(make_model(d, kind, num_hidden_layers=2), device="cpu", dtype="float16", enforce_eager=True)
    model = llm.engine.runner.model
    assert nf.ineligible(model).startswith("weights not on a TMA GPU"), nf.ineligible(model)
    plain_tokens, plain_lps = run(llm)
    nf.fold_norm_weights(model)
    assert all(float(layer.input_layernorm.weight.float().sub(1).abs().max()) == 0 for layer in model.layers)
    fold_tokens, fold_lps = run(llm)  # folded weights, unfused layers
    plan = nf.NormFoldPlan(model, {r: dict(nf.FOLD_CONFIGS) for r in range(2, 65)})
    model.norm_fold = plan
    model.norm_fold_step = lambda ids: plan.step(ids.numel()) if ids.dim() == 1 else None  # (CUDA-only otherwise)
    folded_tokens, folded_lps = run(llm)
    worst = max(abs(a - b) for x, y in zip(plain_lps, folded_lps) for a, b in zip(x, y))
    worst_w = max(abs(a - b) for x, y in zip(plain_lps, fold_lps) for a, b in zip(x, y))
    layers = len(model.layers)
    ok = (plain_tokens == folded_tokens == fold_tokens and worst < 0.05 and worst_w < 0.05
          and calls["folded"] >= 2 * layers * 6 and calls["embed_first"] >= 5)
    print(f"{kind}: tokens {'equal' if plain_tokens == folded_tokens == fold_tokens else 'DIFFER'}, worst logprob "
          f"difference folded {worst:.4f}, weights folded only {worst_w:.4f}, folded residual adds {calls['folded']}, "
          f"first inputs in one kernel {calls['embed_first']}")
    if not ok:
        print(f"FAIL {kind}: plain {plain_tokens} folded {folded_tokens} weights folded {fold_tokens}")
        sys.exit(1)
print(f"ok norm fold {kind}")
