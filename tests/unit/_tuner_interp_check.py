"""Run under TRITON_INTERPRET=1 (see test_tuner_interp.py): the decode-batch tuner end to end on a tiny MLP with real
Triton kernels (interpreted) and faked timings. The tuner normally runs only on CUDA weights and times CUDA-graph
replays; here `_unquantized_groups` takes CPU weights and `graph_replay_ms` runs the call once and returns 0.5 ms
when it launched the decode-batch GEMM, 1.0 ms when it did not (cuBLAS side), so Triton always wins and the first
working candidate is chosen. Prints "ok tuner" when every check holds."""
import torch

from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels import batch_gemm as B  # noqa: E402
from voltllm.model.layers.linear import Linear, down_proj_silu_mul, gated_mlp  # noqa: E402
from voltllm.worker import skinny_tuning as T  # noqa: E402


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [inter, inter], dtype=torch.float16)
        self.down_proj = Linear(inter, hidden, dtype=torch.float16)
        self.gate_up_proj.silu_mul_output = True
        self.down_proj.silu_mul_input = True


def _groups(model):
    groups = {}
    for mod in model.modules():
        if isinstance(mod, Linear):
            groups.setdefault((*mod.weight.shape, mod.silu_mul_input), []).append(mod)
    return groups


launches, tried = [], set()
real_gemm = B.batch_gemm


def counted_gemm(*args, **kwargs):
    launches.append(kwargs.get("silu_mul", False))
    tried.add(kwargs.get("config"))
    return real_gemm(*args, **kwargs)


def fake_replay_ms(fn, weights):
    before = len(launches)
    fn(weights[0])
    return 0.5 if len(launches) > before else 1.0


torch.manual_seed(0)
model = torch.nn.Sequential(_MLP(64, 96))
for p in model.parameters():
    p.data.normal_(0, 0.05)
T._unquantized_groups, T.graph_replay_ms, T._rotation = _groups, fake_replay_ms, lambda ws: ws
B.batch_gemm = counted_gemm
rows = [2, 64]
decisions = T.tune_batch_gemm(model, [1] + rows + [128])
mlp = model[0]
gu, down = mlp.gate_up_proj, mlp.down_proj
small = {c for c in B.SMALL_WEIGHT_CONFIGS if len(c) == 5}  # the CPU has no TMA
assert set(decisions) == {(192, 64, r) for r in rows} | {(64, 96, r, "silu_mul") for r in rows}, decisions
assert tried == small and all(decisions[k] in small for k in decisions), (tried, decisions)  # the short list only
assert launches and not any(launches), "the down projection's prologue form was timed"
# only the timed row counts get a choice (eager batches between them keep cuBLAS: skinny_tuning.tune_batch_gemm)
assert down.batch_silu_fused == {r: False for r in rows} and set(down.batch_gemm) == set(rows)
assert set(gu.batch_gemm) == set(rows)
n_before = len(launches)
for r in rows + [33, 17]:  # 33 / 17: no choice, cuBLAS path
    x = torch.randn(r, 64, dtype=torch.float16)
    act = torch.nn.functional.silu(x.float() @ gu.weight[:96].float().t()) * (x.float() @ gu.weight[96:].float().t())
    ref = act @ down.weight.float().t()
    got = gated_mlp(gu, down, x).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2, r
    g = torch.randn(r, 192, dtype=torch.float16)
    ref = (torch.nn.functional.silu(g[:, :96].float()) * g[:, 96:].float()) @ down.weight.float().t()
    assert ((down_proj_silu_mul(down, g).float() - ref).norm() / ref.norm()).item() < 1e-2, r
assert len(launches) - n_before == 2 * 3, launches  # 2 and 64 rows: the MLP's two GEMMs + down_proj_silu_mul


# the LM head's argmax epilogue (head_argmax: the target model): timed against the head as chosen + the argmax kernel;
# faked as faster here, so it is chosen at every timed row count, and greedy_tokens then gives the logits' argmax
class _Head(torch.nn.Module):
    tp = None
    logits_batch = logits_argmax = None

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Parameter(torch.randn(300, 64, dtype=torch.float16) * 0.2, requires_grad=False)

    @property
    def logits_weight(self):
        return self.head

    def greedy_tokens(self, hidden):  # (LlamaForCausalLM's, without its CUDA-only guard)
        return B.batch_gemm(hidden, self.head, config=self.logits_argmax[hidden.shape[0]],
                            argmax_out=torch.empty(hidden.shape[0], dtype=torch.long))


def fake_replay_argmax_ms(fn, weights):
    before = len(launches)
    fn(weights[0])
    new = launches[before:]
    return 0.25 if "argmax" in new else 0.5 if new else 1.0


def counted_gemm_argmax(*args, **kwargs):
    if kwargs.get("argmax_out") is not None:
        launches.append("argmax")
    return counted_gemm(*args, **kwargs)


head = _Head()
T._groups_with_logits = lambda m: {(300, 64, False): [m]} if m is head else {}
T.graph_replay_ms, B.batch_gemm = fake_replay_argmax_ms, counted_gemm_argmax
T.tune_batch_gemm(head, [16, 64])
assert head.logits_argmax is None or head.logits_argmax == {}, "timed without head_argmax"
T.tune_batch_gemm(head, [16, 64], head_argmax=True)
assert set(head.logits_argmax) == {16, 64} and set(head.logits_batch) == {16, 64}, head.logits_argmax
for r in (16, 64):
    h = torch.randn(r, 64, dtype=torch.float16)
    want = B.batch_gemm(h, head.head, config=head.logits_argmax[r]).argmax(dim=-1)
    assert torch.equal(head.greedy_tokens(h), want), r
print("ok tuner")
