"""GPTQ for the frozen quantized base of a qlora run (`precision.base_quantizer=gptq`).

Rounding each weight to its nearest code (RTN, what `quarl.formats.quantize` does) treats every weight alone. GPTQ
(Frantar et al., 2022) quantizes a linear's weight W [out, in] one input column at a time and, after each column,
moves its rounding error onto the columns not yet quantized, weighted by the inverse of the layer's input Hessian
H = X^T X (X [tokens, in]: the linear's inputs on calibration text). Its codes minimise the layer's output error
||X W^T - X Q^T||^2 much better than RTN's; at 4 bits on a small model the difference is most of the accuracy
(bench/results/quality.md: SmolLM2-135M keeps a quarter of its held-out accuracy under RTN NVFP4).

The result is an ordinary QuantizedTensor in the format's own layout (codes, block scales, tensor scale), so every
kernel and the training forward use it as they use RTN's. Per format:
  nvfp4   the tensor scale from max|W| as RTN takes it; each 16-column block's E4M3 scale from the block's values
          as GPTQ reaches it (already carrying the earlier columns' errors), then E2M1 codes under it;
  mxfp4   each 32-column block's E8M0 scale likewise;
  int8    the per-row scale from the original row (a row's scale cannot wait for its last column).
With H = identity no error moves and GPTQ gives RTN's codes exactly (the tests check it).

Calibration follows SmoothQuant's (`quarl.model.smoothing`): the run's first training prompts with their gold
answers, through the model in full precision, before it is quantized. The batches go through the decoder one layer
at a time (one forward in all); Hessians are gathered over consecutive layers up to `HESSIAN_BYTES` (a 135M model's
all at once, a 7B model's one layer at a time) and quantized together, the groups of like shape sharing one pass
over their columns, so memory stays at a few times that bound plus the batches' hidden states whatever the model
size. The codes wait on the CPU until the base exists. Mixture-of-experts blocks keep RTN.

A run keeps its GPTQ base in RUN_DIR/base_gptq.safetensors (`save_base_codes`), written once when the run starts:
resuming, `quarl export` and the end-of-run export load it (`load_base_codes`) rather than calibrating again, so the
adapters always meet the base they were trained against.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.formats import QuantizedTensor, e2m1
from quarl.formats.fp4 import (MXFP4_BLOCK, NVFP4_BLOCK, e8m0_to_float, mxfp4_exponent, nvfp4_block_scale,
                               nvfp4_codes, nvfp4_global_scale)
from quarl.formats.int8 import int8_codes, int8_scale
from quarl.model.lora_init import base_error_adapters

DAMP = 0.01  # added to H's diagonal, as a fraction of its mean diagonal (the GPTQ paper's default)
BLOCK_COLUMNS = 128  # columns whose errors are applied together (a multiple of every format's block)
CALIBRATION_PROMPTS = 128  # training prompts (with their gold answers) whose inputs make the Hessians
# Hessians gathered (over consecutive layers) before quantizing them together: the groups of like shape across
# layers share one pass over their columns (a 135M model's 30 layers at once; a 7B model's one at a time)
HESSIAN_BYTES = 1 << 30
BASE_CODES_FILE = "base_gptq.safetensors"  # a run's GPTQ base, in its run directory


class _Grid:
    """One format's codes for GPTQ on weights [C, R, K] (C independent problems, R rows: the linears that share an
    input, stacked): per-group scales fixed when GPTQ reaches a group, then one column [C, R] at a time. The scale
    and code rules are the format's own (`quarl.formats.fp4`, `quarl.formats.int8`)."""

    fmt = ""
    group = 0  # columns sharing a scale; 0 = the whole row (the scale comes from the original row)

    def __init__(self, w: torch.Tensor, rows: list[int]):
        self.rows = rows  # each linear's row count, in stacking order
        self.codes: list[torch.Tensor] = []  # per column: codes [C, R]
        self.scales: list[torch.Tensor] = []  # per group: scales [C, R]

    def start_group(self, block: torch.Tensor) -> None:
        """The scales of the next group from its current values block [C, R, group]."""
        raise NotImplementedError

    def quantize_column(self, col: torch.Tensor) -> torch.Tensor:
        """Codes of one column [C, R] under the current group's scales (kept); returns their values float32."""
        raise NotImplementedError

    def data(self, codes: torch.Tensor) -> torch.Tensor:
        """The stored codes [C, R, ...] from the columns' codes [C, R, Kp]: packed two per byte (E2M1)."""
        return e2m1.pack(codes)

    def scale_tensor(self) -> torch.Tensor:
        """The stored scales [C, R, groups]."""
        return torch.stack(self.scales, dim=-1)

    def global_scale_of(self, c: int, linear: int) -> torch.Tensor | None:
        return None

    def assemble(self, k: int) -> list[list[QuantizedTensor]]:
        """[c][linear] weight QuantizedTensors [rows, k] in the format's layout."""
        data = self._split(self.data(torch.stack(self.codes, dim=-1)))
        scales = self._split(self.scale_tensor())
        return [[QuantizedTensor(self.fmt, "weight", d, sc, self.global_scale_of(c, i), torch.Size((d.shape[0], k)))
                 for i, (d, sc) in enumerate(zip(data[c], scales[c]))] for c in range(len(data))]

    def _split(self, t: torch.Tensor) -> list[list[torch.Tensor]]:
        """t [C, R, ...] -> [c][linear] row blocks."""
        return [list(torch.split(t[c], self.rows)) for c in range(t.shape[0])]


