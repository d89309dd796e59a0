"""Inverse-CDF token sampling for the decode step: one uniform draw per row instead of one per logit.

`quarl.kernels.sampling` draws by Gumbel-max, which needs a [B, V] float32 uniform tensor refilled before every
step: at B = 512 and V = 152,064 that is 311 MB written by the generator and read back by the sampler, more than
the logits themselves (bench/results/sampling.md). Sampling by inverse CDF draws one u per row:
  1. per (row, range of columns): the running max m and sum l of exp(s - m) of s = logits / temperature (the
     same kernel as the greedy pass of `sampling`, which also finds each range's first NaN);
  2. per row: the ranges' masses w_r = l_r exp(m_r - M) (M the row's max), the target u * sum(w), the range
     where the running mass passes it, then a scan of that range's columns only (running sum of exp(s - M)) to
     the first column that passes it. The log-prob is s[token] - (M + log sum(w)).
The draw is exact up to float32 rounding of the running sums (a token's interval moves by ~1e-7 of the total
mass); the reported log-prob is that of the distribution itself. NaN, +inf and empty rows follow `sampling`: a
row holding a NaN gives its first NaN's index, else one holding +inf its first +inf's index, each with a NaN
log-prob; a row without mass gives token 0 and a NaN log-prob.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.sampling import _sample_kernel, column_ranges, inverse_temperature


@triton.jit
def _cdf_pick_kernel(logits_ptr, part_ptr, u_ptr, token_ptr, logprob_ptr, V, stride_l, stride_u, inv_temp, chunk,
                     RANGES, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the ranges' (m, l) from `_sample_kernel` (greedy, split) and one uniform -> token
    and log-prob, scanning only the range where the running mass passes u * total."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    ok = r < RANGES
    part = part_ptr + (row * RANGES + r) * 5
    z = tl.load(part, mask=ok, other=float("-inf"))  # NaN where the range holds a NaN
    first = tl.load(part + 1, mask=ok, other=0.0).to(tl.int32, bitcast=True)  # that NaN's index
    m = tl.load(part + 3, mask=ok, other=float("-inf"))
    l_ = tl.load(part + 4, mask=ok, other=0.0)
    # A NaN score, or a +inf one (its range's l is NaN then), makes the row's distribution undefined: its first
    # such index is the token (as in `sampling`: NaN first, then the argmax), with a NaN log-prob.
    any_nan = tl.max((z != z).to(tl.int32), axis=0) > 0
    m_all = tl.max(m, axis=0)
    bad = any_nan | (m_all == float("inf"))
    bad_index = tl.where(any_nan, tl.min(tl.where(z != z, first, 2147483647), axis=0),
                         tl.min(tl.where(m == float("inf"), first, 2147483647), axis=0))
    shift = tl.where((m_all > float("-inf")) & ~bad, m_all, 0.0)
    w = tl.where((m > float("-inf")) & ~bad, l_ * tl.exp(m - shift), 0.0)  # each range's mass, relative to e^shift
    total = tl.sum(w, axis=0)
    no_mass = total == 0
    rest = tl.load(u_ptr + row * stride_u) * total
    passed = tl.cumsum(w, axis=0) > rest
    pick = tl.min(tl.where(passed & (w > 0), r, BLOCK_R), axis=0)
    # float32 rounding can leave the target beyond the last running sum: the last range with mass then
    pick = tl.where(pick == BLOCK_R, tl.max(tl.where(w > 0, r, 0), axis=0), pick)
    rest = rest - tl.sum(tl.where(r < pick, w, 0.0), axis=0)
    lo = pick * chunk
    hi = tl.where(bad | no_mass, lo, tl.minimum(lo + chunk, V))  # nothing to scan then
    offs = tl.arange(0, BLOCK)
    token = pick * 0 - 1
    last = pick * 0 - 1
    acc = 0.0
    start = lo
    while (start < hi) & (token < 0):
        idx = start + offs
        s = tl.load(logits_ptr + row * stride_l + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_temp
        p = tl.where(s > float("-inf"), tl.exp(s - shift), 0.0)
        run = tl.cumsum(p, axis=0) + acc
        hit = tl.min(tl.where((run > rest) & (p > 0), idx, 2147483647), axis=0)
        token = tl.where(hit < 2147483647, hit, token)
        last = tl.maximum(last, tl.max(tl.where(p > 0, idx, -1), axis=0))
        acc += tl.sum(p, axis=0)
        start += BLOCK
    token = tl.where(token < 0, last, token)  # rounding left the target past the range's sum: its last token
    token = tl.where(bad, bad_index, tl.where(no_mass | (token < 0), 0, token))
    s_tok = tl.load(logits_ptr + row * stride_l + token).to(tl.float32) * inv_temp
    logprob = tl.where(bad | no_mass, float("nan"), s_tok - (shift + tl.log(total)))
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


def sample_rows_cdf(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, ranges: int | None = None,
                    block: int = 1024, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits by inverse CDF, and its log-prob.

    Args:
        logits: [B, V] bf16/fp16/fp32, last dim contiguous.
        uniforms: [>= B] or [>= B, 1] float32 draws in [0, 1), one per row (rows 0..B-1 used).
        temperature: > 0 (q = softmax(logits / temperature)); greedy decoding takes `sampling.sample_rows`.
        ranges, block, num_warps: as `sampling.sample_rows` (programs per row in the first pass, columns per
            loop step, warps per program).
    Returns:
        (tokens long [B], logprobs float32 [B]); NaN and empty rows as in the module docstring.
    """
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not temperature > 0:  # also NaN
        raise ValueError(f"inverse-CDF sampling needs a temperature > 0, got {temperature} (greedy: sample_rows)")
    if (uniforms.dim() not in (1, 2) or uniforms.shape[0] < B or uniforms.dim() == 2 and uniforms.shape[1] != 1
            or uniforms.dtype != torch.float32 or uniforms.device != logits.device):
        raise ValueError(f"uniforms must be float32 [>= {B}] or [>= {B}, 1] on {logits.device}, got "
                         f"{uniforms.dtype} {tuple(uniforms.shape)} on {uniforms.device}")
    u = uniforms if uniforms.dim() == 2 else uniforms[:, None]
    inv_temp = inverse_temperature(temperature)
    ranges, chunk = column_ranges(B, V, ranges, block)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    parts = torch.empty(B, ranges, 5, dtype=torch.float32, device=logits.device)
    if B:
        _sample_kernel[(B, ranges)](logits, logits, tokens, logprobs, parts, V, logits.stride(0), 0, inv_temp, chunk,
                                    GREEDY=True, BLOCK=block, SPLIT=True, num_warps=num_warps)
        _cdf_pick_kernel[(B,)](logits, parts, u, tokens, logprobs, V, logits.stride(0), u.stride(0), inv_temp, chunk,
                               ranges, BLOCK_R=max(16, triton.next_power_of_2(ranges)), BLOCK=block, num_warps=4)
    return tokens, logprobs
