"""The sm_70/sm_75 compile gate: all registered compat kernels pass, bad kernels are rejected."""
import importlib.util
import textwrap

import pytest
import triton
import triton.language as tl

from voltllm.check import sm70_gate
from voltllm.check.sm70_gate import check_ir, check_ptx, find_unregistered_kernels, run_gate
from voltllm.kernels.registry import REGISTRY, CompileSpec, KernelEntry


@pytest.fixture(scope="module")
def full_report():
    return run_gate((70, 75))


# the whole gate compiles ~520 (kernel spec, arch) pairs to PTX and assembles ~170 of them: ~385 CPU-s on a cold Triton
# cache (docs/sm70.md), 5-6 min on CI's 2 cores beside the other worker's tests, near the suite's 600 s per test; the
# test that first builds the fixture gets the room
@pytest.mark.timeout(2700)
def test_gate_passes_all_registered_kernels(full_report):
    assert full_report.ok, "\n" + full_report.format_table()
    checked = {r.kernel for r in full_report.results if r.status == "ok"}
    for name in ("fp8.encode", "fp8.decode", "fp8.kv_write", "fp8.kv_gather"):
        assert name in checked
    for r in full_report.results:
        if r.kernel.startswith("fp8."):
            assert r.status == "ok", r
    assert {r.arch for r in full_report.results} == {70, 75}


@pytest.mark.timeout(2700)
def test_no_unregistered_kernels(full_report):
    assert full_report.unregistered == []
    assert find_unregistered_kernels() == []


# --- deliberately bad kernels ---------------------------------------------------------------
@triton.jit
def _bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(tl.bfloat16), mask=offs < n)


@triton.jit
def _fp8_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, E5: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if E5:
        y = x.to(tl.float8e5).to(tl.float16)  # Triton emulates this one on sm_70
    else:
        y = x.to(tl.float8e4nv).to(tl.float16)  # Triton refuses this one below sm_89
    tl.store(y_ptr + offs, y, mask=offs < n)


@triton.jit
def _tanh_asm_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, y, mask=offs < n)


@triton.jit
def _wide_dot_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # [16 x BLOCK] @ [BLOCK x 16]: both operands sit in shared memory (BLOCK=1024: 128 KB), while the unrolled
    # FMA work stays small (a [128 x 128] @ [128 x 128] dot needs the same shared memory and ~10x the compile time)
    r = tl.arange(0, 16)
    k = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + r[:, None] * BLOCK + k[None, :])
    b = tl.load(y_ptr + k[:, None] * 16 + r[None, :])
    tl.store(y_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision="ieee"))


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def _sig(y: str, **extra: str) -> dict:
    return {"x_ptr": "*fp32", "y_ptr": y, "n": "i32", "BLOCK": "constexpr", **extra}


def test_bf16_kernel_rejected():
    entry = KernelEntry("test.bad_bf16", _bf16_kernel,
                        [CompileSpec(_sig("*bf16"), {"BLOCK": 128}, label="bf16 out")])
    report = run_gate((70, 75), entries=[entry])
    assert not report.ok
    assert [r.status for r in report.results] == ["failed", "failed"]
    for r in report.results:
        assert any("bf16" in why for why in r.reasons), r
        assert r.lines
    assert "FAIL" in report.format_table()


@pytest.mark.parametrize("e5", [False, True])
def test_fp8_kernel_rejected(e5):
    entry = KernelEntry("test.bad_fp8", _fp8_kernel,
                        [CompileSpec(_sig("*fp16", E5="constexpr"), {"BLOCK": 128, "E5": e5})])
    report = run_gate((70, 75), entries=[entry])
    assert [r.status for r in report.results] == ["failed", "failed"]
    if e5:  # compiles (integer emulation) but the IR rule catches the fp8 type
        assert all(any("fp8" in why for why in r.reasons) for r in report.results)
    else:
        assert all("does not compile" in r.reasons[0] for r in report.results)


