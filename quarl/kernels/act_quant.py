"""Dynamic activation quantization for the 8-bit GEMMs: x [M, K] -> codes [M, Kp] + float32 scales.

Matches `quarl.formats.quantize(x, fmt, "activation")` bit for bit (same scale and rounding rules):
  int8 / fp8   one scale per row (token), scales [M, 1];
  fp8-block    one scale per 1x128 group, scales [M, Kp/128];
  fp8-tensor   one scale for the whole tensor (0-dim; its amax is a torch reduction, then this kernel).
Per-row scales: rows of up to 4096 columns are quantized in one pass from registers, longer rows walked twice
(amax, then codes): by one program per row, or, for a few rows, by a program per block that walks the whole row
for its amax and quantizes its own block. 1x128 groups and a given scale: a few rows are split over programs,
many rows walked once.

`fake_quantize_activation` runs the same kernel but writes dequantize(quantize(x)) in x's dtype instead of the
codes: the W8A8 values a bf16 GEMM multiplies where no 8-bit kernel is faster, in one pass instead of the dozen
elementwise PyTorch kernels of `quarl.formats.fake_quantize`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.formats.base import div_const
from quarl.formats.base import safe_scale as safe_scale_t
from quarl.kernels.quant_utils import quantize_tile, safe_scale

MODE_ROW, MODE_GROUP128, MODE_GIVEN = 0, 1, 2
# per-row scales: rows up to this many columns are quantized in one pass from registers (8 warps: 16 values a
# thread); longer rows are walked twice in blocks of this size
ROW_BLOCK_MAX = 4096
# 1x128 groups / a given scale with fewer rows than this: each row's blocks spread over programs
SPLIT_ROWS_BELOW = 1024
# per-row scales of rows longer than one block (up to MAX_UNROLL blocks), fewer rows than this (decode batches):
# each row's blocks spread over programs too, every program walking the whole row for its amax (the walk's loads
# all in flight, the repeats L2 hits) and quantizing its own block, instead of one program walking the row twice:
# with few rows, one program per row would leave most of the GPU idle
SPLIT_AMAX_ROWS_BELOW = 64
# a program's blocks are unrolled (their loads issued together) up to this many
MAX_UNROLL = 8


@triton.jit
def _quantize_store(v, s, q_row, k, ar, K, KP, IS_INT8: tl.constexpr, DEQUANT: tl.constexpr):
    """Columns k + ar of one row (ar: any shape of offsets): v float32 (ar's shape) divided by s (broadcastable
    to v) and stored at q_row + k + ar as codes (masked to KP: zero codes past K) or, DEQUANT, as code * s in q's dtype
    (masked to K)."""
    q = quantize_tile(v, s, IS_INT8)
    if DEQUANT:
        tl.store(q_row + k + ar, (q.to(tl.float32) * s).to(q_row.dtype.element_ty), mask=k + ar < K)
    else:
        if IS_INT8:
            q = q.to(tl.int8)
        else:
            q = q.to(tl.uint8, bitcast=True)
        tl.store(q_row + k + ar, q, mask=k + ar < KP)


@triton.jit
def _quantize_step(x_row, q_row, s_ptr, s, k, offs, row, K, KP, stride_sm, stride_sg, IS_INT8: tl.constexpr,
                   MODE: tl.constexpr, BLOCK: tl.constexpr, DEQUANT: tl.constexpr, SCALE_GIVEN: tl.constexpr):
    """Quantize one block of a row: columns k + offs (offs [BLOCK], or [BLOCK / 128, 128] for MODE 1). MODE 1
    computes and stores the groups' scales; MODE 0 the row's scale unless SCALE_GIVEN (then s is the row's, as
    for MODE 2)."""
    QMAX: tl.constexpr = 127.0 if IS_INT8 else 448.0
    v = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
    if MODE == 1:
        sg = safe_scale(tl.max(tl.abs(v), axis=1), QMAX)
        ar_g = tl.arange(0, BLOCK // 128)
        tl.store(s_ptr + row * stride_sm + (k // 128 + ar_g) * stride_sg, sg, mask=k // 128 + ar_g < KP // 128)
        _quantize_store(v, sg[:, None], q_row, k, offs, K, KP, IS_INT8, DEQUANT)
    elif SCALE_GIVEN:
        _quantize_store(v, s, q_row, k, offs, K, KP, IS_INT8, DEQUANT)
    else:
        s_row = safe_scale(tl.max(tl.abs(v), axis=0), QMAX)
        tl.store(s_ptr + row * stride_sm, s_row)
        _quantize_store(v, s_row, q_row, k, offs, K, KP, IS_INT8, DEQUANT)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, KP, steps, stride_xm, stride_qm, stride_sm, stride_sg,
                      IS_INT8: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, DEQUANT: tl.constexpr,
                      AMAX_PASS: tl.constexpr, AMAX_UNROLL: tl.constexpr, UNROLL: tl.constexpr):
    """x [M, K] bf16/fp16/fp32 -> q [M, KP] (int8, or fp8 as uint8 bytes; zero padding written), s float32
    (MODE 0: [M] at stride_sm, written; 1: [M, KP/128] at strides (stride_sm, stride_sg), written;
    2: one scale read from s_ptr).
    DEQUANT: q is [M, K] in q_ptr's float dtype and receives code * scale (rounded once from float32, as
    `QuantizedTensor.dequantize`) instead of the codes; the scales are still written.

    pid 0 picks the row, pid 1 a run of `steps` blocks of BLOCK columns, quantized one block after the other.
    MODE 0 with AMAX_PASS (rows longer than one block): each program first walks the whole row for its amax (the
    second walk, over its own blocks, hits L1/L2; the program with pid 1 = 0 stores the scale); without it the
    block is the whole row, quantized in one pass.
    UNROLL / AMAX_UNROLL: `steps` / the blocks of K known when compiling (0: not), the walks unrolled so
    that their loads are issued together instead of one block's round trip to memory after the other."""
    QMAX: tl.constexpr = 127.0 if IS_INT8 else 448.0
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 for long training batches
    ar = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if MODE == 1:  # [BLOCK / 128, 128]: a 1x128 group per row of the tile
        offs = tl.arange(0, BLOCK // 128)[:, None] * 128 + tl.arange(0, 128)[None, :]
    else:
        offs = ar
    s = 1.0
    if AMAX_PASS:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        if AMAX_UNROLL:
            for it in tl.static_range(AMAX_UNROLL):
                v = tl.load(x_row + it * BLOCK + ar, mask=it * BLOCK + ar < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        else:
            for it in range(0, tl.cdiv(K, BLOCK)):
                v = tl.load(x_row + it * BLOCK + ar, mask=it * BLOCK + ar < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        s = safe_scale(tl.max(amax, axis=0), QMAX)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + row * stride_sm, s)
    elif MODE == 2:
        s = tl.load(s_ptr)
    first = tl.program_id(1) * steps
    if UNROLL:
        for it in tl.static_range(UNROLL):
            _quantize_step(x_row, q_row, s_ptr, s, (first + it) * BLOCK, offs, row, K, KP, stride_sm, stride_sg,
                           IS_INT8, MODE, BLOCK, DEQUANT, AMAX_PASS or MODE == 2)
    else:
        for it in range(0, steps):
            _quantize_step(x_row, q_row, s_ptr, s, (first + it) * BLOCK, offs, row, K, KP, stride_sm, stride_sg,
                           IS_INT8, MODE, BLOCK, DEQUANT, AMAX_PASS or MODE == 2)


@triton.jit
def _column_groups_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om, BLOCK_N: tl.constexpr):
    """x [M, N] -> out [M, N] (x's dtype): every column's 128-row group (pid 0) rounded to FP8 E4M3 with its own
    scale and dequantized; pid 1 picks BLOCK_N columns. Rows past M load as 0 (they do not change the amax)."""
    rm = tl.program_id(0).to(tl.int64) * 128 + tl.arange(0, 128)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    v = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    s = safe_scale(tl.max(tl.abs(v), axis=0), 448.0)
    q = quantize_tile(v, s[None, :], False).to(tl.float32) * s[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def fake_quantize_columns(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] bf16/fp16/fp32 (rows contiguous) -> [M, N] in x.dtype: the FP8-block activation rounding of x^T
    (1x128 groups along M), returned untransposed, i.e. bit for bit
    `fake_quantize(x.t().contiguous(), "fp8-block", "activation").t()` without either transposed copy."""
    M, N = x.shape
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        _column_groups_kernel[(triton.cdiv(M, 128), triton.cdiv(N, 64))](
            x, out, M, N, x.stride(0), out.stride(0), BLOCK_N=64, num_warps=4)
    return out


@triton.jit
def _columns_to_rows_kernel(x_ptr, q_ptr, s_ptr, M, N, stride_xm, stride_qn, stride_sg, BLOCK_N: tl.constexpr):
    """x [M, N] -> q [N, MP] (uint8: the FP8 E4M3 codes of x^T in 1x128 groups along M; zero codes past M) and
    s [MP/128, N] float32 at row stride stride_sg. pid 0 picks a 128-row group of x, pid 1 BLOCK_N columns; the
    tile is quantized along its rows and written transposed (the transpose goes through shared memory)."""
    group = tl.program_id(0)
    rm = group.to(tl.int64) * 128 + tl.arange(0, 128)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    v = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=(rm[:, None] < M) & n_ok[None, :],
                other=0.0).to(tl.float32)
    s = safe_scale(tl.max(tl.abs(v), axis=0), 448.0)
    q = quantize_tile(v, s[None, :], False).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + rn[:, None].to(tl.int64) * stride_qn + rm[None, :], tl.trans(q), mask=n_ok[:, None])
    tl.store(s_ptr + group * stride_sg + rn, s, mask=n_ok)


def _check_rows_contiguous(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{what} needs a 2-D tensor with contiguous rows (column stride 1), got shape "
                         f"{tuple(x.shape)} strides {x.stride()}; pass x.contiguous()")


def quantize_columns_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] bf16/fp16/fp32 (rows contiguous) -> (codes [N, MP] float8_e4m3fn, scales [MP/128, N] float32),
    MP = M rounded up to 128: the FP8-block activation quantization of x^T (1x128 groups along M) in one pass,
    without a transposed copy of x. codes and scales.t() equal `quantize(x.t(), "fp8-block", "activation")`'s
    data and scale bit for bit; scales.t() is the outer-dim-major layout torch._scaled_mm's 1x128 scaling reads.
    The weight-gradient operands of FP8 training (`quarl.kernels.training_gemm`)."""
    _check_rows_contiguous(x, "quantize_columns_transposed")
    M, N = x.shape
    mp = -(-M // 128) * 128
    codes = torch.empty((N, mp), dtype=torch.uint8, device=x.device)
    scales = torch.empty((mp // 128, N), dtype=torch.float32, device=x.device)
    if mp and N:
        _columns_to_rows_kernel[(mp // 128, triton.cdiv(N, 64))](
            x, codes, scales, M, N, x.stride(0), codes.stride(0), scales.stride(0), BLOCK_N=64, num_warps=4)
    return codes.view(torch.float8_e4m3fn), scales


@triton.jit
def _rows_and_columns_kernel(x_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, M, C, stride_xm, stride_qr, stride_qt):
    """One 128 x 128 tile of x [M, C] (pid 0 rows, pid 1 columns; tiles past C load as zeros) quantized both ways:
    qr [M, CP] / sr [CP/128, M] (each row of x in 1x128 groups along C: the activation codes, scales laid out
    column-major) and qt [C, MP] / st [MP/128, C] (each column of x in 128-row groups: the codes of x^T)."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rm = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
    rc = pid_c * 128 + tl.arange(0, 128)
    m_ok = rm < M
    c_ok = rc < C
    v = tl.load(x_ptr + rm[:, None] * stride_xm + rc[None, :], mask=m_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    sr = safe_scale(tl.max(tl.abs(v), axis=1), 448.0)
    qr = quantize_tile(v, sr[:, None], False).to(tl.uint8, bitcast=True)
    tl.store(qr_ptr + rm[:, None] * stride_qr + rc[None, :], qr, mask=m_ok[:, None])
    tl.store(sr_ptr + pid_c * M + rm, sr, mask=m_ok)
    st = safe_scale(tl.max(tl.abs(v), axis=0), 448.0)
    qt = quantize_tile(v, st[None, :], False).to(tl.uint8, bitcast=True)
    tl.store(qt_ptr + rc[:, None].to(tl.int64) * stride_qt + rm[None, :], tl.trans(qt), mask=c_ok[:, None])
    tl.store(st_ptr + pid_m * C + rc, st, mask=c_ok)


def quantize_rows_and_columns(x: torch.Tensor, cp: int | None = None, num_warps: int = 4
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, C] bf16/fp16/fp32 (rows contiguous) quantized to FP8-block codes both ways in one pass:

    row_codes [M, CP] float8_e4m3fn, row_scales [M, CP/128] float32 (a column-major view): each row of x in 1x128
        groups along C, bit for bit `quantize_activation(x, "fp8-block", CP, scales_column_major=True)`;
    col_codes [C, MP] float8_e4m3fn, col_scales [MP/128, C] float32: each column in 128-row groups, bit for bit
        `quantize_columns_transposed(x)`.
    CP (default C rounded up to 128) may be larger, a multiple of 128: zero codes with scale 1 fill it. MP is M
    rounded up to 128. FP8 training reads x (and the output gradient) once for its two GEMMs this way.
    num_warps: per 128 x 128 tile; 4 was the fastest of 4 / 8 / 16 at training shapes (bench/results/gemm.md).
    This pass saves a launch and x's second read, not GPU time (each program loads one tile, then computes, then
    stores).
    """
    _check_rows_contiguous(x, "quantize_rows_and_columns")
    M, C = x.shape
    cp = -(-C // 128) * 128 if cp is None else cp
    if cp % 128 or cp < C:
        raise ValueError(f"cp must be a multiple of 128 and at least C={C}, got {cp}")
    mp = -(-M // 128) * 128
    row_codes = torch.empty((M, cp), dtype=torch.uint8, device=x.device)
    row_scales = torch.empty((cp // 128, M), dtype=torch.float32, device=x.device)
    col_codes = torch.empty((C, mp), dtype=torch.uint8, device=x.device)
    col_scales = torch.empty((mp // 128, C), dtype=torch.float32, device=x.device)
    if M and cp:
        _rows_and_columns_kernel[(mp // 128, cp // 128)](
            x, row_codes, row_scales, col_codes, col_scales, M, C, x.stride(0), row_codes.stride(0),
            col_codes.stride(0), num_warps=num_warps)
    return (row_codes.view(torch.float8_e4m3fn), row_scales.t(), col_codes.view(torch.float8_e4m3fn),
            col_scales)


def quantize_activation(x: torch.Tensor, fmt: str, kp: int, scales_column_major: bool = False,
                        block: int | None = None, num_warps: int | None = None,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (codes [M, kp] int8 / float8_e4m3fn, float32 scales) for fmt in
    "int8", "fp8" (scales [M, 1]), "fp8-block" (scales [M, kp/128]), "fp8-tensor" (scale 0-dim).

    scales_column_major: fp8-block scales laid out column-major (a transposed [kp/128, M] buffer), the layout
    torch._scaled_mm's blockwise scaling expects.
    block, num_warps: columns per program or loop step (a power of two >= 128) and warps per program. Default
        block: kp rounded up to a power of two, at most ROW_BLOCK_MAX for per-row scales (longer rows are walked
        in blocks) and at most 1024 otherwise. Default warps: 4, or block / 512 when larger (at most 8).
    kp: codes per row, at least K (fp8-block: a multiple of 128; columns past K get zero codes).
    out: (codes, scales) to write instead of new tensors, for per-row scales ("int8", "fp8") only: codes [M, kp]
        (int8, or float8_e4m3fn / uint8 bytes; rows contiguous, any row stride), scales float32 with M values, one
        per row at a fixed stride ([M], [M, 1]). Returned as given (fp8 codes viewed as float8_e4m3fn).
    """
    is_int8 = fmt == "int8"
    if out is not None:
        codes, scales = _checked_out(x, fmt, kp, *out)
        _launch(x, codes, fmt, kp, False, dequant=False, block=block, num_warps=num_warps, scales=scales)
        return (out[0] if is_int8 else out[0].view(torch.float8_e4m3fn)), out[1]
    codes = torch.empty((x.shape[0], kp), dtype=torch.int8 if is_int8 else torch.uint8, device=x.device)
    scales = _launch(x, codes, fmt, kp, scales_column_major, dequant=False, block=block, num_warps=num_warps)
    return (codes if is_int8 else codes.view(torch.float8_e4m3fn)), scales


def _checked_out(x: torch.Tensor, fmt: str, kp: int, codes: torch.Tensor, scales: torch.Tensor):
    """The (codes, scales [M, 1] view) a per-row quantization of x [M, K] writes into, checked."""
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"quantize_activation writes into given buffers for per-row formats only, not {fmt!r}")
    want = torch.int8 if fmt == "int8" else (torch.float8_e4m3fn, torch.uint8)
    m = x.shape[0]
    if codes.dtype not in (want if isinstance(want, tuple) else (want,)) or codes.shape != (m, kp) or \
            (kp and codes.stride(1) != 1) or codes.device != x.device:
        raise ValueError(f"{fmt} codes out must be [{m}, {kp}] {want} with contiguous rows on {x.device}, got "
                         f"{tuple(codes.shape)} {codes.dtype} strides {codes.stride()} on {codes.device}")
    if scales.dtype != torch.float32 or scales.numel() != m or scales.device != x.device:
        raise ValueError(f"scales out must be {m} float32 values on {x.device}, got {tuple(scales.shape)} "
                         f"{scales.dtype} on {scales.device}")
    return codes.view(torch.uint8) if fmt == "fp8" else codes, scales.view(m, 1)


def fake_quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32 (rows contiguous) -> [M, K] in x.dtype, bit for bit
    `quarl.formats.fake_quantize(x, fmt, "activation")` for fmt in "int8", "fp8", "fp8-block", "fp8-tensor"."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kp = -(-x.shape[1] // 128) * 128 if fmt == "fp8-block" else x.shape[1]
    _launch(x, out, fmt, kp, False, dequant=True)
    return out


def _launch(x: torch.Tensor, out: torch.Tensor, fmt: str, kp: int, scales_column_major: bool,
            dequant: bool, block: int | None = None, num_warps: int | None = None,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    """Run `_act_quant_kernel` on x [M, K] into out (codes [M, kp], or values [M, K] with dequant); returns the
    float32 scales (see `quantize_activation`), written into `scales` ([M, 1], per-row formats) when given."""
    M, K = x.shape
    if kp < K:
        raise ValueError(f"kp (codes per row) must be at least K={K}, got {kp}")
    if fmt == "fp8-block":
        mode = MODE_GROUP128
        if scales_column_major:
            scales = torch.empty((kp // 128, M), dtype=torch.float32, device=x.device).t()
        else:
            scales = torch.empty((M, kp // 128), dtype=torch.float32, device=x.device)
    elif fmt == "fp8-tensor":
        amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
        scales = safe_scale_t(div_const(amax, 448.0))  # as quarl.formats, bit for bit on every device
        mode = MODE_GIVEN
    else:
        mode = MODE_ROW
        scales = torch.empty((M, 1), dtype=torch.float32, device=x.device) if scales is None else scales
    if block is None:
        # per-row scales: the whole row in one block up to ROW_BLOCK_MAX columns (every load in flight at once),
        # in blocks of that size beyond (fastest at decode shapes, bench/results/gemm.md)
        block = min(triton.next_power_of_2(max(kp, 128)), ROW_BLOCK_MAX if mode == MODE_ROW else 1024)
    elif block < 128 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 128 (whole 1x128 groups), got {block}")
    if num_warps is None:
        num_warps = max(4, min(8, block // 512))
    n_blocks = triton.cdiv(kp, block)
    amax_pass = mode == MODE_ROW and n_blocks > 1
    amax_blocks = triton.cdiv(K, block)  # the amax walk skips blocks of padding codes only
    # a few rows: their blocks spread over programs (groups and a given scale need no whole-row amax; per-row
    # scales below SPLIT_AMAX_ROWS_BELOW rows walk the whole row in every program, so only while that walk is
    # unrolled: its reads grow with the square of the block count); many rows: a program per row walks its
    # blocks (fewer, longer programs keep long batches faster)
    if amax_pass:
        split = n_blocks if M < SPLIT_AMAX_ROWS_BELOW and amax_blocks <= MAX_UNROLL else 1
    else:
        split = n_blocks if M < SPLIT_ROWS_BELOW else 1
    steps = n_blocks // split  # blocks per program
    if kp == 0:  # no columns: nothing to launch; an empty row's scale is 1
        if mode == MODE_ROW:
            scales.fill_(1.0)
    elif M > 0:
        _act_quant_kernel[(M, split)](
            x, out, scales, K, kp, steps, x.stride(0), out.stride(0),
            scales.stride(0) if scales.dim() else 0, scales.stride(1) if scales.dim() == 2 else 1,
            IS_INT8=fmt == "int8", MODE=mode, BLOCK=block, DEQUANT=dequant, AMAX_PASS=amax_pass,
            AMAX_UNROLL=amax_blocks if amax_pass and amax_blocks <= MAX_UNROLL else 0,
            UNROLL=steps if steps <= MAX_UNROLL else 0, num_warps=num_warps,
        )
    return scales
