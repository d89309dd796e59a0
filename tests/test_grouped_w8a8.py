"""The grouped W8A8 expert GEMM (`quarl.kernels.grouped_w8a8`) and the MoE path built on it
(`quarl.model.moe.grouped_w8a8_swiglu`).

CPU, Triton's interpreter: the kernel against a float64 reference built from the same codes and scales, int8 and
fp8, with experts that own no rows, one expert owning every row, one row, several row tiles per expert, sizes off
every block (K = 576, N = 96) and NaN-padded scale views (a scale read past a row poisons the output). Tolerance
2e-3 relative (Frobenius): the codes and scales are the same and the products exact, so what remains is the fp16
output rounding (2^-11 per element) and the float32 summation order; for int8 the sums are exact integers, and the
output equals the dense kernel's epilogue float16(float32(acc) * s_w * s_x) computed in torch, bit for bit.
The MoE path in the interpreter: `grouped_w8a8_swiglu` against the per-expert reference `grouped_swiglu` on the CPU
(fake-quantized activations times the dequantized weights, float32) at 1e-3 relative (typically 1e-7: float32
sums in another order, which rarely move an element of silu(gate) * up across a rounding boundary of its code).

GPU (`gpu`): `grouped_w8a8_swiglu` equals the per-expert path on the dense W8A8 kernel bit for bit in int8 (plans
without split-K: a split-K plan scales each partial before summing them) and within fp32 summation order in fp8
(dense fp8 codes converted to fp16 as the grouped kernel does), and the tuned per-expert path within 3e-2;
the block takes the path in a rollout; the path captures into a CUDA graph (a host sync would fail the capture)
whose replays read re-quantized codes.
"""

import textwrap
import warnings
from types import SimpleNamespace

import pytest
import torch

from interpreter import INTERPRETER_PATCH, run_in_interpreter

_KERNEL_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    import dataclasses
    from quarl.formats import quantize
    from quarl.kernels.grouped_w8a8 import expert_table, grouped_w8a8_matmul

    FMT = FMT_ARG
    torch.manual_seed(SEED_ARG)
    print("seed", SEED_ARG)  # shown with the traceback when a check fails

    def nan_padded(t):
        \"\"\"t [R, 1] as a view into a NaN-filled [R, 9] buffer (row stride 9).\"\"\"
        big = torch.full((t.shape[0], 9), float("nan"), dtype=t.dtype)
        big[:, :1] = t
        return big[:, :1]

    def random_counts(e, m):
        counts = torch.zeros(e, dtype=torch.long)
        busy = torch.randperm(e)[:max(1, e // 2)]
        counts.index_add_(0, busy[torch.randint(0, len(busy), (m,))], torch.ones(m, dtype=torch.long))
        return counts

    # (rows per expert, N, K, tile): idle experts between busy ones; one expert owning every row; one row; several
    # row tiles per expert with small tiles; one expert; random counts; no rows at all
    cases = [([3, 0, 20, 1, 0], 96, 576, {}), ([0, 0, 37, 0], 96, 576, {}), ([0, 1, 0], 40, 200, {}),
             ([40, 17, 0, 33, 0, 0, 5], 96, 576, dict(block_m=16, block_n=32, block_k=64)),
             ([70], 130, 300, {}), (random_counts(8, 50).tolist(), 72, 160, dict(block_m=32)), ([0, 0, 0], 96, 64, {})]
    for counts, n, k, tile in cases:
        counts = torch.tensor(counts)
        e, m = len(counts), int(counts.sum())
        qws = [quantize(torch.randn(n, k) * 0.05 * float(torch.rand(1) + 0.5), FMT) for _ in range(e)]
        qws = [dataclasses.replace(q, scale=nan_padded(q.scale)) for q in qws]
        table = expert_table(FMT, [q.data for q in qws], [q.scale for q in qws])
        x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).half()
        xq = quantize(x, FMT, "activation")
        xs = nan_padded(xq.scale)
        y = grouped_w8a8_matmul(xq.data, xs, counts.cumsum(0).to(torch.int32), table, torch.float16, **tile)
        assert y.shape == (m, n) and y.dtype == torch.float16, (counts, y.shape)
        if m == 0:
            continue
        owner = torch.repeat_interleave(torch.arange(e), counts)
        ref = torch.empty(m, n, dtype=torch.float64)
        acc = torch.empty(m, n, dtype=torch.float64)  # exact sums of code products
        for j in range(e):
            rows = owner == j
            acc[rows] = xq.data[rows].double() @ qws[j].data.double().T
            ref[rows] = xq.dequantize(torch.float64)[rows] @ qws[j].dequantize(torch.float64).T
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 2e-3, (FMT, counts.tolist(), n, k, tile, err)
        if FMT == "int8":  # the dense kernel's epilogue in torch: float32(acc) * s_w[n], * s_x[r], one rounding
            sw = torch.stack([q.scale.reshape(n) for q in qws])[owner]  # [m, n]
            expect = ((acc.float() * sw) * xq.scale.reshape(m, 1)).half()
            assert torch.equal(y, expect), (counts.tolist(), n, k, tile, (y.float() - expect.float()).abs().max())
    print("ok")
""")

# A MoE block in the interpreter: hidden 160 and expert width 72 (neither a multiple of the kernel's blocks), its
# experts' projections `linears` with N(0, 0.05) weights, not yet configured.
_MOE_BLOCK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.model.config import ModelConfig
    from quarl.model.moe import SparseMoeBlock, grouped_swiglu, grouped_w8a8_swiglu, grouped_w8a8_training_swiglu
    from quarl.model.tiny import tiny_hf_config

    FMT = FMT_ARG
    torch.manual_seed(SEED_ARG)
    print("seed", SEED_ARG)
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", hidden_size=160, head_dim=40, num_experts=6,
                                             num_experts_per_tok=3, moe_intermediate_size=72))
    block = SparseMoeBlock(cfg, 0)
    linears = [lin for e in block.experts for lin in (e.gate_proj, e.up_proj, e.down_proj)]
    for lin in linears:
        lin.weight.data.normal_(0, 0.05)
""")