def test_aligned_compiles_the_run_time_specialization():
    # unspecialized pointers give scalar loads; marked 16-byte aligned (as the JIT marks torch tensors) 4-wide ones
    spec = CompileSpec(_sig("*fp32"), {"BLOCK": 512})
    _, plain, _ = sm70_gate.compile_for(_copy_kernel, spec, 70, assemble=False)
    _, aligned, _ = sm70_gate.compile_for(_copy_kernel, spec, 70, assemble=False, aligned=True)
    assert "ld.global.v4" not in plain and "ld.global.v4" in aligned
    assert sm70_gate.aligned_attrs({"x_ptr": "*fp32", "n": "i32", "stride_x": "i32", "B": "constexpr"}) == {
        (0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    entry = KernelEntry("test.copy", _copy_kernel, [spec])
    assert [r.status for r in run_gate((70, 75), entries=[entry], aligned=True).results] == ["ok", "ok"]


def test_arch_specific_instruction():
    # tanh.approx exists from sm_75: ptxas refuses it for sm_70, and the gate names the PTX line
    entry = KernelEntry("test.tanh_asm", _tanh_asm_kernel, [CompileSpec(_sig("*fp32"), {"BLOCK": 128})])
    r70, r75 = run_gate((70, 75), entries=[entry]).results
    assert r70.status == "failed" and r75.status == "ok"
    assert any("tanh.approx" in ln for ln in r70.lines)


def test_ptx_rules():
    cases = [  # (ptx line, fails on sm_70, fails on sm_75)
        ("cvt.rn.satfinite.e4m3x2.f32 %rs1, %r2, %r3;", True, True),
        ("cvt.rn.f16x2.e5m2x2 %r1, %rs2;", True, True),
        ("cvt.rn.bf16.f32 %rs1, %r2;", True, True),
        ("fma.rn.bf16x2 %r1, %r2, %r3, %r4;", True, True),
        ("cvt.rn.f16x2.f32 %r1, %r2, %r3;", True, True),
        ("cvt.rn.f16.f32 %rs1, %r2;", False, False),
        ("cvt.f32.f16 %r1, %rs2;", False, False),
        ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r1}, {%r2}, {%r3}, {%r4};", True, True),
        ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%r1}, {%r2}, {%r3}, {%r4};", True, True),
        ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%r1}, {%r2}, {%r3}, {%r4};", True, False),
        ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%r1}, {%r2}, {%r3}, {%r4};", True, True),
        ("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%r1}, {%r2}, {%r3}, {%r4};", False, False),
        ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];", True, False),
        ("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%r1}, %rd1, %rd2, 1, 1, 1, 1, 1;", True, True),
        ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}], [%r4];",
         True, True),
        ("cp.async.cg.shared.global [%r1], [%rd1], 16;", True, True),
        ("max.f16 %rs1, %rs2, %rs3;", True, True),
        ("max.f32 %r1, %r2, %r3;", False, False),
        ("tanh.approx.f32 %r1, %r2;", True, False),
        ("fma.rn.f32 %r1, %r2, %r3, %r4;", False, False),
        ("ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];", False, False),
        ("// cvt.rn.bf16.f32 in a comment is fine", False, False),
    ]
    for line, bad70, bad75 in cases:
        assert bool(check_ptx(line, 70)) == bad70, line
        assert bool(check_ptx(line, 75)) == bad75, line


def test_ptx_rules_whole_file():
    """check_ptx on a whole file (it scans the text for candidate lines first) flags the same lines, with the same
    line numbers, as on each line alone: comments, blank lines and every kind of line end included."""
    lines = ["cvt.rn.bf16.f32 %rs1, %r2; // bf16", "  mov.u32 %r1, %tid.x;", "", "// tanh.approx.f32 %r1, %r2;",
             "tanh.approx.f32 %r1, %r2;", "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];  // .bf16",
             "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%r1}, {%r2}, {%r3}, {%r4};", "xtanh.approx.f32",
             "max.f16 %rs1, %rs2, %rs3;", "cp.async.cg.shared.global [%r1], [%rd1], 16;", "@%p1 bra $L__BB0_2;"]
    ends = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"]
    text = "".join(line + ends[i % len(ends)] for i, line in enumerate(lines * 3))
    for arch in (70, 75, 80):
        expected = [(no, v.rule, v.line) for no, line in enumerate(text.splitlines(), 1)
                    for v in check_ptx(line, arch)]
        got = [(v.line_no, v.rule, v.line) for v in check_ptx(text, arch)]
        assert got == expected, arch
        assert got or arch == 80


