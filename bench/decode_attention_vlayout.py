"""FP8 value-cache layouts for decode attention: read speed of the attention and cost of the per-step write.

    PYTHONPATH=. python3 bench/decode_attention_vlayout.py [--batch 512 128] [--context 768] [--layers 8]

Values of an FP8 cache are the PV dot's B operand, reduced over the columns. Layouts compared, each cache slot
[Hkv, ...]:
  rows     [C, D]          (production): the codes are transposed through shared memory as fp16;
  columns  [D, C]          the codes arrive in operand order; a token's write is 128 bytes one column stride
                           apart (partial 32-byte sectors);
  tiles    [C/16, D, 16]   16-column tiles stored by columns: operand order within a tile (16-byte loads), a
                           token's write is 128 bytes 16 bytes apart inside one 2 KB tile.
Attention variants (FP8, one column range per sequence): `loop` = one loop over all blocks, keys masked by
column, values unmasked (every block is full at a context that is a multiple of 128; timing only); `tail` = full
blocks unmasked, the last partial block masked (the correct general form). Write: one token of every slot and
kv head, keys and values, `--layers 28` distinct caches per replay (ms per decode step).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quarl.bench.gemm import measure_ceilings  # noqa: E402
from quarl.bench.rollout_breakdown import _graph_ms  # noqa: E402
from quarl.kernels.decode_attention import decode_attention  # noqa: E402
from quarl.rollout.fast_attention import FP8_KV_DTYPE, decode_attention_torch  # noqa: E402

HQ, HKV, D, CAPACITY = 28, 4, 128, 1280
LAYOUTS = ("rows", "columns", "tiles")


@triton.jit
def _v_offsets(cols, offs_d, LAYOUT: tl.constexpr, CAP: tl.constexpr, DIM: tl.constexpr):
    """[BLOCK_N, D] byte offsets of values (cols, d) inside one slot-head of the layout (0 rows, 1 columns,
    2 tiles)."""
    if LAYOUT == 0:
        return cols[:, None] * DIM + offs_d[None, :]
    elif LAYOUT == 1:
        return cols[:, None] + offs_d[None, :] * CAP
    else:
        return (cols[:, None] // 16) * (16 * DIM) + offs_d[None, :] * 16 + cols[:, None] % 16


@triton.jit
def _block(q, k_base, v_base, n0, end, offs_n, offs_d, m_i, l_i, acc, MASK_K: tl.constexpr, MASK_V: tl.constexpr,
           MASK_S: tl.constexpr, LAYOUT: tl.constexpr, CAP: tl.constexpr, DIM: tl.constexpr):
    cols = n0 + offs_n
    n_ok = cols < end
    k_ptrs = k_base + cols[:, None] * DIM + offs_d[None, :]
    v_ptrs = v_base + _v_offsets(cols, offs_d, LAYOUT, CAP, DIM)
    if MASK_K:
        k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    if MASK_V:
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k.to(tl.float16)))
    if MASK_S:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, sm_scale, G: tl.constexpr, HKV_: tl.constexpr,
                      DIM: tl.constexpr, CAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                      TAIL: tl.constexpr, LAYOUT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    end = tl.load(len_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * (HKV_ * G * DIM) + heads[:, None] * DIM + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * (sm_scale * 1.4426950408889634)).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, DIM], dtype=tl.float32)
    k_base = k_ptr + (b * HKV_ + kvh) * (CAP * DIM)
    v_base = v_ptr + (b * HKV_ + kvh) * (CAP * DIM)
    if TAIL:
        full_end = end // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _block(q, k_base, v_base, n0, end, offs_n, offs_d, m_i, l_i, acc, False, False, False,
                                   LAYOUT, CAP, DIM)
        if full_end < end:
            m_i, l_i, acc = _block(q, k_base, v_base, full_end, end, offs_n, offs_d, m_i, l_i, acc, True, True,
                                   True, LAYOUT, CAP, DIM)
    else:
        for n0 in range(0, end, BLOCK_N):
            m_i, l_i, acc = _block(q, k_base, v_base, n0, end, offs_n, offs_d, m_i, l_i, acc, True, LAYOUT == 0,
                                   True, LAYOUT, CAP, DIM)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * (HKV_ * G * DIM) + heads[:, None] * DIM + offs_d[None, :], out.to(tl.bfloat16),
             mask=g_ok[:, None])


@triton.jit
def _v_offsets_1d(col, d, LAYOUT: tl.constexpr, CAP: tl.constexpr, DIM: tl.constexpr):
    if LAYOUT == 0:
        return col * DIM + d
    elif LAYOUT == 1:
        return col + d * CAP
    else:
        return (col // 16) * (16 * DIM) + d * 16 + col % 16


@triton.jit
def _write_kernel(x_ptr, k_ptr, v_ptr, pos_ptr, HKV_: tl.constexpr, DIM: tl.constexpr, CAP: tl.constexpr,
                  LAYOUT: tl.constexpr):
    """One token's keys and values of slot b, head h -> column pos[b] (E4M3 codes of x, plain cast)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, DIM)
    col = tl.load(pos_ptr + b)
    x = tl.load(x_ptr + (b * HKV_ + h) * DIM + d).to(tl.float8e4nv)
    base = (b * HKV_ + h) * (CAP * DIM)
    tl.store(k_ptr + base + col * DIM + d, x)
    tl.store(v_ptr + base + _v_offsets_1d(col, d, LAYOUT, CAP, DIM), x)


