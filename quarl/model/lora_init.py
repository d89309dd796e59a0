"""LoRA adapters that start as a correction of the quantized base (`lora.init=base_error`, qlora with a GPTQ base).

A qlora base Q = deq(quantize(W)) differs from the full-precision weight W by R = W - Q [out, in]. Over the
calibration inputs X [n, in] (whose second moment H = X^T X GPTQ has measured), the rank-r product B A that makes the
layer's output closest to full precision,

    minimise ||(R - B A) X^T||_F = ||(R - B A) L||_F   (H = L L^T),

is R L's best rank-r approximation carried back: B A = U_r U_r^T R, with U_r [out, r] the top r left singular vectors
of R L, i.e. the top r eigenvectors of R H R^T (Eckart-Young; LoftQ's one-step initialisation with an activation
weighting, as in QERA). The adapters then start where the layer is closest to full precision on the inputs it sees,
not at the quantized base: on SmolLM2-135M NVFP4 the model's KL to full precision falls from 0.031 (GPTQ base) to
0.003 at rank 32 (bench/qlora_base_error.py). Training moves both factors from there.

The product is split so that each rank-one part has equal norms in A and B (P = U_r^T R, p_i = ||P_i||):
B = U_r diag(sqrt p), A = diag(1 / sqrt p) P.
"""

from __future__ import annotations

import torch

DAMP = 0.01  # added to H's diagonal as a fraction of its mean diagonal: GPTQ's regularisation of the same objective


@torch.no_grad()
def base_error_adapters(residual: torch.Tensor, hessian: torch.Tensor,
                        rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A [rank, in], B [out, rank]) float32 with B @ A the rank-`rank` correction of `residual` that minimises the
    output error over the calibration inputs (module docstring), on residual's device; None where the damped
    Hessian cannot be factorised or the result is not finite (the caller keeps the usual start then).

    residual: R = W - deq(Q(W)) [out, in] (any float dtype); hessian: X^T X [in, in] of the layer's calibration
    inputs (symmetric positive semi-definite; damped here, left unchanged). rank > min(out, in) gives zero rows /
    columns beyond it. Computed in float64 (R H in float32): the eigen-decomposition of a [min(out, in)]^2 Gram
    matrix is the cost.
    The same inputs give the same bits on the same hardware, which sharded runs rely on (every rank computes the
    adapters of the whole model from the same averaged Hessians)."""
    out_features, in_features = residual.shape
    if hessian.shape != (in_features, in_features):
        raise ValueError(f"base_error_adapters: hessian must be [{in_features}, {in_features}] for a residual "
                         f"{tuple(residual.shape)}, got {tuple(hessian.shape)}")
    if rank < 1:
        raise ValueError(f"base_error_adapters needs rank >= 1, got {rank}")
    if not (torch.isfinite(residual).all() and torch.isfinite(hessian).all()):
        return None
    r64 = residual.double()
    mean_diag = hessian.diagonal().double().mean()
    damp = DAMP * mean_diag if mean_diag > 0 else 1.0
    r = min(rank, out_features, in_features)
    if out_features <= in_features:
        # U_r: the top eigenvectors of (R L)(R L)^T = R (H + damp I) R^T [out, out]. R H is taken in float32, so the
        # [in, in] Hessian is never copied (a wide down_proj's is GBs); the Gram matrix is summed in float64.
        rh = (residual.float() @ hessian.float()).double()
        _, vectors = torch.linalg.eigh(rh @ r64.t() + damp * (r64 @ r64.t()))
        u = vectors[:, -r:].flip(-1)
    else:
        # from the smaller side: (R L)^T (R L) = L^T R^T R L [in, in] gives V_r, and U_r = R L V_r / s_r
        h = hessian.to(torch.float64, copy=True)
        h.diagonal().add_(damp)
        factor, info = torch.linalg.cholesky_ex(h)
        if info.item() != 0:
            return None
        m = r64 @ factor
        values, vectors = torch.linalg.eigh(m.t() @ m)
        v = vectors[:, -r:].flip(-1)
        s = values[-r:].flip(-1).clamp_min(0).sqrt()
        u = (m @ v) / torch.where(s > 0, s, torch.ones_like(s))
    p = u.t() @ r64  # [r, in]
    norms = p.norm(dim=1)
    root = norms.sqrt()
    safe = torch.where(root > 0, root, torch.ones_like(root))
    a = torch.zeros(rank, in_features, dtype=torch.float64, device=residual.device)
    b = torch.zeros(out_features, rank, dtype=torch.float64, device=residual.device)
    a[:r] = p / safe[:, None]
    b[:, :r] = u * root
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    return a.float(), b.float()