_MOE_CHECK = _MOE_BLOCK + textwrap.dedent("""
    for lin in linears:
        lin.configure(rollout_format=FMT)
        lin.set_rollout(True)
    counts = torch.tensor([9, 0, 1, 14, 0, 6])
    x = torch.randn(int(counts.sum()), 160)
    with torch.no_grad():
        ref = grouped_swiglu(x, counts, block.experts)  # CPU: fake-quantized x times the dequantized weights
        got = grouped_w8a8_swiglu(x, counts, block.experts)
        tables = block.experts._grouped_w8a8_tables
        assert got.shape == ref.shape and got.dtype == ref.dtype
        # float32 sums in other orders (~1e-7); rarely an element of silu(gate) * up then crosses a rounding
        # boundary of its code before down, and moves by a code step
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-3, (FMT, err)
        # an in-place re-quantization keeps the cached tables (same addresses) and is read by the next call
        for expert in block.experts:
            expert.down_proj.weight.data.mul_(-2.0)
            expert.down_proj.refresh()
        again = grouped_w8a8_swiglu(x, counts, block.experts)
        assert block.experts._grouped_w8a8_tables is tables
        torch.testing.assert_close(again, -2.0 * got, rtol=1e-5, atol=1e-5 * float(got.abs().max()))
    print("ok")
""")


