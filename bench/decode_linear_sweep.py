"""Rollout-batch linears on the GPU: where the W8A8 time goes.

For the Qwen2.5-7B projection shapes (separate and fused q/k/v and gate/up) at M = 256 / 512 / 1024 tokens, times
(CUDA-graph replays, microseconds) the bf16 GEMM, the activation quantization alone and torch._scaled_mm alone
(rowwise and per-tensor scales). With --profile, also lists the CUDA kernels of eager decode steps of a 4-layer
7B-shaped model per precision (what the "other" part of the step breakdown is made of).

    python3 bench/decode_linear_sweep.py [--m 256,512,1024] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from quarl.bench.rollout_breakdown import _graph_ms
from quarl.formats import quantize
from quarl.kernels.act_quant import quantize_activation

SHAPES = {"q": (3584, 3584), "kv": (512, 3584), "qkv": (4608, 3584), "o": (3584, 3584), "gate": (18944, 3584),
          "gate_up": (37888, 3584), "down": (3584, 18944)}



def graph_us(fn, reps: int = 50) -> float:
    """Mean microseconds per replay of a CUDA graph of fn."""
    return 1e3 * _graph_ms(torch, fn, reps)


def sweep(ms: list[int]) -> None:
    print("| shape | M | bf16 | act_quant | scaled_mm row | scaled_mm tensor | act + row vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        qw = quantize(w, "fp8", "weight")
        wt = qw.data.t()
        sw_row = qw.scale.reshape(1, n)
        one = torch.ones((), device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            codes, sx = quantize_activation(x, "fp8", k)
            t_bf16 = graph_us(lambda: F.linear(x, w))
            t_act = graph_us(lambda: quantize_activation(x, "fp8", k))
            t_row = graph_us(lambda: torch._scaled_mm(codes, wt, scale_a=sx, scale_b=sw_row, out_dtype=torch.bfloat16))
            t_ten = graph_us(lambda: torch._scaled_mm(codes, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            print(f"| {name} ({n}x{k}) | {m} | {t_bf16:.1f} | {t_act:.1f} | {t_row:.1f} | {t_ten:.1f} | "
                  f"{t_bf16 / (t_act + t_row):.2f}x |")


def profile_step() -> None:
    """Top CUDA kernels of eager decode steps (4 layers of the 7B shapes, batch 512, context 768)."""
    from quarl.bench.rollout import model_config
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.precision_apply import apply_precision
    from quarl.precision import PrecisionConfig
    from quarl.rollout.fast_engine import FastRolloutEngine
    from quarl.rollout.sampling import SamplingParams

    cfg = dataclasses.replace(model_config("7b"), num_layers=4)
    with torch.device("meta"):
        model = QuarlForCausalLM(cfg, init_std=None)
    model = model.to(torch.bfloat16)
    model.materialize("cuda", 0.02, None)
    model.eval().requires_grad_(False)
    for prec, kv in (("bf16", "auto"), ("fp8", "fp8")):
        pc = PrecisionConfig(flow="bf16") if prec == "bf16" else PrecisionConfig(flow="split", format=prec)
        apply_precision(model, pc)
        engine = FastRolloutEngine(model, None, max_batch_size=512, max_seq_len=1279, kv_cache_dtype=kv,
                                   use_cuda_graphs=False)
        engine.generate([[1, 2, 3]] * 4, max_new_tokens=4, n=1, ignore_eos=True)
        st = engine.state
        st.slot_len[:512] = 768
        st.num_generated[:512] = 0
        st.done[:512] = False
        st.max_new.fill_(2**40)
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = SamplingParams(1.0)
        model.set_rollout(True)
        with torch.no_grad():
            for _ in range(2):
                engine.step(512, engine.kv_bound(800), params, gen)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step(512, engine.kv_bound(800), params, gen)
                torch.cuda.synchronize()
        model.set_rollout(False)
        st.done.fill_(True)
        print(f"\n### eager decode step kernels, {prec} / KV {kv}, 4 layers x 3 steps\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
        del engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="256,512,1024")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if not a.no_sweep:
        sweep([int(v) for v in a.m.split(",")])
    if a.profile:
        profile_step()


if __name__ == "__main__":
    main()