class _NVFP4(_Grid):
    fmt, group = "nvfp4", NVFP4_BLOCK

    def __init__(self, w: torch.Tensor, rows: list[int]):
        super().__init__(w, rows)
        # each linear's tensor scale from its max |W|, as round-to-nearest takes it
        amax = torch.stack([part.abs().amax(dim=(1, 2)) for part in torch.split(w, rows, dim=1)], dim=1)
        self.global_scale = nvfp4_global_scale(amax)  # [C, linears]
        self.row_global = torch.repeat_interleave(self.global_scale, torch.tensor(rows, device=w.device), dim=1)

    def start_group(self, block: torch.Tensor) -> None:
        self.block_scale = nvfp4_block_scale(block.abs().amax(dim=-1), self.row_global)
        self.scales.append(self.block_scale)
        self.step = self.block_scale.to(torch.float32) * self.row_global  # the rounded scale the kernels see

    def quantize_column(self, col: torch.Tensor) -> torch.Tensor:
        codes = nvfp4_codes(col, self.step)
        self.codes.append(codes)
        return (e2m1.decode(codes) * self.block_scale.to(torch.float32)) * self.row_global  # as dequantize

    def global_scale_of(self, c: int, linear: int) -> torch.Tensor:
        return self.global_scale[c, linear]


class _MXFP4(_Grid):
    fmt, group = "mxfp4", MXFP4_BLOCK

    def start_group(self, block: torch.Tensor) -> None:
        exponent = mxfp4_exponent(block.abs().amax(dim=-1))
        self.scales.append(exponent)
        self.step = e8m0_to_float(exponent)

    def quantize_column(self, col: torch.Tensor) -> torch.Tensor:
        codes = e2m1.encode((col / self.step).clamp_(-e2m1.E2M1_MAX, e2m1.E2M1_MAX))
        self.codes.append(codes)
        return e2m1.decode(codes) * self.step


class _INT8(_Grid):
    fmt = "int8"

    def __init__(self, w: torch.Tensor, rows: list[int]):
        super().__init__(w, rows)
        self.scale = int8_scale(w.abs().amax(dim=-1))  # per row, from the original row

    def quantize_column(self, col: torch.Tensor) -> torch.Tensor:
        codes = int8_codes(col, self.scale)
        self.codes.append(codes.to(torch.int8))
        return codes * self.scale

    def data(self, codes: torch.Tensor) -> torch.Tensor:
        return codes

    def scale_tensor(self) -> torch.Tensor:
        return self.scale[..., None]


_GRIDS = {"nvfp4": _NVFP4, "mxfp4": _MXFP4, "int8": _INT8}


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, fmt: str, damp: float = DAMP) -> QuantizedTensor:
    """The GPTQ-quantized weight of w [out, in] (any float dtype; quantized from its float32 values) in `fmt`
    ("nvfp4", "mxfp4", "int8"), as a weight QuantizedTensor laid out as `quarl.formats.quantize(w, fmt)` lays it
    out. hessian: [in, in], X^T X of the linear's calibration inputs X [tokens, in] (any positive scale; float32
    or wider). Input channels the calibration never saw (a zero diagonal) are rounded alone, moving no error."""
    return gptq_quantize_many([[w]], hessian[None], fmt, damp)[0][0]


