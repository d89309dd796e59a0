"""One-pass token sampling for the decode step: Gumbel-max draw and its log-prob from the raw logits.

The plain-torch step (`quarl.rollout.fast_step`) converts the [B, V] logits to float32, scales them, takes a
log-softmax, adds Gumbel noise, takes the argmax and gathers the log-prob: about ten passes over B x V values
(V = 152,064 for Qwen2.5, so each pass at B = 512 moves 300 MB). Here one program per row streams its logits and
noise once, keeping in registers
  * an online log-sum-exp of s = logits / temperature (running max m and sum l of exp(s - m));
  * the running argmax of z = s - log(-log u) (Gumbel-max; with `greedy`, of s itself) and s at that argmax;
and writes token = argmax z and logprob = s[token] - (m + log l). Ties go to the lowest index, as torch.argmax.

Same draw as the torch step up to float32 rounding: the reference adds the noise to s - lse, this kernel to s
(the constant shift does not change the argmax, but the rounding of the sum can differ in the last bit, which
only matters for near-exact ties). Only temperature sampling (top_k = 0, top_p = 1) and greedy decoding run
here; the filtered distributions keep the torch path.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _best_and_lse(best_z, best_i, best_s, m, l_sum):
    """Reduce per-lane (or per-range) running states to (z of the best, its index, its s, max m, sum of l scaled
    to that max, whether a NaN was seen): the best z with the lowest index among equal bests, NaN lanes first
    (NaN counts as the largest value, as in torch.argmax); lanes with m = -inf weigh nothing."""
    nan_lane = best_z != best_z
    any_nan = tl.max(nan_lane.to(tl.int32), axis=0) > 0
    z_max = tl.max(best_z, axis=0)
    best = tl.where(any_nan, nan_lane, best_z == z_max)
    i_min = tl.min(tl.where(best, best_i, 2147483647), axis=0)
    s_tok = tl.sum(tl.where(best_i == i_min, best_s, 0.0), axis=0)
    z_tok = tl.max(tl.where(best_i == i_min, best_z, float("-inf")), axis=0)
    z_tok = tl.where(any_nan, float("nan"), z_tok)
    m_all = tl.max(m, axis=0)
    l_all = tl.sum(tl.where(m > float("-inf"), l_sum * tl.exp(m - m_all), 0.0), axis=0)
    return z_tok, i_min, s_tok, m_all, l_all, any_nan


@triton.jit
def _store_draw(token_ptr, logprob_ptr, row, i_tok, s_tok, m_all, l_all, any_nan):
    """Token and log-prob of one row. A row holding a NaN, or no mass at all (every score -inf), reports a NaN
    log-prob; the token stays inside the vocabulary (the first NaN's index; 0 for a row without mass)."""
    no_mass = l_all == 0
    logprob = tl.where(any_nan | no_mass, float("nan"), s_tok - (m_all + tl.log(l_all)))
    tl.store(token_ptr + row, tl.where(i_tok == 2147483647, 0, i_tok).to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


@triton.jit
def _sample_kernel(logits_ptr, noise_ptr, token_ptr, logprob_ptr, part_ptr, V, stride_l, stride_n, inv_temp, chunk,
                   GREEDY: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Program (row, range of `chunk` columns). SPLIT: write the range's partial state (z, index, s, m, l) to
    part_ptr [B, ranges, 5] float32 for `_merge_kernel`; else the token and log-prob of the row (one range)."""
    row = tl.program_id(0).to(tl.int64)
    rng = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)  # per-lane running max of s
    l_sum = tl.zeros((BLOCK,), dtype=tl.float32)  # per-lane sum of exp(s - m)
    best_z = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)  # per-lane best z, its index and its s
    best_i = tl.full((BLOCK,), 2147483647, dtype=tl.int32)
    best_s = tl.zeros((BLOCK,), dtype=tl.float32)
    lo = rng * chunk
    hi = tl.minimum(lo + chunk, V)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        ok = idx < hi
        s = tl.load(logits_ptr + row * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
        if GREEDY:
            z = s
        else:
            u = tl.load(noise_ptr + row * stride_n + idx, mask=ok, other=0.0)
            z = s - tl.log(-tl.log(u))
        z = tl.where(ok, z, float("-inf"))
        # strict: an equal later value keeps the earlier (lower) index; NaN counts as the largest value (as in
        # torch.argmax), so a NaN row still yields an index inside the vocabulary
        take = (z > best_z) | ((z != z) & (best_z == best_z))
        best_z = tl.where(take, z, best_z)
        best_i = tl.where(take, idx, best_i)
        best_s = tl.where(take, s, best_s)
        m_new = tl.maximum(m, s)
        # exp(-inf - -inf) is NaN: lanes that have seen nothing finite yet keep l = 0
        l_sum = tl.where(m_new > float("-inf"), l_sum * tl.exp(m - m_new) + tl.exp(s - m_new), l_sum)
        m = m_new
    z_tok, i_tok, s_tok, m_all, l_all, any_nan = _best_and_lse(best_z, best_i, best_s, m, l_sum)
    if SPLIT:
        part = part_ptr + (row * tl.num_programs(1) + rng) * 5
        tl.store(part, z_tok)
        tl.store(part + 1, i_tok.to(tl.float32, bitcast=True))
        tl.store(part + 2, s_tok)
        tl.store(part + 3, m_all)
        tl.store(part + 4, l_all)
    else:
        _store_draw(token_ptr, logprob_ptr, row, i_tok, s_tok, m_all, l_all, any_nan)


@triton.jit
def _merge_kernel(part_ptr, token_ptr, logprob_ptr, RANGES, BLOCK_R: tl.constexpr):
    """One program per row: the ranges' partial states -> token and log-prob, with the same tie and NaN rules."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    ok = r < RANGES
    part = part_ptr + (row * RANGES + r) * 5
    z = tl.load(part, mask=ok, other=float("-inf"))
    i = tl.load(part + 1, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    i = tl.where(ok, i, 2147483647)
    s = tl.load(part + 2, mask=ok, other=0.0)
    m = tl.load(part + 3, mask=ok, other=float("-inf"))
    l_ = tl.load(part + 4, mask=ok, other=0.0)
    _, i_tok, s_tok, m_all, l_all, any_nan = _best_and_lse(z, i, s, m, l_)
    _store_draw(token_ptr, logprob_ptr, row, i_tok, s_tok, m_all, l_all, any_nan)


def default_ranges(rows: int) -> int:
    """Programs per row for `sample_rows`: enough rows x ranges (about 4096) to keep a large GPU's loads in flight,
    at most 32 per row."""
    return max(1, min(32, 4096 // max(rows, 1)))


def inverse_temperature(temperature: float) -> float:
    """float32(1 / float32(T)): the multiplier PyTorch's CUDA division by a Python scalar uses, so s = logits *
    it matches `logits / temperature` of the torch path bit for bit."""
    return float(torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32))


def column_ranges(rows: int, vocab: int, ranges: int | None, block: int) -> tuple[int, int]:
    """(ranges, columns per range) splitting a row of `vocab` into whole `block`s (every range holds at least one
    column); ranges None = `default_ranges(rows)`."""
    if ranges is None:
        ranges = default_ranges(rows)
    if ranges < 1 or block < 16 or block & (block - 1):
        raise ValueError(f"ranges must be >= 1 and block a power of two >= 16, got ranges={ranges}, block={block}")
    chunk = -(-vocab // ranges)
    chunk = -(-chunk // block) * block
    return max(1, -(-vocab // chunk)), chunk


def sample_rows(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, ranges: int | None = None,
                block: int = 1024, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits and the log-prob of the distribution it was drawn from.

    Args:
        logits: [B, V] bf16/fp16/fp32, last dim contiguous.
        noise: [>= B, V] float32 uniform draws in [0, 1) (rows 0..B-1 used); None for greedy decoding.
        temperature: > 0 for sampling (q = softmax(logits / temperature)); 0 = greedy (argmax of the logits,
            log-prob under softmax(logits)).
        ranges: programs per row, each over a range of columns, merged by a second small kernel (more loads in
            flight when a row's single program is latency-bound); 1 = one program per row. None: about 4096
            programs in all, at most 32 per row (`default_ranges`: a large vocabulary keeps a single program per
            row latency-bound).
        block, num_warps: columns per loop step and warps of each program.
    Returns:
        (tokens long [B], logprobs float32 [B]). A row holding a NaN gives the index of its first NaN score (a
        valid token, as torch.argmax does) and a NaN log-prob, so the caller can detect it; so does a row with no
        mass (every score -inf), with token 0.
    """
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    greedy = noise is None or temperature == 0
    if temperature > 0 and noise is None:
        raise ValueError(f"sampling at temperature {temperature} needs noise [>= {B}, {V}] uniform draws")
    if not greedy and (noise.shape[1] != V or noise.shape[0] < B or noise.stride(1) != 1):
        raise ValueError(f"noise must be [>= {B}, {V}] with contiguous rows, got {tuple(noise.shape)}")
    if not temperature >= 0:  # also NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    inv_temp = 1.0 if greedy else inverse_temperature(temperature)
    ranges, chunk = column_ranges(B, V, ranges, block)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    parts = torch.empty(B, ranges, 5, dtype=torch.float32, device=logits.device) if ranges > 1 else logprobs
    if B:
        _sample_kernel[(B, ranges)](
            logits, logits if greedy else noise, tokens, logprobs, parts, V, logits.stride(0),
            0 if greedy else noise.stride(0), inv_temp, chunk,
            GREEDY=greedy, BLOCK=block, SPLIT=ranges > 1, num_warps=num_warps,
        )
        if ranges > 1:
            _merge_kernel[(B,)](parts, tokens, logprobs, ranges, BLOCK_R=max(16, triton.next_power_of_2(ranges)))
    return tokens, logprobs
