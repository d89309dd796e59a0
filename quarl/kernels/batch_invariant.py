"""Batch-invariant linear, RMSNorm and attention: each output row's bits depend on that row's inputs only.

cuBLAS, torch's reductions and flash attention pick their tiling, split-K and split-KV by the shapes of a call,
so a decode step (one token per sequence) and the training forward (every token of every sequence) sum the same
products in different orders and disagree in the last bits. A one-ulp difference is enough to move an 8-bit
activation code, which is why the unified flow's rollout and training differed (`mismatch/kl`) although they
multiply identical operands. Here every call of a function runs one compiled kernel with one fixed tiling,
whatever the number of rows, so the rollout and the training forward compute the same bits
(`precision.batch_invariant`):

  * `linear(x, w, bias, add)`: x [M, K] @ w[N, K]^T (+ bias [N]) (+ add [M, N]), float32 accumulation in K
    order, one rounding at the end. Tiles of 64 x 64 x 64 for every M.
  * `rms_norm(x, weight, eps, noise)`: one program per row, the sum of squares in one fixed-width reduction.
  * `attention(q, k, v, key_start, q_start, kv_len)`: causal flash attention that walks each row's keys in blocks
    of 64 counted from the row's first key, the same blocks for a query whether it sits in a training sequence
    or is the single query of a decode step; tiles of 64 queries (a decode step fills one row of its tile).
    The engine's slot cache and the training batch's left-padded rows feed the same function.

Backward passes are torch's (they need to be correct, not invariant): the linear's two GEMMs, a recompute of
`rms_norm_torch` for the norm, and of torch's SDPA over the same visible keys for attention. Needs Triton and CUDA
bf16/fp16 tensors (or Triton's interpreter on the CPU); the torch definitions (`linear_torch`, `rms_norm_torch`,
`attention_torch`) state the semantics and serve the tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from quarl.kernels import availability

LINEAR_BLOCK = 64  # M, N and K tile of the linear: fixed, so a row's sums never depend on the batch
ATTENTION_BLOCK_M = 64  # queries per attention tile (a decode step fills one)
ATTENTION_BLOCK_N = 64  # keys per block, counted from each row's first key


# ------------------------------------------------------------------------------------------------ linear
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(a_ptr, b_ptr, bias_ptr, add_ptr, out_ptr, M, N, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK)
    num_n = tl.cdiv(N, BLOCK)
    per_group = GROUP_M * num_n  # grouped order: neighbouring programs share weight tiles in L2
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK * stride_ak
        b_ptrs += BLOCK * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_ADD:
        add_ptrs = add_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        acc += tl.load(add_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _linear_forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                    add: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) (+ add [M, N]) -> [M, N] in x.dtype, no autograd."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    grid = (triton.cdiv(M, LINEAR_BLOCK) * triton.cdiv(N, LINEAR_BLOCK),)
    a_dummy = out  # never read: HAS_BIAS / HAS_ADD are false
    _linear_kernel[grid](x, w, a_dummy if bias is None else bias, a_dummy if add is None else add, out, M, N, K,
                         x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                         0 if add is None else add.stride(0), 0 if add is None else add.stride(1),
                         out.stride(0), out.stride(1), HAS_BIAS=bias is not None, HAS_ADD=add is not None,
                         BLOCK=LINEAR_BLOCK, GROUP_M=8, num_warps=4, num_stages=3)
    return out


class _Linear(torch.autograd.Function):
    """`_linear_forward` with torch's GEMMs for the gradients of x, w, bias and add (2-D x and add)."""

    @staticmethod
    def forward(ctx, x, w, bias, add):
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.has_add = bias is not None, add is not None
        return _linear_forward(x, w, bias, add)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad @ w if ctx.needs_input_grad[0] else None
        grad_w = (grad.t() @ x).to(w.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_add = grad if ctx.has_add and ctx.needs_input_grad[3] else None
        return grad_x, grad_w, grad_b, grad_add


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) (+ add [..., N]) -> [..., N] in x.dtype, with autograd; x, w (and
    bias, add) on one CUDA device in one 16-bit dtype. Row i of the result depends on row i of x (and of add)
    only, bit for bit (`linear_torch` is the definition)."""
    _check_cuda16("linear", x, w)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    add2d = None if add is None else add.reshape(-1, add.shape[-1])
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = _Linear.apply(x2d if x2d.stride(-1) == 1 else x2d.contiguous(), w, bias, add2d)
    return y.reshape(*lead, w.shape[0])


def linear_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 add: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of `linear`: float32 products and sums, rounded once to x.dtype."""
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if add is not None:
        y = y + add.float()
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------ RMSNorm
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, D, stride_x, stride_o, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   noise: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of `rms_norm`: x * rsqrt(mean(x^2) + eps) * (w + noise), in float32, cast to x.dtype."""
    xf = x.float()
    w = weight.float() if noise is None else weight.float() + noise.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """The row kernel forward; backward through a recompute of `rms_norm_torch` (gradients to x and the weight)."""

    @staticmethod
    def forward(ctx, x, weight, noise, eps):
        ctx.save_for_backward(x, weight, noise)
        ctx.eps = eps
        x2d = x.reshape(-1, x.shape[-1])
        x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
        w = weight.float() if noise is None else weight.float() + noise.float()
        out = torch.empty(x2d.shape, device=x.device, dtype=x.dtype)
        D = x2d.shape[1]
        if x2d.shape[0]:
            _rms_norm_kernel[(x2d.shape[0],)](x2d, w.contiguous(), out, x2d.shape[0], D, x2d.stride(0),
                                              out.stride(0), eps, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, noise = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = rms_norm_torch(xd, wd, ctx.eps, noise)
            grad_x, grad_w = torch.autograd.grad(y, (xd, wd), grad)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, noise: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., D] (CUDA, 16-bit) with weight [D] (+ float32 noise [D], added in float32: AQN) -> x's
    shape and dtype, with autograd (no gradient to the noise). One program per row (`rms_norm_torch`)."""
    _check_cuda16("rms_norm", x, None)
    return _RMSNorm.apply(x, weight, noise, float(eps))