def to_layout(v: torch.Tensor, layout: str) -> torch.Tensor:
    """v [B, H, CAP, D] -> the flat buffer [B, H, CAP * D] of that layout."""
    B, H = v.shape[:2]
    if layout == "rows":
        return v.reshape(B, H, -1).contiguous()
    if layout == "columns":
        return v.transpose(2, 3).reshape(B, H, -1).contiguous()
    return v.reshape(B, H, CAPACITY // 16, 16, D).transpose(3, 4).reshape(B, H, -1).contiguous()


def attention(q, k, v, lengths, layout, tail, block_n, warps, stages):
    B = q.shape[0]
    out = torch.empty_like(q)
    _attention_kernel[(B, HKV)](q, k, v, lengths, out, D ** -0.5, G=HQ // HKV, HKV_=HKV, DIM=D, CAP=CAPACITY,
                                BLOCK_G=16, BLOCK_N=block_n, TAIL=tail, LAYOUT=LAYOUTS.index(layout),
                                num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 128])
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; context {args.context}; {args.layers} caches in turn")
    print("| batch | kernel | V layout | form | block_n | warps | stages | ms | floor ms | % floor | rel. err |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, HQ, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(batch, HKV, CAPACITY, D, device="cuda", generator=g).to(FP8_KV_DTYPE)
        v = torch.randn(batch, HKV, CAPACITY, D, device="cuda", generator=g).to(FP8_KV_DTYPE)
        lengths = torch.full((batch,), args.context, device="cuda", dtype=torch.int32)
        ragged = lengths.clone()
        ragged[::3] -= 37  # partial last blocks for the error check
        floor_ms = 1e3 * 2 * batch * HKV * args.context * D / bw
        ks = [k] + [k.clone() for _ in range(args.layers - 1)]
        ref = decode_attention_torch(q[:8].double(), k[:8], v[:8], ragged[:8], CAPACITY)
        vs = [v] + [v.clone() for _ in range(args.layers - 1)]
        ms = _graph_ms(torch, lambda: [decode_attention(q, kk[:, :, :args.context], vv[:, :, :args.context],
                                                        lengths) for kk, vv in zip(ks, vs)]) / args.layers
        print(f"| {batch} | production | rows | - | default | | | {ms:.4f} | {floor_ms:.4f} | "
              f"{100 * floor_ms / ms:.0f}% | - |", flush=True)
        for layout in LAYOUTS:
            lv = [to_layout(x, layout) for x in vs]
            for tail, block_n, warps, stages in [(False, 128, 4, 2), (True, 128, 4, 2), (False, 64, 2, 3),
                                                 (True, 64, 2, 3), (True, 128, 4, 3)]:
                form = "tail" if tail else "loop"
                try:
                    out = attention(q, k, lv[0], ragged, layout, True, block_n, warps, stages)
                    err = float((out[:8].double() - ref).norm() / ref.norm())
                    ms = _graph_ms(torch, lambda: [attention(q, kk, vv, lengths, layout, tail, block_n, warps,
                                                             stages) for kk, vv in zip(ks, lv)]) / args.layers
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    print(f"| {batch} | variant | {layout} | {form} | {block_n} | {warps} | {stages} | failed: "
                          f"{type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
                    continue
                print(f"| {batch} | variant | {layout} | {form} | {block_n} | {warps} | {stages} | {ms:.4f} | "
                      f"{floor_ms:.4f} | {100 * floor_ms / ms:.0f}% | {err:.1e} |", flush=True)
    # the per-step write: one token per slot and head, keys and values, 28 layers
    batch = max(args.batch)
    x = torch.randn(batch, HKV, D, device="cuda").bfloat16()
    pos = torch.full((batch,), args.context, device="cuda", dtype=torch.int64)
    print("\n| layout | write ms per step (28 layers, batch %d) |\n|---|---:|" % batch)
    for layout in LAYOUTS:
        caches = [(torch.zeros(batch, HKV, CAPACITY * D, device="cuda", dtype=FP8_KV_DTYPE),
                   torch.zeros(batch, HKV, CAPACITY * D, device="cuda", dtype=FP8_KV_DTYPE)) for _ in range(28)]
        ms = _graph_ms(torch, lambda: [_write_kernel[(batch, HKV)](x, kc, vc, pos, HKV_=HKV, DIM=D, CAP=CAPACITY,
                                                                   LAYOUT=LAYOUTS.index(layout), num_warps=1)
                                       for kc, vc in caches])
        print(f"| {layout} | {ms:.4f} |", flush=True)


if __name__ == "__main__":
    main()