@torch.no_grad()
def gptq_quantize_many(weights: list[list[torch.Tensor]], hessians: torch.Tensor, fmt: str,
                       damp: float = DAMP, on_columns=None) -> list[list[QuantizedTensor]]:
    """`gptq_quantize` of many weights at once: weights[c] are the linears that read input c (each [out_i, in],
    stacked along rows: GPTQ treats rows independently), hessians [C, in, in] that input's X^T X; every c holds
    the same row counts (e.g. one decoder layer's q/k/v per c). One pass over the columns serves them all.
    on_columns: called with C x the columns done after each block of them (progress). Returns [c][linear]
    QuantizedTensors."""
    if fmt not in _GRIDS:
        raise ValueError(f"GPTQ quantizes {', '.join(_GRIDS)}, not {fmt!r}")
    rows = [w.shape[0] for w in weights[0]]
    if any([w.shape[0] for w in ws] != rows for ws in weights):
        raise ValueError("gptq_quantize_many needs the same linears' shapes for every input")
    k = weights[0][0].shape[1]
    if hessians.shape != (len(weights), k, k):
        raise ValueError(f"the Hessians of {len(weights)} inputs of {k} channels must be [{len(weights)}, {k}, {k}], "
                         f"got {tuple(hessians.shape)}")
    device = weights[0][0].device
    w32 = torch.stack([torch.cat([w.detach().float() for w in ws]) for ws in weights])  # [C, R, K]
    grid = _GRIDS[fmt](w32, rows)
    group = grid.group
    kp = k if not group else -(-k // group) * group  # the format pads K to whole blocks with zeros
    W = torch.zeros((*w32.shape[:2], kp), dtype=torch.float32, device=device)
    W[..., :k] = w32
    H = torch.zeros((len(weights), kp, kp), dtype=torch.float32, device=device)
    H[:, :k, :k] = hessians.float()
    diagonal = H.diagonal(dim1=-2, dim2=-1)  # a view: writes go into H
    diagonal[diagonal == 0] = 1.0  # unseen (and padding) channels: rounded alone, no error moves through them
    u = _inverse_cholesky(H, damp)
    for start in range(0, kp, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, kp)
        block = W[..., start:end].clone()
        errors = torch.empty_like(block)
        for i in range(end - start):
            if group and i % group == 0:
                grid.start_group(block[..., i:i + group])
            q = grid.quantize_column(block[..., i])
            err = (block[..., i] - q) / u[:, start + i, start + i, None]
            block[..., i:] -= err[..., None] * u[:, None, start + i, start + i:end]
            errors[..., i] = err
        W[..., end:] -= errors @ u[:, start:end, end:]
        if on_columns is not None:
            on_columns(len(weights) * (min(end, k) - min(start, k)))
    return grid.assemble(k)


DAMP_TRIES = 4  # a Hessian whose factorisation fails is damped 10x more, up to this many times


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """U [C, K, K]: the upper Cholesky factor of (H + λI)^-1 per problem (row j holds how column j's error spreads
    over the columns after it), λ = damp x the mean diagonal of H [C, K, K] (float32, modified in place). A problem
    whose factorisation fails in float32 is damped 10x more, up to `DAMP_TRIES` times; one that still fails gets
    U = I, which is round-to-nearest for its weights (reported once as a fallback)."""
    from quarl.fallbacks import report_fallback

    mean = H.diagonal(dim1=-2, dim2=-1).mean(dim=-1)  # [C]
    u = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device).repeat(H.shape[0], 1, 1)
    todo = torch.ones(H.shape[0], dtype=torch.bool, device=H.device)
    added = torch.zeros_like(mean)
    for attempt in range(DAMP_TRIES):
        extra = damp * 10.0 ** attempt * mean - added  # from the damping already added to the total asked now
        H.diagonal(dim1=-2, dim2=-1).add_(torch.where(todo, extra, 0.0)[:, None])
        added = torch.where(todo, added + extra, added)
        lower, info = torch.linalg.cholesky_ex(H[todo])
        inverse = torch.cholesky_inverse(lower)
        upper, info2 = torch.linalg.cholesky_ex(inverse, upper=True)
        ok = (info == 0) & (info2 == 0) & torch.isfinite(upper).all(dim=(-2, -1))
        index = todo.nonzero().squeeze(1)
        u[index[ok]] = upper[ok]
        todo[index[ok]] = False
        if not bool(todo.any()):
            return u
    report_fallback("GPTQ", f"{int(todo.sum())} input Hessian(s) could not be factorised even with "
                    f"{damp * 10.0 ** (DAMP_TRIES - 1):g} x their mean diagonal added: their linears keep "
                    "round-to-nearest codes")
    return u