_MOE_TRAINING_CHECK = _MOE_BLOCK + textwrap.dedent("""
    for lin in linears:  # the unified flow's W8A8 training forward on the rollout's kernel
        lin.configure(rollout_format=FMT, train_format=FMT, kernel_forward=True)
        assert lin.kernel_forward
    counts = torch.tensor([9, 0, 1, 14, 0, 6])
    x, g = torch.randn(30, 160), torch.randn(30, 160)

    def run(swiglu):
        for lin in linears:
            lin.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = swiglu(xi, counts, block.experts)
        (y * g).sum().backward()
        return y.detach(), xi.grad, [lin.weight.grad for lin in linears]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # per expert on the CPU: fake-quantized x and W, straight-through gradients (what each QuantLinear computes)
    ref_y, ref_gx, ref_gw = run(grouped_swiglu)
    y, gx, gw = run(grouped_w8a8_training_swiglu)
    # the same codes; float32 sums in another order, which rarely moves an element of silu(gate) * up by a code step
    assert rel(y, ref_y) < 1e-3 and rel(gx, ref_gx) < 1e-3, (rel(y, ref_y), rel(gx, ref_gx))
    for i, (a, b) in enumerate(zip(gw, ref_gw)):
        if counts[i // 3] == 0:  # an expert without rows: zero gradients in both
            assert a is not None and not a.any() and (b is None or not b.any()), i
        else:
            assert rel(a, b) < 1e-3, (i, rel(a, b))
    # an optimizer step changes a master weight in place: the next forward re-quantizes its stale rollout copy first
    with torch.no_grad():
        block.experts[3].down_proj.weight.mul_(-2.0)
    y2 = run(grouped_w8a8_training_swiglu)[0]
    ref2 = run(grouped_swiglu)[0]
    assert rel(y2, ref2) < 1e-3 and rel(y2, y) > 0.1, (rel(y2, ref2), rel(y2, y))
    print("ok")
""")


