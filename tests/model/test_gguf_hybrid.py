"""GGUF files of the hybrid Qwen models (architectures qwen35, qwen35moe, qwen3next), written from tiny HF checkpoints
the way llama.cpp's convert_hf_to_gguf.py writes them (tests/gguf_files.write_hybrid_gguf: F16 and Q8_0 files with
the tokenizer in their metadata), read back by voltllm/model/loader/gguf_loader.py + gguf_hybrid.py.

The checkpoints have 2 key and 4 value heads in their Gated DeltaNet layers, so Qwen3.5's value-head tiling moves
rows and columns; their matrices are rounded so F16 and Q8_0 hold them exactly (gguf_files.q8_exact_weights), so the
files' weights are the checkpoint's: the loader must give the HF state dict tensor for tensor (A_log to an ulp: it is
stored as -exp(A_log); norm weights as 1 + w: the model's 1 + w is exact), and the engine the HF checkpoint's prompt
logprobs and greedy tokens. Each of the loader's steps is needed: switched off one at a time, the weights differ.
transformers' own GGUF reader (qwen35 / qwen35moe; it has none for qwen3next) reads the same weights from these files,
so the writer is checked against an independent reading of llama.cpp's layout too."""
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import KIND_ARCH as ARCH, exact_hybrid_checkpoint, write_hybrid_gguf  # noqa: E402
from tiny_models import assert_prompt_logprobs_match, full_prompt_logprobs  # noqa: E402

from voltllm.model.loader import gguf_hybrid  # noqa: E402
from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights  # noqa: E402

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? The capital of France is",
           "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module", params=KINDS)
def files(request, tmp_path_factory):
    """kind, the HF checkpoint's directory, {outtype: GGUF path}."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = exact_hybrid_checkpoint(str(root / "hf"), kind)
    if hf is None:
        pytest.skip(f"this transformers has no {kind}")
    paths = {}
    for outtype in ("F16", "Q8_0"):
        paths[outtype] = str(root / f"tiny-{outtype}.gguf")
        write_hybrid_gguf(paths[outtype], hf, outtype)
    return kind, hf, paths


def _state(hf: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(hf, "model.safetensors"))


def _mismatches(ours: dict, ref: dict) -> list:
    """The names whose loaded tensor is not the checkpoint's (norm weights: the model's 1 + w; A_log: to an ulp)."""
    bad = sorted(set(ours) ^ set(ref))
    for name in set(ours) & set(ref):
        a, b = ours[name], ref[name]
        if a.dtype != torch.float32 or a.shape != b.shape:
            bad.append(name)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            if not torch.equal(1 + a, 1 + b) or not torch.allclose(a, b, rtol=0, atol=1e-7):
                bad.append(name)
        elif not (torch.allclose(a, b, rtol=1e-6, atol=0) if name.endswith("A_log") else torch.equal(a, b)):
            bad.append(name)
    return bad


def test_config(files):
    from transformers import AutoConfig

    from voltllm.model.models.registry import build_model

    kind, hf, paths = files
    ref, ours = AutoConfig.from_pretrained(hf), gguf_config(paths["Q8_0"])
    assert type(ours) is type(ref) and ours.architectures == ref.architectures
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                  "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "intermediate_size", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(ours, field, None) == getattr(ref, field, None), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    for field in ("rope_theta", "partial_rotary_factor"):
        assert ours.rope_parameters[field] == pytest.approx(ref.rope_parameters[field], rel=1e-6), field
    if kind != "qwen3_next":  # the converter's default MRoPE sections (plain RoPE at text positions)
        assert ours.rope_parameters["mrope_section"] == [11, 11, 10] and ours.rope_parameters["mrope_interleaved"]
    if kind == "qwen3_next":
        assert ours.norm_topk_prob and ours.mlp_only_layers == [] and ours.decoder_sparse_step == 1
    assert type(build_model(ours, torch.float32, 64)).__name__ == ref.architectures[0]


@pytest.mark.parametrize("outtype", ["F16", "Q8_0"])
def test_weights_are_the_checkpoints(files, outtype):
    kind, hf, paths = files
    ours = dict(gguf_weights(paths[outtype], gguf_config(paths[outtype])))
    assert _mismatches(ours, _state(hf)) == []
    if kind == "qwen3_next":  # attn_qkv + attn_gate regrouped per key head
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in ours


STEPS = ["_unoffset_norm", "_a_log", "_unsqueeze_conv", "_untile", "_regroup_qkvz"]


@pytest.mark.parametrize("step", STEPS)
def test_every_step_is_needed(files, step, monkeypatch):
    """Each of the loader's undo steps, skipped, leaves weights that are not the checkpoint's."""
    kind, hf, paths = files
    applies = {"_untile": kind != "qwen3_next", "_regroup_qkvz": kind == "qwen3_next"}
    if not applies.get(step, True):
        pytest.skip(f"{step} does nothing to {kind} files")
    if step == "_regroup_qkvz":
        def skip(self, name, tensor):
            yield name, tensor
    else:
        def skip(self, name, tensor):
            return tensor
    monkeypatch.setattr(gguf_hybrid.HybridTensors, step, skip)
    ours = dict(gguf_weights(paths["F16"], gguf_config(paths["F16"])))
    assert _mismatches(ours, _state(hf)) != []


def test_engine_matches_the_checkpoint(files, monkeypatch, tmp_path):
    """The Q8_0 file with its own tokenizer against the HF directory (fp32, CPU, 4-token blocks: chunked paged KV):
    the same token ids, prompt logprobs over the whole vocabulary and greedy tokens; and transformers' logits."""
    from transformers import AutoModelForCausalLM

    from voltllm import LLM, SamplingParams

    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path))  # (the converted GGUF tokenizer's cache)
    kind, hf, paths = files
    kw = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256)
    ours, ref = LLM(paths["Q8_0"], **kw), LLM(hf, **kw)
    for prompt in PROMPTS:
        assert ours.get_tokenizer().encode(prompt) == ref.get_tokenizer().encode(prompt)
    a, b = full_prompt_logprobs(ours, PROMPTS), full_prompt_logprobs(ref, PROMPTS)
    assert not a.isnan().any() and torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in ours.generate(PROMPTS, sp)]
            == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert_prompt_logprobs_match(ours, model, PROMPTS)


