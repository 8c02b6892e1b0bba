"""voltllm.platform: what each device class can do (pure: no GPU needed)."""
from __future__ import annotations

import pytest
import torch

from voltllm.platform import auto_compat, capability_route, detect, platform_for, route_capability, torch_arch_error


@pytest.mark.parametrize("cap,route", [
    (None, "cpu"), ((6, 1), "unsupported"), ((7, 0), "sm70"), ((7, 2), "sm70"), ((7, 5), "sm75"),
    ((8, 0), "sm80"), ((8, 6), "sm80"), ((8, 9), "sm80"), ((9, 0), "sm90"), ((10, 0), "sm90"), ((12, 0), "sm90"),
])
def test_capability_route(cap, route):
    assert capability_route(cap) == route


def test_auto_compat_matches_config_rule():
    from voltllm.config import _resolve_compat

    assert auto_compat(None) == "none"
    for cap, want in (((6, 1), "none"), ((7, 0), "sm70"), ((7, 5), "sm75"), ((8, 0), "none"), ((9, 0), "none")):
        assert auto_compat(cap) == want
        assert _resolve_compat("auto", torch.device("cuda", 0), cap) == want
    assert _resolve_compat("auto", torch.device("cpu")) == auto_compat(None)


@pytest.mark.parametrize("cap", [(6, 0), (6, 1)])
def test_below_sm70_is_unsupported_not_the_sm75_route(cap):
    """A P100 / P40 is described as unsupported (the configuration refuses it), with no tensor-core claims."""
    p = platform_for(cap, name="Tesla P40")
    assert p.route == "unsupported" and p.hardware_route == "unsupported" and p.compat == "none"
    assert not (p.triton_tensor_cores or p.vendor_tensor_cores or p.native_bf16 or p.native_fp8)
    assert not any("tensor cores" in n for n in p.notes), p.notes
    assert any("below sm_70" in n and "--device cpu" in n for n in p.notes)
    forced = platform_for(cap, compat="sm75")  # --compat sm75 on it: still no "tl.dot uses its tensor cores"
    assert not any("tensor cores" in n for n in forced.notes), forced.notes


def test_route_capability_dispatches_as_the_compat_chip():
    """Kernel limits and tiles chosen by capability follow the route: --compat sm70 on an H200 takes the V100's
    quantized-GEMM row limits and tiles, so the H200 runs the V100's dispatch."""
    from voltllm.kernels.quant_dot import DOT_CONFIGS, dot_max_rows, dot_table, grouped_max_rows, moe_table

    assert route_capability(None, "none") is None
    assert route_capability((9, 0), "none") == (9, 0) and route_capability((8, 6), "none") == (8, 6)
    assert route_capability((9, 0), "sm70") == (7, 0) and route_capability((9, 0), "sm75") == (7, 5)
    assert route_capability((7, 0), "sm70") == (7, 0)
    h200_compat = route_capability((9, 0), "sm70")
    assert dot_max_rows(h200_compat) == dot_max_rows((7, 0)) < dot_max_rows((9, 0))
    assert grouped_max_rows(h200_compat) == grouped_max_rows((7, 0)) < grouped_max_rows((9, 0))
    assert dot_table(h200_compat) is moe_table(h200_compat) is DOT_CONFIGS


def test_cpu():
    p = platform_for(None, device="cpu")
    assert p.route == "cpu" and p.capability is None and not p.is_cuda
    assert p.recommended_dtype == "float32"
    assert not (p.native_bf16 or p.native_fp8 or p.triton_tensor_cores or p.vendor_tensor_cores)
    assert detect("cpu").route == "cpu"