def _run_check(script: str, fmt: str) -> None:
    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter(script.replace("FMT_ARG", repr(fmt)).replace("SEED_ARG", str(seed)))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_grouped_w8a8_matches_the_codes_in_the_interpreter(fmt):
    _run_check(_KERNEL_CHECK, fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_grouped_w8a8_swiglu_matches_the_per_expert_path_in_the_interpreter(fmt):
    _run_check(_MOE_CHECK, fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_grouped_w8a8_training_matches_the_per_expert_kernel_forward_in_the_interpreter(fmt):
    _run_check(_MOE_TRAINING_CHECK, fmt)


def test_grouped_w8a8_refuses_bad_input():
    pytest.importorskip("triton")
    from quarl.formats import quantize
    from quarl.kernels.grouped_w8a8 import expert_table, grouped_w8a8_matmul

    qws = [quantize(torch.randn(8, 32), "int8") for _ in range(3)]
    with pytest.raises(ValueError, match="takes formats int8, fp8"):
        expert_table("fp8-block", [q.data for q in qws], [q.scale for q in qws])
    with pytest.raises(ValueError, match="expert codes must be 2-D torch.float8_e4m3fn"):
        expert_table("fp8", [q.data for q in qws], [q.scale for q in qws])
    odd = quantize(torch.randn(8, 48), "int8")
    with pytest.raises(ValueError, match=r"every expert's codes must be torch.int8 \(8, 32\)"):
        expert_table("int8", [q.data for q in qws] + [odd.data], [q.scale for q in qws] + [odd.scale])
    with pytest.raises(ValueError, match="must be 8 float32 values"):
        expert_table("int8", [q.data for q in qws], [q.scale[:4] for q in qws])
    table = expert_table("int8", [q.data for q in qws], [q.scale for q in qws])
    xq = quantize(torch.randn(5, 32), "int8", "activation")
    ends = torch.tensor([2, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"xq must be torch.int8 codes \[M, 32\]"):
        grouped_w8a8_matmul(xq.data[:, :16], xq.scale, ends, table, torch.float16)
    with pytest.raises(ValueError, match="xs must hold 5 float32 scales"):
        grouped_w8a8_matmul(xq.data, xq.scale[:3], ends, table, torch.float16)
    with pytest.raises(ValueError, match=r"ends must be int32 \[3\]"):
        grouped_w8a8_matmul(xq.data, xq.scale, ends.long(), table, torch.float16)


def _experts(fmt="int8", **settings):
    from quarl.model.config import ModelConfig
    from quarl.model.moe import SparseMoeBlock
    from quarl.model.tiny import tiny_hf_config

    block = SparseMoeBlock(ModelConfig.from_hf(tiny_hf_config("qwen3_moe")), 0)
    for expert in block.experts:
        for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
            lin.configure(rollout_format=fmt, **settings)
            lin.set_rollout(True)
    return block


def test_only_w8a8_rollouts_on_cuda_take_the_grouped_kernel(monkeypatch):
    """The predicate's conditions, with a stand-in for a CUDA activation (the CPU has none) and the kernels
    declared available."""
    from quarl.fast_paths import FastPaths
    from quarl.model import moe

    monkeypatch.setattr(moe, "format_kernels_available", lambda fmt, device=None: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    paths = FastPaths()

    def cuda_like(dtype=torch.bfloat16, requires_grad=False):
        return SimpleNamespace(is_cuda=True, dtype=dtype, requires_grad=requires_grad, device=torch.device("cpu"),
                               element_size=lambda: torch.finfo(dtype).bits // 8)

    for fmt in ("int8", "fp8"):
        block = _experts(fmt)
        assert moe.grouped_w8a8_ok(block.experts, cuda_like(), paths)
        assert moe.expert_path(block.experts, cuda_like(), paths) is moe.grouped_w8a8_swiglu
        assert moe.grouped_w8a8_ok(block.experts, cuda_like(torch.float16), paths)
        assert not moe.grouped_w8a8_ok(block.experts, cuda_like(torch.float32), paths)
        assert not moe.grouped_w8a8_ok(block.experts, torch.randn(3, 64).bfloat16(), paths)  # a CPU tensor
        assert not moe.grouped_w8a8_ok(block.experts, cuda_like(), FastPaths(grouped_experts=False))
        assert not moe.grouped_w8a8_ok(block.experts, cuda_like(requires_grad=True), paths)  # no backward
        with torch.no_grad():
            assert moe.grouped_w8a8_ok(block.experts, cuda_like(requires_grad=True), paths)
        block.experts[5].down_proj.set_rollout(False)  # one projection in its training forward
        assert not moe.grouped_w8a8_ok(block.experts, cuda_like(), paths)
        assert moe.expert_path(block.experts, cuda_like(), paths) is moe.grouped_swiglu
    for fmt, settings in [("int8", dict(weight_only=True)), ("fp8-block", {}), ("fp8-tensor", {}), ("nvfp4", {}),
                          ("int8", dict(lora_rank=2))]:
        assert not moe.grouped_w8a8_ok(_experts(fmt, **settings).experts, cuda_like(), paths), (fmt, settings)
    block = _experts("int8")
    block.experts[2].up_proj.configure(rollout_format="fp8")  # mixed formats
    block.experts[2].up_proj.set_rollout(True)
    assert not moe.grouped_w8a8_ok(block.experts, cuda_like(), paths)
    monkeypatch.setattr(moe, "format_kernels_available", lambda fmt, device=None: False)
    assert not moe.grouped_w8a8_ok(_experts("int8").experts, cuda_like(), paths)


# ------------------------------------------------------------------------------------------------------- GPU
GPU_FORMATS = ["int8", pytest.param("fp8", marks=pytest.mark.fp8)]


def _cuda_block(fmt, hidden=160, width=72, experts=6, top_k=3):
    from quarl.model.config import ModelConfig
    from quarl.model.moe import SparseMoeBlock
    from quarl.model.tiny import tiny_hf_config

    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", hidden_size=hidden, head_dim=40, num_experts=experts,
                                             num_experts_per_tok=top_k, moe_intermediate_size=width))
    block = SparseMoeBlock(cfg, 0).cuda().to(torch.bfloat16)
    for expert in block.experts:
        for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
            lin.weight.data.normal_(0, 0.05)
            lin.configure(rollout_format=fmt)
            lin.set_rollout(True)
    return block


def _rel(a, b) -> float:
    """Relative Frobenius distance of a from b, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def _kernel_plans_like_the_grouped_one(monkeypatch):
    """Make every per-expert rollout matmul run the dense W8A8 kernel as the grouped one multiplies: one K split
    (the same epilogue), int8 codes on the int8 tensor cores, fp8 codes converted to fp16 (exact products, float32
    sums; Hopper's fp8 tensor cores accumulate with fewer bits), 128 columns a step; instead of the tuned plan
    (which may split K, take the GEMV, cuBLAS or the bf16 fallback)."""
    from quarl.kernels import plans
    from quarl.kernels.tuning import Cfg, Plan

    def plan_for(fmt, weight_only, m, n, k, device=None, prefer_kernel=False):
        return Plan("w8a8", Cfg(64, 64, 128, split_k=1, native=fmt == "int8"), "prequant")

    monkeypatch.setattr(plans, "plan_for", plan_for)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
@pytest.mark.parametrize("shape", ["small", "qwen3-30b-a3b"])
def test_cuda_grouped_w8a8_equals_the_per_expert_path(monkeypatch, fmt, shape):
    from quarl import kernels
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.grouped_w8a8 import grouped_w8a8_matmul
    from quarl.model import moe

    if shape == "small":
        block, counts = _cuda_block(fmt), [40, 0, 3, 17, 0, 1]
    else:  # Qwen3-30B-A3B's expert shapes (hidden 2048, width 768), 16 of its 128 experts
        block = _cuda_block(fmt, hidden=2048, width=768, experts=16, top_k=8)
        counts = [int(c) for c in torch.randint(0, 40, (16,))]
        counts[3] = counts[7] = 0
    counts = torch.tensor(counts, device="cuda")
    x = torch.randn(int(counts.sum()), block.experts[0].gate_proj.in_features, device="cuda",
                    dtype=torch.bfloat16)
    with torch.no_grad():
        assert moe.grouped_w8a8_ok(block.experts, x, block.fast_paths)
        tuned = moe.grouped_swiglu(x, counts, block.experts)  # the tuned dense plans
        monkeypatch.setattr(kernels, "try_quantized_matmul", kernels.quantized_matmul)  # never the bf16 fallback
        _kernel_plans_like_the_grouped_one(monkeypatch)
        ref = moe.grouped_swiglu(x, counts, block.experts)
        got = moe.grouped_w8a8_swiglu(x, counts, block.experts)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    if fmt == "int8":
        assert torch.equal(got, ref)  # integer sums, the same epilogue: bit for bit
    else:
        # float32 sums, maybe in another order: gate and up within a bf16 rounding, which can move an element of
        # silu(gate) * up across an FP8 rounding boundary (or change a row's amax, hence its scale) before down:
        # a few elements then differ by a code step
        ends = counts.cumsum(0).to(torch.int32)
        xq, xs = quantize_activation(x, fmt, x.shape[1])
        with torch.no_grad():
            gate = grouped_w8a8_matmul(xq, xs, ends, moe._expert_tables(block.experts)[0], x.dtype)
            gate_ref = torch.cat([e.gate_proj(r) for e, r in zip(block.experts, x.split(counts.tolist()))])
        torch.testing.assert_close(gate.float(), gate_ref.float(), rtol=0.016, atol=1e-3 * float(gate_ref.abs().max()))
        assert _rel(got, ref) < 5e-3, _rel(got, ref)
    assert _rel(got, tuned) < 3e-2, _rel(got, tuned)  # the tuned plans: bf16 fallbacks, split-K, other sums


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_cuda_moe_block_takes_the_grouped_kernel_in_rollouts_only(fmt):
    from quarl.model import moe

    from quarl.fast_paths import FastPaths

    block = _cuda_block(fmt)
    x = torch.randn(3, 11, 160, device="cuda", dtype=torch.bfloat16)
    calls = []
    original = moe.grouped_w8a8_swiglu
    moe.grouped_w8a8_swiglu = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            got = block(x)
            assert len(calls) == 1
            block.fast_paths = FastPaths(grouped_experts=False)
            per_expert = block(x)  # the same rollout, one call per expert
            assert len(calls) == 1
            block.fast_paths = FastPaths()
            for expert in block.experts:
                for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
                    lin.set_rollout(False)
            full = block(x)  # the training forward: plain bf16 experts, never the W8A8 kernel
        assert len(calls) == 1
    finally:
        moe.grouped_w8a8_swiglu = original
    # the tuned per-expert plans: bf16 fallbacks (operands rounded to bf16), split-K, other sums
    assert _rel(got, per_expert) < 3e-2, _rel(got, per_expert)
    assert _rel(got, full) < (4e-2 if fmt == "int8" else 1e-1), _rel(got, full)  # the quantization's own error


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_cuda_grouped_w8a8_captures_into_a_cuda_graph_and_reads_requantized_codes(fmt):
    """No host sync: the path captures into a CUDA graph (capture fails on a sync, as the per-expert path's
    counts.tolist() does), and replays with new rows, new counts and in-place re-quantized codes equal eager runs."""
    from quarl.model import moe

    block = _cuda_block(fmt)
    counts = torch.tensor([5, 0, 9, 1, 0, 5], device="cuda")
    x = torch.randn(20, 160, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.grouped_w8a8_swiglu(x, counts, block.experts)  # warm-up: compiles, builds the address tables
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.grouped_w8a8_swiglu(x, counts, block.experts)
        with pytest.raises(RuntimeError), warnings.catch_warnings():  # the per-expert path reads the counts on the host
            warnings.simplefilter("ignore")  # (the aborted capture leaves an empty graph, and torch says so)
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                moe.grouped_swiglu(x, counts, block.experts)
        for step in range(3):
            x.copy_(torch.randn_like(x))
            counts.copy_(torch.tensor([[5, 0, 9, 1, 0, 5], [0, 20, 0, 0, 0, 0], [1, 2, 3, 4, 5, 5]][step]))
            if step == 2:  # the sync: master weights change, codes re-quantized in place
                for expert in block.experts:
                    for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
                        lin.weight.data.add_(0.05 * torch.randn_like(lin.weight))
                        lin.refresh()
            graph.replay()
            assert torch.equal(out, moe.grouped_w8a8_swiglu(x, counts, block.experts)), step


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_cuda_unified_training_forward_takes_the_grouped_kernel_and_equals_the_per_expert_path(fmt):
    """The unified flow's training forward of a MoE block: with grouped experts on, one grouped W8A8 launch per
    projection (`grouped_w8a8_training_swiglu`), whose outputs and straight-through gradients equal the per-expert
    kernel forward's (`QuantLinear._kernel_training_forward`) within the tuned per-expert plans' roundings."""
    from quarl.fast_paths import FastPaths
    from quarl.model import moe

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped training path's backward needs grouped_mm (Hopper or newer)")
    block = _cuda_block(fmt, hidden=256, width=128)
    linears = [lin for e in block.experts for lin in (e.gate_proj, e.up_proj, e.down_proj)]
    for lin in linears:
        lin.set_rollout(False)
        lin.configure(rollout_format=fmt, train_format=fmt, kernel_forward=True)
    x = torch.randn(4, 9, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)

    def run(grouped):
        block.fast_paths = FastPaths(grouped_experts=grouped)
        for lin in linears:
            lin.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = block(xi)
        (y.float() * g.float()).sum().backward()
        # an expert without rows: no gradient on the per-expert path, zeros on the grouped one
        grads = [torch.zeros_like(lin.weight) if lin.weight.grad is None else lin.weight.grad for lin in linears]
        return y.detach(), xi.grad, torch.cat([grad.float().flatten() for grad in grads])  # gate/up and down differ

    calls = []
    original = moe.grouped_w8a8_training_swiglu
    moe.grouped_w8a8_training_swiglu = lambda *a: calls.append(1) or original(*a)
    try:
        got = run(True)
        assert len(calls) == 1
        ref = run(False)
        assert len(calls) == 1
    finally:
        moe.grouped_w8a8_training_swiglu = original
    for a, b in zip(got, ref):
        assert _rel(a, b) < 3e-2, _rel(a, b)