def test_transformers_reads_the_same_weights(files):
    """transformers' GGUF reader (its own undoing of llama.cpp's layout) gets the checkpoint from these files."""
    from transformers import AutoModelForCausalLM

    kind, hf, paths = files
    if kind == "qwen3_next":
        pytest.skip("transformers reads no qwen3next GGUF")
    pytest.importorskip("accelerate")
    path = paths["Q8_0"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    ref, theirs = _state(hf), model.state_dict()
    for name, t in theirs.items():
        if ".mlp.experts." in name:  # transformers' stacked experts: [E, 2I, H] gate then up, [E, H, I] down
            prefix, proj = name.rsplit(".", 1)
            projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            want = torch.stack([torch.cat([ref[f"{prefix}.{e}.{p}.weight"] for p in projs]) for e in range(len(t))])
        else:
            want = ref[name]
        assert torch.allclose(t, want, rtol=1e-6, atol=1e-7), name


def test_file_is_laid_out_as_llama_cpp_writes_it(files):
    """What the writer put in the file, read raw: the metadata llama.cpp reads, norms stored 1 + w (not the GDN's),
    ssm_a = -exp(A_log), the squeezed conv kernel, value heads tiled (Qwen3.5) / qkvz split (Qwen3-Next)."""
    kind, hf, paths = files
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf)
    arch, ref = ARCH[kind], _state(hf)
    reader = gguf.GGUFReader(paths["F16"])
    meta = {k: f.contents() for k, f in reader.fields.items()}
    t = {x.name: torch.from_numpy(np.array(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float32))
         .reshape(tuple(int(d) for d in reversed(x.shape.tolist()))) for x in reader.tensors}
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    assert meta["general.architecture"] == arch and meta[f"{arch}.block_count"] == c.num_hidden_layers
    assert (meta[f"{arch}.ssm.conv_kernel"], meta[f"{arch}.ssm.state_size"], meta[f"{arch}.ssm.group_count"],
            meta[f"{arch}.ssm.time_step_rank"], meta[f"{arch}.ssm.inner_size"]) == (4, dk, nk, nv, nv * dv)
    assert meta[f"{arch}.full_attention_interval"] == 4 and meta[f"{arch}.rope.dimension_count"] == c.head_dim // 4
    assert meta[f"{arch}.attention.key_length"] == c.head_dim
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == c.vocab_size
    if kind != "qwen3_5":
        assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (4, 2)
        assert meta[f"{arch}.expert_shared_feed_forward_length"] == c.shared_expert_intermediate_size
    p = "model.layers.0."
    assert torch.equal(t["blk.0.attn_norm.weight"], ref[p + "input_layernorm.weight"] + 1)
    assert torch.equal(t["blk.3.attn_q_norm.weight"], ref["model.layers.3.self_attn.q_norm.weight"] + 1)
    # value head h = g * r + j of the checkpoint at file position j * nk + g for Qwen3.5, in place for Qwen3-Next
    r = nv // nk
    pos = [(h % r) * nk + h // r if kind != "qwen3_next" else h for h in range(nv)]
    a_log = ref[p + "linear_attn.A_log"]
    assert all(t["blk.0.ssm_a"][pos[h]] == -torch.exp(a_log[h]) for h in range(nv))
    assert all(t["blk.0.ssm_dt.bias"][pos[h]] == ref[p + "linear_attn.dt_bias"][h] for h in range(nv))
    assert torch.equal(t["blk.0.ssm_norm.weight"], ref[p + "linear_attn.norm.weight"])  # no offset
    conv = t["blk.0.ssm_conv1d.weight"]
    assert conv.shape == (2 * nk * dk + nv * dv, 4)
    out = t["blk.0.ssm_out.weight"]
    if kind != "qwen3_next":
        qkv, w_qkv, w_z = t["blk.0.attn_qkv.weight"], ref[p + "linear_attn.in_proj_qkv.weight"], ref[
            p + "linear_attn.in_proj_z.weight"]
        assert torch.equal(qkv[:2 * nk * dk], w_qkv[:2 * nk * dk])
        v0 = 2 * nk * dk
        for h in range(nv):
            rows, src = slice(v0 + pos[h] * dv, v0 + (pos[h] + 1) * dv), slice(v0 + h * dv, v0 + (h + 1) * dv)
            assert torch.equal(qkv[rows], w_qkv[src]) and torch.equal(conv[rows], ref[p + "linear_attn.conv1d.weight"][
                src, 0])
            assert torch.equal(t["blk.0.attn_gate.weight"][pos[h] * dv:(pos[h] + 1) * dv], w_z[h * dv:(h + 1) * dv])
            assert torch.equal(out[:, pos[h] * dv:(pos[h] + 1) * dv],
                               ref[p + "linear_attn.out_proj.weight"][:, h * dv:(h + 1) * dv])
            assert torch.equal(t["blk.0.ssm_alpha.weight"][pos[h]], ref[p + "linear_attn.in_proj_a.weight"][h])
    else:  # in_proj_qkvz [q_g k_g v_g z_g] per key head g -> attn_qkv [q | k | v] (all heads each), attn_gate z
        qkvz = ref[p + "linear_attn.in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
        want = torch.cat([q.reshape(nk * dk, -1), k.reshape(nk * dk, -1), v.reshape(nv * dv, -1)])
        assert torch.equal(t["blk.0.attn_qkv.weight"], want)
        assert torch.equal(t["blk.0.attn_gate.weight"], z.reshape(nv * dv, -1))
        assert torch.equal(t["blk.0.ssm_ba.weight"], ref[p + "linear_attn.in_proj_ba.weight"])  # stored as it is
        assert torch.equal(out, ref[p + "linear_attn.out_proj.weight"])
    if kind != "qwen3_5":  # experts stacked [E, rows, cols]; router and shared gate F32
        assert torch.equal(t["blk.0.ffn_down_exps.weight"][1], ref[p + "mlp.experts.1.down_proj.weight"])
        types = {x.name: x.tensor_type.name for x in reader.tensors}
        assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_gate_inp_shexp.weight"] == "F32"


def test_mtp_blocks_are_skipped(tmp_path):
    """A Qwen3.5 file with its MTP module written as a nextn block after the decoder: the decoder's config and
    weights, the extra block left out."""
    hf = exact_hybrid_checkpoint(str(tmp_path / "hf"), "qwen3_5")
    if hf is None:
        pytest.skip("this transformers has no qwen3_5")
    path = str(tmp_path / "mtp.gguf")
    written = write_hybrid_gguf(path, hf, "F16", mtp_layers=1)
    assert "blk.4.nextn.eh_proj.weight" in written and "blk.4.attn_q.weight" in written
    assert gguf.GGUFReader(path).fields["qwen35.block_count"].contents() == 5
    cfg = gguf_config(path)
    assert cfg.num_hidden_layers == 4 and len(cfg.layer_types) == 4
    assert _mismatches(dict(gguf_weights(path, cfg)), _state(hf)) == []


def test_fused_gate_up_experts(tmp_path):
    """--fuse-gate-up-exps files: one ffn_gate_up_exps tensor per layer (gate's rows, then up's)."""
    hf = exact_hybrid_checkpoint(str(tmp_path / "hf"), "qwen3_5_moe")
    if hf is None:
        pytest.skip("this transformers has no qwen3_5_moe")
    path = str(tmp_path / "fused.gguf")
    assert "blk.0.ffn_gate_up_exps.weight" in write_hybrid_gguf(path, hf, "Q8_0", fuse_gate_up=True)
    assert _mismatches(dict(gguf_weights(path, gguf_config(path))), _state(hf)) == []


@pytest.mark.parametrize("kind,value_head_dim", [("qwen3_5", 16), ("qwen3_5", 32), ("qwen3_5_moe", 32),
                                                 ("qwen3_next", 32)])
def test_kept_quantized(tmp_path, kind, value_head_dim):
    """keep_quantized (the GPU's path, run here on the CPU): the Q8_0 projections come as raw blocks, value heads
    untiled by whole rows (and out_proj's columns by whole 32-input blocks when a head is whole blocks; dequantized
    when it is not: value_head_dim 16), the routed experts as MoE planes; every projection and MoE block multiplies as
    the dequantized model's."""
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.moe import SparseMoE
    from voltllm.model.layers.quantized_linear import GGUFBlocks, QuantizedLinearMethod
    from voltllm.model.models.registry import build_model

    moe = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64) if kind != "qwen3_5" else {}
    hf = exact_hybrid_checkpoint(str(tmp_path / "hf"), kind, linear_value_head_dim=value_head_dim, **moe)
    if hf is None:
        pytest.skip(f"this transformers has no {kind}")
    path = str(tmp_path / "q8.gguf")
    write_hybrid_gguf(path, hf, "Q8_0")
    cfg = gguf_config(path)
    raw = dict(gguf_weights(path, cfg, keep_quantized=True))
    p = "model.layers.0.linear_attn."
    split = ("in_proj_qkv", "in_proj_z") + (("in_proj_ba",) if kind == "qwen3_next" else ("in_proj_a", "in_proj_b"))
    assert all(isinstance(raw[f"{p}{n}.weight"], GGUFBlocks) for n in split)  # (qwen3next: not regrouped)
    assert isinstance(raw[p + "out_proj.weight"], GGUFBlocks) == (value_head_dim == 32)
    kept = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    kept.load_weights(raw.items())
    dense = build_model(cfg, torch.float32, 64)
    dense.load_weights(gguf_weights(path, cfg))
    gen = torch.Generator().manual_seed(0)
    gdn = kept.layers[0].linear_attn
    assert [type(s.weight) for s in gdn.in_proj.gguf_segments] == [Planes]
    assert isinstance(gdn.out_proj.gguf_segments[0].weight, Planes) == (value_head_dim == 32)
    for name, mod in kept.named_modules():
        if isinstance(mod, Linear) and mod.weight is None or isinstance(mod, SparseMoE):
            width = mod.in_features if isinstance(mod, Linear) else cfg.hidden_size
            x = torch.randn(5, width, generator=gen)
            torch.testing.assert_close(mod(x), dense.get_submodule(name)(x), rtol=1e-5, atol=1e-5)
    if kind != "qwen3_5":
        assert kept.layers[0].mlp.qexperts is not None