def test_v100():
    p = platform_for((7, 0), name="Tesla V100-SXM2-32GB", torch_arch_list=["sm_70", "sm_80", "sm_90"])
    assert p.route == "sm70" and p.compat == "sm70" and p.is_compat and not p.forced_compat
    assert not p.native_bf16 and not p.native_fp8 and not p.native_fp4
    assert not p.triton_tensor_cores and p.vendor_tensor_cores  # tl.dot is FMA; cuBLAS/SDPA have tensor cores
    assert p.recommended_dtype == "float16" and p.torch_has_arch is True
    d = p.to_dict()
    assert d["sm"] == "sm_70" and d["capability"] == [7, 0]


def test_v100_torch_build_without_sm70():
    p = platform_for((7, 0), torch_arch_list=["sm_80", "sm_90", "compute_90"])
    assert p.torch_has_arch is False
    assert any("sm_70" in n for n in p.notes)
    assert platform_for((7, 0), torch_arch_list=["compute_70"]).torch_has_arch is True  # PTX JIT


def test_cubins_of_a_lower_minor_run_on_the_chip():
    # cuda's binary compatibility within a major version: torch cu126 wheels list sm_86 but no sm_89, and run on
    # an RTX 4090 / L40; an arch-specific cubin (sm_90a) runs only on its own chip
    cu126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert platform_for((8, 9), torch_arch_list=cu126).torch_has_arch is True
    assert platform_for((7, 5), torch_arch_list=["sm_70"]).torch_has_arch is True
    assert platform_for((8, 0), torch_arch_list=["sm_75", "sm_86"]).torch_has_arch is False
    assert platform_for((9, 0), torch_arch_list=["sm_86"]).torch_has_arch is False
    assert platform_for((10, 3), torch_arch_list=["sm_100a"]).torch_has_arch is False
    assert platform_for((10, 0), torch_arch_list=["sm_100a"]).torch_has_arch is True


def test_torch_arch_error_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    p = platform_for((7, 0), name="Tesla V100-SXM2-32GB", torch_arch_list=["sm_80", "sm_90"])
    err = torch_arch_error(p)
    assert err.startswith("Tesla V100-SXM2-32GB (sm_70): this torch build lists sm_80, sm_90, not sm_70")
    assert "install a build that ships it (V100: a CUDA 12.6 build)" in err and torch.__version__ in err
    assert err.split(": ", 1)[1].split("; the installed")[0] in p.notes  # the fix voltllm check prints
    assert torch_arch_error(platform_for((7, 0), torch_arch_list=["sm_70"])) is None
    assert torch_arch_error(platform_for((7, 0))) is None  # arch list unknown: not refused
    assert torch_arch_error(platform_for(None)) is None


def test_t4():
    p = platform_for((7, 5))
    assert p.route == "sm75" and p.compat == "sm75" and p.recommended_dtype == "float16"
    assert not p.native_bf16 and not p.triton_tensor_cores


def test_ampere_and_ada():
    a100 = platform_for((8, 0))
    assert a100.route == "sm80" and a100.compat == "none"
    assert a100.native_bf16 and not a100.native_fp8 and a100.triton_tensor_cores
    assert a100.recommended_dtype == "bfloat16"
    ada = platform_for((8, 9))
    assert ada.route == "sm80" and ada.native_fp8


def test_h200_native_and_forced_compat():
    h = platform_for((9, 0), name="NVIDIA H200")
    assert h.route == "sm90" and h.native_bf16 and h.native_fp8 and not h.native_fp4
    forced = platform_for((9, 0), compat="sm70", name="NVIDIA H200")
    assert forced.route == "sm70" and forced.hardware_route == "sm90" and forced.forced_compat
    # the compat route creates no bf16/fp8 even where the chip has them
    assert not forced.native_bf16 and not forced.native_fp8
    assert forced.recommended_dtype == "float16"
    assert forced.triton_tensor_cores  # the chip itself: prefill tl.dot still lands on its tensor cores
    assert any("forced" in n for n in forced.notes)


def test_blackwell_has_fp4():
    assert platform_for((10, 0)).native_fp4


def test_bad_compat():
    with pytest.raises(ValueError):
        platform_for((9, 0), compat="sm60")