# ------------------------------------------------------------------------------------------------ attention
@triton.jit(do_not_specialize=["T"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, key_start_ptr, q_start_ptr, kv_len_ptr, T, Hq, GROUP, D, scale,
                      sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, sob, soh, sot,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    key_start = tl.load(key_start_ptr + b)
    q_start = tl.load(q_start_ptr + b)
    kv_len = tl.load(kv_len_ptr + b)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = q_start + offs_m  # each query's own column: it sees keys key_start..cols
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < T
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    last = tl.minimum(q_start + tl.minimum((pid_m + 1) * BLOCK_M, T) - 1, kv_len - 1)
    k_base = k_ptr + b.to(tl.int64) * skb + hk * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk * svh
    # A block past a row's own column is fully masked for it: p = 0 and alpha = 1 leave its state unchanged, so
    # the blocks a tile's later rows add change no bit of the earlier rows'.
    for n0 in range(key_start, last + 1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * skn + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where((offs_n[None, :] <= cols[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query with no key (padding) gives 0
    tl.store(o_ptr + b.to(tl.int64) * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _attention_forward(q, k, v, key_start, q_start, kv_len) -> torch.Tensor:
    """The kernel's output [B, Hq, T, D] (stored as [B, T, Hq, D]); arguments as in `attention`, no autograd."""
    B, Hq, T, D = q.shape
    out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype).transpose(1, 2)  # o_proj's [B, T, H, D] memory
    if B == 0 or T == 0:
        return out
    grid = (B * Hq, triton.cdiv(T, ATTENTION_BLOCK_M))  # rows x heads on axis 0, which has no 65535 limit
    _attention_kernel[grid](q, k, v, out, key_start, q_start, kv_len, T, Hq, Hq // k.shape[1], D,
                            1.0 / math.sqrt(D), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                            k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
                            out.stride(2), BLOCK_M=ATTENTION_BLOCK_M, BLOCK_N=ATTENTION_BLOCK_N,
                            BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4, num_stages=2)
    return out


def visible_keys(key_start: torch.Tensor, q_start: torch.Tensor, kv_len: torch.Tensor, T: int,
                 S: int) -> torch.Tensor:
    """bool [B, 1, T, S]: query i of row b sees key j iff key_start[b] <= j <= q_start[b] + i and j < kv_len[b]."""
    j = torch.arange(S, device=key_start.device)
    cols = q_start[:, None] + torch.arange(T, device=key_start.device)[None, :]  # [B, T]
    seen = (j[None, None, :] >= key_start[:, None, None]) & (j[None, None, :] <= cols[:, :, None])
    return (seen & (j[None, None, :] < kv_len[:, None, None]))[:, None]


def attention_torch(q, k, v, key_start, q_start, kv_len) -> torch.Tensor:
    """The definition of `attention`, arguments and result alike: float32 scores and softmax, a query that sees no
    key gives 0."""
    B, Hq, T, D = q.shape
    S = k.shape[2]
    mask = visible_keys(key_start, q_start, kv_len, T, S)
    g = Hq // k.shape[1]
    kf = k[:B].float().repeat_interleave(g, dim=1)
    vf = v[:B].float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).to(q.dtype)


class _Attention(torch.autograd.Function):
    """The kernel forward; backward through a recompute with torch's SDPA over the same visible keys."""

    @staticmethod
    def forward(ctx, q, k, v, key_start, q_start, kv_len):
        ctx.save_for_backward(q, k, v, key_start, q_start, kv_len)
        return _attention_forward(q, k, v, key_start, q_start, kv_len)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, key_start, q_start, kv_len = ctx.saved_tensors
        B, rows = q.shape[0], k.shape[0]
        k, v = k[:B], v[:B]  # a slot cache's rows past the batch are not read (and get no gradient)
        mask = visible_keys(key_start, q_start, kv_len, q.shape[2], k.shape[2])
        seeing = mask.any(-1, keepdim=True)  # [B, 1, T, 1]
        # A query with no key output the constant 0: no gradient. It attends to every key in the recompute only to
        # keep SDPA's softmax finite.
        grad = grad * seeing.to(grad.dtype)
        mask = mask | ~seeing
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
            grad_q, grad_k, grad_v = torch.autograd.grad(out, (qd, kd, vd), grad)
        if rows > B:
            grad_k, grad_v = (torch.cat([g, g.new_zeros(rows - B, *g.shape[1:])]) for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: torch.Tensor, q_start: torch.Tensor,
              kv_len: torch.Tensor) -> torch.Tensor:
    """Causal attention whose rows are computed alike in any batch, with autograd.

    q [B, Hq, T, D]; k, v [>= B, Hkv, S, D] (a training batch's keys, or the engine's slot cache), q's dtype
    (CUDA, 16-bit), unit stride in D; query head h reads kv head h // (Hq / Hkv). Query i of row b sits at column
    q_start[b] + i and sees keys key_start[b] .. that column that are below kv_len[b] (long [B] each: 0, 0 and S
    for a right-padded batch, the first real column, 0 and S for a left-padded one; 0, position and position + 1
    for a decode step). Returns [B, Hq, T, D] in q's dtype, stored as [B, T, Hq, D] (`attention_torch`)."""
    _check_cuda16("attention", q, k)
    for name, t in (("key_start", key_start), ("q_start", q_start), ("kv_len", kv_len)):
        if t.dtype != torch.long or t.shape != (q.shape[0],) or t.device != q.device:
            raise ValueError(f"attention: {name} must be long [{q.shape[0]}] on {q.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if q.shape[1] % k.shape[1] or q.shape[3] != k.shape[3] or k.shape != v.shape or k.shape[0] < q.shape[0]:
        raise ValueError(f"attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("batch-invariant attention needs q, k and v contiguous in the head dimension")
    return _Attention.apply(q, k, v, key_start, q_start, kv_len)


def _check_cuda16(name: str, x: torch.Tensor, w: torch.Tensor | None) -> None:
    if not availability.triton_runs_on(x.device) or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"batch-invariant {name} runs on CUDA bf16/fp16 tensors, got {x.dtype} on {x.device}")
    if w is not None and (w.dtype != x.dtype or w.device != x.device):
        raise ValueError(f"batch-invariant {name}: operands in {x.dtype} on {x.device} and {w.dtype} on {w.device}; "
                         "pass both in one dtype on one device")
