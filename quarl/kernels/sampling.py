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
def _sample_kernel(logits_ptr, noise_ptr, token_ptr, logprob_ptr, V, stride_l, stride_n, inv_temp,
                   GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)  # per-lane running max of s
    l_sum = tl.zeros((BLOCK,), dtype=tl.float32)  # per-lane sum of exp(s - m)
    best_z = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)  # per-lane best z, its index and its s
    best_i = tl.full((BLOCK,), 2147483647, dtype=tl.int32)
    best_s = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        ok = idx < V
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
    # Reduce the lanes: the best z, lowest index among equal bests (NaN lanes first); the log-sum-exp of all lanes.
    nan_lane = best_z != best_z
    any_nan = tl.max(nan_lane.to(tl.int32), axis=0) > 0
    z_max = tl.max(best_z, axis=0)
    best = tl.where(any_nan, nan_lane, best_z == z_max)
    i_min = tl.min(tl.where(best, best_i, 2147483647), axis=0)
    s_tok = tl.sum(tl.where(best_i == i_min, best_s, 0.0), axis=0)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(l_sum * tl.exp(m - m_all), axis=0))
    logprob = tl.where(any_nan, float("nan"), s_tok - lse)  # a NaN row is reported, not hidden
    tl.store(token_ptr + row, i_min.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


def sample_rows(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits and the log-prob of the distribution it was drawn from.

    Args:
        logits: [B, V] bf16/fp16/fp32, last dim contiguous.
        noise: [>= B, V] float32 uniform draws in [0, 1) (rows 0..B-1 used); None for greedy decoding.
        temperature: > 0 for sampling (q = softmax(logits / temperature)); 0 = greedy (argmax of the logits,
            log-prob under softmax(logits)).
    Returns:
        (tokens long [B], logprobs float32 [B]). A row holding a NaN gives the index of its first NaN score (a
        valid token, as torch.argmax does) and a NaN log-prob, so the caller can detect it.
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
    # float32(1 / float32(T)): the multiplier PyTorch's CUDA division by a Python scalar uses, so s matches
    # `logits / temperature` of the torch path bit for bit.
    inv_temp = 1.0 if greedy else float(torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32))
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _sample_kernel[(B,)](
            logits, logits if greedy else noise, tokens, logprobs, V, logits.stride(0),
            0 if greedy else noise.stride(0), inv_temp,
            GREEDY=greedy, BLOCK=1024, num_warps=4,
        )
    return tokens, logprobs