def test_ir_rules():
    assert check_ir("%y = tt.fp_to_fp %x : tensor<128xf32> -> tensor<128xf8E5M2> loc(#loc3)")
    assert check_ir("%0 = tt.load %p : tensor<64x32x!tt.ptr<bf16>>")
    assert check_ir("%1 = arith.truncf %0 : tensor<16x16xf32> to tensor<16x16xbf16>")
    assert check_ir("tt.func public @k(%a: !tt.ptr<f8E4M3FN>)")
    assert not check_ir("%xbf16 = arith.addf %a, %b : tensor<128xf16>")
    assert not check_ir('#loc = loc("/src/bf16_tools.py":3:0)')
    assert not check_ir('%y = tt.load %p : tensor<128x!tt.ptr<f16>> loc("y_bf16"(#loc))')


def test_unregistered_detection(tmp_path, monkeypatch):
    path = tmp_path / "_gate_fake_kernels.py"
    path.write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        __triton_helpers__ = ("declared_helper",)

        @triton.jit
        def called_helper(x):
            return x * 2

        @triton.jit
        def declared_helper(x):
            return x + 1

        @triton.jit
        def orphan_helper(x):
            return x - 1

        @triton.jit
        def registered_kernel(p, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(p + offs, called_helper(tl.load(p + offs)))

        @triton.jit
        def unregistered_kernel(p, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(p + offs, tl.load(p + offs))
    '''))
    spec = importlib.util.spec_from_file_location("_gate_fake_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(REGISTRY, "test.fake", KernelEntry("test.fake", mod.registered_kernel, []))
    assert find_unregistered_kernels([mod]) == ["_gate_fake_kernels:orphan_helper",
                                                "_gate_fake_kernels:unregistered_kernel"]


def test_main_table(capsys):
    assert sm70_gate.main(["--module", "voltllm.kernels.fp8_codec", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "sm_70" in out and "sm_75" in out and "fp8.encode" in out and "PASS" in out


@pytest.mark.parametrize("fallback", [False, True])
def test_shared_memory_over_the_target(fallback):
    """A fp32 dot whose operands take 128 KB needs more shared memory per block than sm_75's 64 KB (and sm_70's
    96 KB): the gate fails it, unless the kernel's caller copes (shared_fallback), where it passes with the size
    noted."""
    spec = CompileSpec(_sig("*fp32"), {"BLOCK": 1024}, label="k1024")
    small = CompileSpec(_sig("*fp32"), {"BLOCK": 32}, label="k32")
    entry = KernelEntry("test.wide_dot", _wide_dot_kernel, [spec, small], shared_fallback=fallback)
    report = run_gate((70, 75), entries=[entry])
    by = {(r.label, r.arch): r for r in report.results}
    assert by[("k32", 75)].status == "ok" and not by[("k32", 75)].reasons
    big = by[("k1024", 75)]
    assert any("KB of shared memory per block; sm_75 has 64 KB" in why for why in big.reasons), big
    assert big.status == ("ok" if fallback else "failed")
    assert report.ok == fallback
    assert ("ok*" in report.format_table()) == fallback


def _chunk_small_tile_specs(precision: str):
    """(kernel name, spec) of the three Gated DeltaNet chunk kernels at the first tile of `precision`."""
    from voltllm.kernels import gdn_chunk

    tile = gdn_chunk.TILES[precision][0]
    labels = {"gdn.chunk_prep": f"fp16 dk128 c64 ks{tile.split}",
              "gdn.chunk_hoist": f"fp16 dk128 dv128 c64 ks{tile.split}",
              "gdn.chunk_fwd": "fp16 dk128 dv128 bv64 c64 hoist"}
    out = []
    for name, label in labels.items():
        spec, = [s for s in REGISTRY[name].specs if s.label == label]
        cx = {**spec.constexprs, "PRECISION": precision}
        if name == "gdn.chunk_fwd":
            cx["BLOCK_V"] = tile.block_v
        out.append((name, CompileSpec(spec.signature, cx, label.replace("bv64", f"bv{tile.block_v}"))))
    return tile, out


@pytest.mark.timeout(2700)
def test_gdn_chunk_small_tile_fits_v100_and_t4(full_report):
    """The chunk kernels' first "ieee" tile (HOIST, prep / hoist dots in pieces) fits a V100's 96 KB and a T4's 64 KB
    per block, so hybrid prompts there run the kernels, not the torch form (the gate compiled its specs)."""
    _, specs = _chunk_small_tile_specs("ieee")
    wanted = {(name, spec.label) for name, spec in specs}
    got = [r for r in full_report.results if (r.kernel, r.label) in wanted]
    assert {(r.kernel, r.label, r.arch) for r in got} == {(n, lab, a) for n, lab in wanted for a in (70, 75)}
    for r in got:
        assert r.status == "ok" and not r.reasons, r


def test_gdn_chunk_small_tile_fits_consumer_ampere_ada():
    """The first "tf32x3" tile's kernels, compiled for sm_86 at the tile's warps and stages, fit the 99 KB per block
    of an RTX 30xx / 40xx card (the unsplit ones need 128 KB there)."""
    tile, specs = _chunk_small_tile_specs("tf32x3")
    for name, spec in specs:
        warps = tile.warps if name == "gdn.chunk_fwd" else tile.prep_warps
        # the shared memory size is known before ptxas, which this check does not need
        _, _, shared = sm70_gate.compile_for(REGISTRY[name].fn, spec, 86, {"num_warps": warps,
                                                                           "num_stages": tile.stages}, assemble=False)
        assert shared <= 99 * 1024, (name, shared)


# --- which specs ptxas assembles (voltllm.check.ptxas_cover) -------------------------------------
@triton.jit
def _pack_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PACK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if PACK:  # cvt.pack needs sm_72: no PTX rule knows it, only ptxas refuses it for sm_70
        x = tl.inline_asm_elementwise("cvt.pack.sat.s8.s32.b32 $0, $1, $1, 0;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=True, pack=1)
    tl.store(y_ptr + offs, x, mask=offs < n)


@pytest.mark.parametrize("ptxas", ["cover", "all"])
def test_ptxas_reaches_a_form_only_a_larger_spec_uses(ptxas):
    sig = {"x_ptr": "*i32", "y_ptr": "*i32", "n": "i32", "BLOCK": "constexpr", "PACK": "constexpr"}
    entry = KernelEntry("test.pack", _pack_kernel, [CompileSpec(sig, {"BLOCK": 128, "PACK": False}, label="small"),
                                                    CompileSpec(sig, {"BLOCK": 1024, "PACK": True}, label="pack"),
                                                    CompileSpec(sig, {"BLOCK": 128, "PACK": False}, label="again")])
    report = run_gate((70, 75), entries=[entry], jobs=1, ptxas=ptxas)
    by = {(r.label, r.arch): r for r in report.results}
    assert [k for k, r in by.items() if r.status != "ok"] == [("pack", 70)]
    assert any("cvt.pack" in ln and "sm_72" in ln for ln in by[("pack", 70)].lines), by[("pack", 70)]
    # "again" compiles to the same PTX as "small": cover mode leaves it to the PTX rules
    assert report.assembled == ({70: (2, 3), 75: (2, 3)} if ptxas == "cover" else {70: (3, 3), 75: (3, 3)})
    assert "ptxas sm_70: assembled" in report.format_table()


def test_instruction_forms():
    from voltllm.check.ptxas_cover import instruction_forms

    ptx = "\n".join([".version 8.7", ".target sm_70", ".reg .b32 %r<12>;", ".extern .shared .align 16 .b8 smem[];",
                     "$L__BB0_1:", "\tmov.u32 %r1, %tid.x;", "\t@%p1 ld.global.nc.v4.b32 { %r2, %r3, %r4, %r5 },",
                     "\t\t[ %rd1 + 0 ];", "\t@!%p2 bra $L__BB0_1;", "\tmma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32",
                     "\t\t{%f1}, {%r6}, {%r7}, {%f2};  // tanh.approx.f32 in a comment", "}", "\tret;"])
    assert instruction_forms(ptx) == {".version", ".target", ".reg .b32", ".extern .shared", "mov.u32", "%tid.x",
                                      "ld.global.nc.v4.b32", "bra", "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32",
                                      "ret", "%r"}


def test_choose_for_ptxas():
    from voltllm.check.ptxas_cover import choose_for_ptxas

    f = frozenset
    cands = {"a1": ("a", 10, f({"x", "y"})), "a2": ("a", 30, f({"x"})), "a3": ("a", 20, f({"x", "z"})),
             "b1": ("b", 50, f({"x"})), "b2": ("b", 40, f({"y"}))}
    # smallest first: a1 (kernel a), a3 (new z), b2 (kernel b); a2 and b1 add nothing
    assert choose_for_ptxas(cands) == {"a1", "a3", "b2"}
    assert choose_for_ptxas({}) == set()


def test_ptx_only_compiles_are_kept_on_disk(tmp_path, monkeypatch):
    """Triton caches a kernel only after ptxas, so the gate keeps the PTX of the specs it does not assemble itself:
    a second run reads it back, and a damaged file is compiled again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm70_gate, "_COMPILED", {})
    spec = CompileSpec({"x_ptr": "*i32", "y_ptr": "*i32", "n": "i32", "BLOCK": "constexpr", "PACK": "constexpr"},
                       {"BLOCK": 64, "PACK": False})
    first = sm70_gate.compile_for(_pack_kernel, spec, 70, assemble=False)
    files = list(tmp_path.glob("voltllm-gate/ptx/*/*.json.gz"))
    assert len(files) == 1 and ".target sm_70" in first[1] and first[2] >= 0
    sm70_gate._COMPILED.clear()
    monkeypatch.setattr(sm70_gate, "_StopBeforePtxas", None)  # any compile would now fail
    assert sm70_gate.compile_for(_pack_kernel, spec, 70, assemble=False) == first
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm70_gate, "_COMPILED", {})
    files[0].write_bytes(b"not gzip")
    assert sm70_gate.compile_for(_pack_kernel, spec, 70, assemble=False) == first


def test_ptxas_successes_are_remembered(tmp_path, monkeypatch):
    """assemble() remembers PTX ptxas accepted (a second gate run skips ptxas for it); a refusal is asked again."""
    from voltllm.check import ptxas_cover

    sig = {"x_ptr": "*i32", "y_ptr": "*i32", "n": "i32", "BLOCK": "constexpr", "PACK": "constexpr"}
    cache = str(tmp_path / "accepted")
    for pack, accepted in ((False, True), (True, False)):
        ptx = sm70_gate.compile_for(_pack_kernel, CompileSpec(sig, {"BLOCK": 64, "PACK": pack}), 70, assemble=False)[1]
        path = tmp_path / f"pack{pack}.ptx"
        path.write_text(ptx)
        first = ptxas_cover.assemble(str(path), 70, cache)
        assert (first is None) == accepted and (accepted or "cvt.pack" in first)
        calls = []
        real_run = ptxas_cover.subprocess.run
        monkeypatch.setattr(ptxas_cover.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
        assert (ptxas_cover.assemble(str(path), 70, cache) is None) == accepted
        assert len(calls) == (0 if accepted else 1)
        monkeypatch.undo()
    assert len(list((tmp_path / "accepted").iterdir())) == 1


def test_specs_left_out_of_the_gate_are_those_the_compat_route_never_launches():
    """The gate skips the decode attention's tl.dot specs and the Triton prefill kernel (compat=False): on sm_70 /
    sm_75, and under --compat on any GPU, the attention backend decodes on FMA and prefills through SDPA."""
    import torch

    import voltllm.kernels.attention  # noqa: F401  (registers)
    from voltllm.attention.triton_backend import TritonAttentionBackend

    decode = REGISTRY["attention.paged_decode"]
    assert decode.compat and {s.compat for s in decode.specs} == {True, False}
    for s in decode.specs:
        assert s.compat == (not s.constexprs["USE_DOT"]), s.label
    assert not REGISTRY["attention.paged_prefill"].compat
    dev = torch.device("cuda", 0)
    for cap, forced in (((7, 0), None), ((7, 5), None), ((9, 0), False)):
        backend = TritonAttentionBackend(use_tensor_cores=forced)
        backend._dev_info[str(dev)] = (cap, 80)  # (as read from the device)
        assert not backend._use_dot(dev) and backend._use_sdpa_prefill(dev), cap
    native = TritonAttentionBackend()
    native._dev_info[str(dev)] = ((9, 0), 132)
    assert native._use_dot(dev) and not native._use_sdpa_prefill(dev)