@torch.no_grad()
def layer_hessians(layer: nn.Module, groups: list[list[nn.Module]], states: list[tuple]) -> list[torch.Tensor]:
    """Run `layer` on each batch state (x, cos, sin, attn_mask, real: what `QuarlForCausalLM.layer_inputs` gives,
    and a bool [B * T] of the real, not padding, positions), replacing each state's x by the layer's output, and
    return X^T X (float32 [in, in]) of each group's input over the real positions."""
    hessians = [torch.zeros(g[0].in_features, g[0].in_features, device=g[0].weight.device) for g in groups]
    real = {}

    def hook(index):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if real["mask"].numel() != x.shape[0]:  # padding would enter the Hessian unseen
                raise RuntimeError(f"GPTQ calibration: {type(module).__name__} got {x.shape[0]} rows for a batch of "
                                   f"{real['mask'].numel()} positions")
            x = x[real["mask"]].float()
            hessians[index].addmm_(x.t(), x)
        return record

    handles = [group[0].register_forward_pre_hook(hook(i)) for i, group in enumerate(groups)]
    try:
        for i, (x, cos, sin, attn_mask, mask) in enumerate(states):
            real["mask"] = mask
            states[i] = (layer(x, cos, sin, attn_mask), cos, sin, attn_mask, mask)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


@torch.no_grad()
def gptq_base(model: nn.Module, fmt: str, batches, combine=None, weight_dtype: torch.dtype | None = None,
              progress: bool = False, adapters: dict | None = None,
              adapter_rank: int = 0) -> dict[nn.Module, QuantizedTensor]:
    """GPTQ codes for every dense decoder linear of a full-precision model (before `apply_precision` quantizes
    its base): {linear: weight QuantizedTensor}, to load with `QuantLinear.load_frozen_base_codes` once the base
    exists. batches: (input_ids long [B, T], attention_mask [B, T]) pairs (`smoothing.calibration_batches`).
    combine: maps each Hessian to the one to use (e.g. the mean over ranks); None = as measured. weight_dtype: the
    weights are rounded to it first (the compute dtype, as `QuantLinear` rounds a weight before quantizing it).
    adapters, adapter_rank >= 1: also fills adapters[linear] = (A [rank, in], B [out, rank]) float32 on the CPU,
    the rank-`adapter_rank` correction of that linear's base error through the same Hessian
    (`quarl.model.lora_init`, `lora.init=base_error`). Raises ValueError for a model whose base is quantized
    already (no full-precision weights left)."""
    from quarl.model.precision_apply import full_precision

    from quarl.model.smoothing import layer_input_groups

    batches = list(batches)
    if not batches:
        raise ValueError("GPTQ calibration got no batches: pass at least one batch of token ids")
    layers = [layer_input_groups(layer) for layer in model.model.layers]
    if any(linear.weight is None for groups in layers for group in groups for linear in group):
        raise ValueError("GPTQ needs the model's full-precision weights, but its base is quantized already; load "
                         "the model in full precision, or set precision.base_quantizer=rtn")
    codes: dict[nn.Module, QuantizedTensor] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        # counted in input columns quantized (each input's column pass serves all the linears that read it)
        bar = tqdm(total=sum(g[0].in_features for layer in layers for g in layer), desc="GPTQ", unit="col",
                   unit_scale=True)
    try:
        with full_precision(model):
            # each layer's inputs from the full-precision layers before it, one layer at a time: one forward in all
            states = [(*model.layer_inputs(ids, mask), mask.to(torch.bool).reshape(-1)) for ids, mask in batches]
            pending: list[tuple[list, torch.Tensor]] = []  # (group, Hessian) gathered, not yet quantized
            for layer, groups in zip(model.model.layers, layers):
                for group, hessian in zip(groups, layer_hessians(layer, groups, states)):
                    pending.append((group, hessian if combine is None else combine(hessian)))
                if sum(h.numel() * 4 for _, h in pending) >= HESSIAN_BYTES or layer is model.model.layers[-1]:
                    _quantize_pending(pending, fmt, weight_dtype, codes, bar, adapters, adapter_rank)
                    pending = []
    finally:
        if bar is not None:
            bar.close()
    return codes


def _quantize_pending(pending: list, fmt: str, weight_dtype, codes: dict, bar, adapters: dict | None = None,
                      adapter_rank: int = 0) -> None:
    """GPTQ of the gathered (group, Hessian) pairs, groups of like shapes together; codes[linear] = the result (and
    adapters[linear] = its base-error adapters when asked, see `gptq_base`)."""
    by_shape: dict[tuple, list] = {}
    for group, hessian in pending:
        by_shape.setdefault(tuple((lin.out_features, lin.in_features) for lin in group), []).append((group, hessian))
    for pairs in by_shape.values():
        weights = [[lin.weight.detach() if weight_dtype is None else lin.weight.detach().to(weight_dtype)
                    for lin in group] for group, _ in pairs]
        results = gptq_quantize_many(weights, torch.stack([h for _, h in pairs]), fmt,
                                     on_columns=None if bar is None else bar.update)
        for (group, hessian), qts in zip(pairs, results):
            for lin, qt in zip(group, qts):
                codes[lin] = qt.to("cpu")  # off the accelerator until loaded: the full model is still there
                if adapters is not None and adapter_rank > 0:
                    # the error from the full-precision weight (not its compute-dtype rounding GPTQ started from)
                    residual = lin.weight.detach().float() - qt.dequantize(torch.float32)
                    start = base_error_adapters(residual, hessian, adapter_rank)
                    if start is None:
                        from quarl.fallbacks import report_fallback

                        report_fallback("lora_init", "a Hessian could not be factorised (or gave non-finite "
                                        "adapters): those linears' adapters start at B = 0")
                    else:
                        adapters[lin] = tuple(t.cpu() for t in start)


def save_base_codes(model: nn.Module, codes: dict[nn.Module, QuantizedTensor], path,
                    lora_starts: dict | None = None) -> None:
    """Write the GPTQ base `codes` ({linear of model: weight QuantizedTensor}) to `path` (safetensors, atomic: a
    crash leaves the old file or none), named by the linears' module names; lora_starts ({linear: (A, B)}, the
    adapters' start under lora.init=base_error) go with them, so that a resumed run's KL reference starts where
    the run started."""
    from safetensors.torch import save

    from quarl.rl.checkpoint import atomic_write_bytes

    names = {module: name for name, module in model.named_modules()}
    tensors, fmt = {}, None
    for linear, qt in codes.items():
        name, fmt = names[linear], qt.fmt
        tensors[f"{name}.data"] = qt.data.detach().contiguous().cpu()
        tensors[f"{name}.scale"] = qt.scale.detach().contiguous().cpu()
        if qt.global_scale is not None:
            tensors[f"{name}.global_scale"] = qt.global_scale.detach().reshape(()).cpu()
    for linear, (a, b) in (lora_starts or {}).items():
        tensors[f"{names[linear]}.lora_start_a"] = a.detach().contiguous().cpu()
        tensors[f"{names[linear]}.lora_start_b"] = b.detach().contiguous().cpu()
    atomic_write_bytes(path, save(tensors, metadata={"format": str(fmt)}))


def load_base_codes(model: nn.Module, path) -> int:
    """Load a GPTQ base written by `save_base_codes` into the model's frozen bases
    (`QuantLinear.load_frozen_base_codes`), and the adapters' start where it holds one (`start_lora_at`, on
    linears with adapters); returns the number of linears loaded. Raises ValueError (saying which) when the file
    does not fit the model: another format, a linear it lacks, other shapes."""
    from pathlib import Path

    from safetensors import safe_open

    from quarl.model.qlinear import QuantLinear

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            fmt = (f.metadata() or {}).get("format")
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # a truncated or foreign file
        raise ValueError(f"{path} is not a readable GPTQ base ({type(err).__name__}: {err}); delete it to calibrate "
                         "again") from err
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    modules = dict(model.named_modules())
    loaded = 0
    for name in names:
        linear = modules.get(name)
        if not isinstance(linear, QuantLinear) or not linear.frozen_base or linear.rollout_format != fmt:
            raise ValueError(f"{path} holds a {fmt} base for {name}, which this model has no {fmt} qlora base for: "
                             "the run was made with another model or precision")
        qt = QuantizedTensor(fmt, "weight", tensors[f"{name}.data"], tensors[f"{name}.scale"],
                             tensors.get(f"{name}.global_scale"), linear.qweight.shape)
        linear.load_frozen_base_codes(qt.to(linear.qweight.data.device))
        if f"{name}.lora_start_a" in tensors and linear.lora_rank:
            linear.start_lora_at(tensors[f"{name}.lora_start_a"], tensors[f"{name}.lora_start_b"])
        loaded += 1
    return loaded


def load_run_base(model: nn.Module, run_dir) -> int:
    """Load the GPTQ base a run saved (RUN_DIR/`BASE_CODES_FILE`) into a model rebuilt from its config (a qlora
    base quantized by `apply_precision`); 0 when the run saved none (its base was rounded to nearest)."""
    from pathlib import Path

    path = Path(run_dir) / BASE_CODES_FILE
    return load_base_codes(model, path) if path.is_file() else 0
