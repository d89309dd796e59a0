"""Which kernel and tile configuration each GEMM uses, by format family, weight shape and number of rows M.

No Triton import, so the choice can be inspected and tested on any machine.

A `Plan` names the path:
  "fp4"        fused W4A16 Triton GEMM (`quarl.kernels.fp4_gemm`);
  "deq_mm"     fp4 weight dequantized to bf16/fp16 by a Triton kernel, then the library GEMM;
  "w8a8"       8-bit Triton GEMM (`quarl.kernels.w8a8_gemm`), activation quantized in the GEMM (x_mode
               "fused"), beforehand by `quarl.kernels.act_quant` ("prequant"), or not at all ("raw", W8A16);
  "scaled_mm"  activation quantized by `act_quant`, then torch._scaled_mm (cuBLAS FP8: rowwise, per-tensor or
               blockwise scales);
  "gemv"       one-launch FMA kernels (`quarl.kernels.gemv`: fp4 M <= 4 rows, 8-bit M = 1; cfg.bn/bk/warps/stages,
               bm unused);
  "fp4_decode" M <= 64 rows, nvfp4/mxfp4 weights (`quarl.kernels.fp4_decode`): cfg.bm = 1 selects the CUDA-core
               FMA path (M <= 8), cfg.bm = 16 the tensor-core swap-AB path (wgmma with the decoded weight as
               the register operand, M padded to 16/32/64); cfg.bn/bk (bk: elements; 128 or 256 for bm = 16),
               split_k (one launch: the last program of a tile sums the fp32 partials), warps, stages, native
               (x permuted beforehand, see Cfg); group_m, swap_ab and tma unused (`check_fp4_decode_cfg` says
               what is allowed);
  "bf16"       `try_quantized_matmul` returns None: the caller's bf16 path is faster (see the policy below).
Families: "w4a16" (nvfp4, mxfp4), "int8", "fp8" (rowwise), "fp8-tensor", "fp8-block" (W8A8), and "w8a16"
(8-bit formats with weight_only=True).

The tables (`TuningTables`) are data, one JSON file per GPU written by `quarl bench gemm --sweep --write-tuning
PATH` (`write_tuning_file`; the file also names the GPU, its compute capability, the torch and Triton versions and
the command that wrote it). Per family, weight shape (N, K) and M bucket, `measured` holds the fastest quantized
plan and its speed-up over the bf16 GEMM (F.linear), activation quantization included; `fallback_cost` holds the
time of the path a layer runs without a kernel over the bare bf16 GEMM's (see the policy); the shipped file covers
the linears of Qwen2.5-7B. `current_tables` picks the file: quarl/kernels/tuning_tables/<gpu-slug>.json for the
current CUDA device (`gpu_slug`, e.g. nvidia-h200.json), else the H200's (a GPU without a file of its own, or no
GPU, uses the H200 tables); a file named by the environment variable QUARL_TUNING_FILE replaces the families it
holds (the rest keep the shipped tables).

Policy (`choose_plan`): the plan is "bf16" (no kernel) where the kernel is not MIN_SPEEDUP (1.05) times as fast as
the path a layer runs without it, unless the caller asks for the kernel anyway (prefer_kernel=True: a layer that
holds only the quantized weight has no bf16 path). Without a kernel, a layer with quantized activations still
computes the quantized values: it fake-quantizes the activations (one more pass over them) and runs the bf16 GEMM
on the dequantized weight; `fallback_cost` is that path's cost, and weight-only formats have no extra pass (cost
1). Other shapes use the tabled shape with the closest weight size N*K; M is rounded up to the next bucket.
fp8-tensor follows the fp8 table (activation quantized beforehand: a per-tensor scale needs the whole tensor);
w8a16 has hand-set plans (`W8A16_PLANS`, not swept).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from quarl.formats.registry import FORMATS

M_BUCKETS = (1, 16, 64, 256, 512, 1024, 4096)


@dataclass(frozen=True)
class Cfg:
    """Tile shape and launch parameters of one GEMM launch (Triton-free; the kernels use it as GemmConfig).

    bm/bn/bk: tile rows (tokens), columns (output features), reduction depth; split_k: programs sharing one
    output tile along K (fp32 partials summed by `splitk_reduce`); warps/stages: Triton's num_warps /
    num_stages (software pipelining depth); group_m: output tiles of one column band visited together (L2 reuse
    of the weight in prefill). native: W8A8: multiply the int8/fp8 codes on the int8/fp8 tensor cores (needs
    bm >= 64, or bn >= 64 with swap_ab); otherwise the codes are converted exactly to fp16 and multiplied there.
    fp4_decode's tensor-core path (bm = 16): x is permuted into the kernel's K order by one copy before the
    launch and streams into the MMA's shared-memory operand as it is (K a multiple of 128; the copy pays off only
    at some shapes and M, which the tables pick). swap_ab: W8A8 only, the product runs transposed (weight tile
    [bn, bk] as the MMA's first operand, the few token rows as its narrow second one), so decode's 16-64 rows need
    not fill a 64-row MMA side.
    tma: W8A8 on prequantized rowwise / per-tensor codes, native, operands arriving by TMA (Hopper or newer;
    elsewhere the regular kernel runs the same tile): in prefill the persistent kernel (no split-K); with swap_ab
    the decode kernel (M <= bm, bn >= 64, split-K allowed).
    """

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    native: bool = False
    swap_ab: bool = False
    tma: bool = False

    def name(self) -> str:
        tag = ("n" if self.native else "") + ("t" if self.swap_ab else "") + ("m" if self.tma else "")
        return f"{self.bm}x{self.bn}x{self.bk}s{self.split_k}w{self.warps}p{self.stages}{tag}"


@dataclass(frozen=True)
class Plan:
    kind: str  # "fp4" | "deq_mm" | "w8a8" | "scaled_mm" | "gemv" | "fp4_decode" | "bf16"
    cfg: Cfg | None = None
    x_mode: str = "fused"  # w8a8 / gemv only: "raw" | "fused" | "prequant"


FP4_DECODE_MAX_M = 64
FP4_DECODE_FMA_MAX_M = 8


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_fp4_decode_cfg(cfg: Cfg) -> None:
    """Raise ValueError when `cfg` cannot drive `quarl.kernels.fp4_decode` (Triton-free, so it runs anywhere).

    bm = 1 (CUDA-core FMA path): bn a power of two <= 512; bk a power of two in [64, 4096] (whole int32 code
    words, 8 per thread row at least); warps a power of two <= 16.
    bm = 16 (tensor-core path): warps 4 or 8 (one or two wgmma warp groups); bn 64, 128 or 256 and >= 16 * warps
    (each warp owns 16 weight rows of the wgmma); bk 128 or 256 (one or two 128-element steps per stage).
    Both: split_k in [1, 64], stages >= 1.
    """
    if not isinstance(cfg, Cfg):
        raise ValueError(f"fp4_decode needs a quarl.kernels.tuning.Cfg, got {type(cfg).__name__}")
    if cfg.bm not in (1, 16):
        raise ValueError(
            f"fp4_decode cfg.bm={cfg.bm} selects no path; use bm=1 (CUDA-core FMA, M <= {FP4_DECODE_FMA_MAX_M}) "
            f"or bm=16 (tensor cores, M <= {FP4_DECODE_MAX_M})"
        )
    if cfg.bm == 1:
        if not _pow2(cfg.bn) or cfg.bn > 512:
            raise ValueError(f"fp4_decode cfg.bn={cfg.bn} must be a power of two <= 512 for bm=1")
        if not _pow2(cfg.bk) or cfg.bk < 64 or cfg.bk > 4096:
            raise ValueError(f"fp4_decode cfg.bk={cfg.bk} must be a power of two in [64, 4096] for bm=1 "
                             "(K steps of whole 8-element code words)")
        if not _pow2(cfg.warps) or cfg.warps > 16:
            raise ValueError(f"fp4_decode cfg.warps={cfg.warps} must be a power of two <= 16 for bm=1")
    else:
        if cfg.warps not in (4, 8):
            raise ValueError(f"fp4_decode cfg.warps={cfg.warps} must be 4 or 8 for bm=16 (wgmma warp groups)")
        if cfg.bn not in (64, 128, 256) or cfg.bn < 16 * cfg.warps:
            raise ValueError(f"fp4_decode cfg.bn={cfg.bn} must be 64, 128 or 256 and >= 16 * warps "
                             f"({16 * cfg.warps}) for bm=16")
        if cfg.bk not in (128, 256):
            raise ValueError(f"fp4_decode cfg.bk={cfg.bk} must be 128 or 256 for bm=16 (128-element MMA steps)")
    if cfg.split_k < 1 or cfg.split_k > 64:
        raise ValueError(f"fp4_decode cfg.split_k={cfg.split_k} must be in [1, 64]")
    if cfg.stages < 1:
        raise ValueError(f"fp4_decode cfg.stages={cfg.stages} must be >= 1")


def m_bucket(m: int) -> int:
    """The smallest tuned bucket >= m (the largest bucket for bigger m)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


# ---------------------------------------------------------------- the tables (data, one JSON file per GPU)

TABLE_FAMILIES = ("w4a16", "int8", "fp8", "fp8-block")  # families with a `measured` table
FALLBACK_FAMILIES = ("int8", "fp8", "fp8-block")  # families whose layers fake-quantize activations without a kernel
PLAN_KINDS = ("fp4", "deq_mm", "w8a8", "scaled_mm", "gemv", "fp4_decode")  # "bf16" is the policy's, not a table's
X_MODES = ("raw", "fused", "prequant")
PROVENANCE_KEYS = ("device", "capability", "torch", "triton", "command")
TABLES_DIR = Path(__file__).with_name("tuning_tables")
DEFAULT_GPU = "nvidia-h200"  # the tables of a GPU without a file of its own
TUNING_FILE_ENV = "QUARL_TUNING_FILE"


@dataclass(frozen=True)
class TuningTables:
    """The tables of one GPU, as a tuning file holds them.

    measured: family -> (N, K) -> M bucket -> (Plan, speed-up over the bf16 GEMM, a float).
    fallback_cost: family -> (N, K) -> M bucket -> the fallback's time over the bf16 GEMM's (a float >= 1).
    provenance: "device" (name), "capability" ([major, minor]), "torch" and "triton" (versions), "command" (what
    wrote the tables).
    """

    measured: dict
    fallback_cost: dict
    provenance: dict


def gpu_slug(device_name: str) -> str:
    """The file name (without .json) of a GPU's shipped tables: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def _shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def tables_to_json(tables: TuningTables) -> dict:
    """The JSON object of a tuning file (string keys "NxK" and "M"; plans as kind, x_mode and every Cfg field)."""
    def plans(table):
        return {_shape_key(s): {str(m): {"speedup": sp, "kind": p.kind, "x_mode": p.x_mode,
                                         "cfg": None if p.cfg is None else asdict(p.cfg)}
                                for m, (p, sp) in by_m.items()} for s, by_m in table.items()}

    return {**{k: tables.provenance[k] for k in PROVENANCE_KEYS},
            "measured": {fam: plans(t) for fam, t in tables.measured.items()},
            "fallback_cost": {fam: {_shape_key(s): {str(m): c for m, c in by_m.items()} for s, by_m in t.items()}
                              for fam, t in tables.fallback_cost.items()}}


def _dump(obj, depth: int = 0) -> str:
    """JSON text with one line per table entry (a dict holding only plain values, or a plan entry, stays whole)."""
    if not isinstance(obj, dict) or not obj or depth >= 4 or not any(isinstance(v, dict) for v in obj.values()):
        return json.dumps(obj)
    pad = "  " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"


def write_tuning_file(path, tables: TuningTables) -> None:
    """Write `tables` as a tuning file (JSON) at path; `read_tuning_file` gives back equal tables."""
    text = _dump(tables_to_json(tables)) + "\n"
    tables_from_json(json.loads(text))  # never write a file that would not load
    with open(path, "w") as fh:
        fh.write(text)


def _keys(obj, what: str, required, optional=()) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    unknown = [k for k in obj if k not in required and k not in optional]
    if missing or unknown:
        raise ValueError(f"{what} " + "; ".join(([f"lacks {missing}"] if missing else [])
                                                + ([f"has unknown keys {unknown}"] if unknown else [])))
    return obj


def _number(v, what: str, least: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < least:
        raise ValueError(f"{what} must be a number >= {least:g}, got {v!r}")
    return float(v)


def _table(obj, what: str, families, entry) -> dict:
    """family -> (N, K) -> M bucket -> entry(value, name) from the JSON object of a table."""
    out = {}
    for fam, shapes in _keys(obj, what, (), families).items():
        out[fam] = {}
        if not isinstance(shapes, dict):
            raise ValueError(f"{what}[{fam!r}] must be a JSON object, got {type(shapes).__name__}")
        for s, by_m in shapes.items():
            match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", s)
            if not match:
                raise ValueError(f"{what}[{fam!r}] key {s!r} is not a weight shape NxK (e.g. \"4608x3584\")")
            name = f"{what}[{fam!r}][{s!r}]"
            buckets = _keys(by_m, name, (), [str(b) for b in M_BUCKETS])
            out[fam][(int(match[1]), int(match[2]))] = {int(m): entry(v, f"{name}[{m!r}]") for m, v in buckets.items()}
    return out


def _plan_entry(v, what: str) -> tuple[Plan, float]:
    _keys(v, what, ("speedup", "kind", "x_mode", "cfg"))
    if v["kind"] not in PLAN_KINDS:
        raise ValueError(f"{what} kind {v['kind']!r} is not one of {', '.join(PLAN_KINDS)}")
    if v["x_mode"] not in X_MODES:
        raise ValueError(f"{what} x_mode {v['x_mode']!r} is not one of {', '.join(X_MODES)}")
    needs_cfg = v["kind"] not in ("deq_mm", "scaled_mm")
    if (v["cfg"] is None) == needs_cfg:
        raise ValueError(f"{what} kind {v['kind']!r} " + ("needs a cfg" if needs_cfg else "takes no cfg (null)"))
    cfg = None
    if needs_cfg:
        names = [f.name for f in fields(Cfg)]
        _keys(v["cfg"], f"{what} cfg", names)
        for f in fields(Cfg):
            x, want = v["cfg"][f.name], bool if f.type in ("bool", bool) else int
            if type(x) is not want or (want is int and x < 1):
                raise ValueError(f"{what} cfg {f.name}={x!r} must be " + ("true or false" if want is bool else
                                                                          "a positive integer"))
        cfg = Cfg(**v["cfg"])
        if v["kind"] == "fp4_decode":
            try:
                check_fp4_decode_cfg(cfg)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
    return Plan(v["kind"], cfg, v["x_mode"]), _number(v["speedup"], f"{what} speedup", 0.0)


def tables_from_json(obj) -> TuningTables:
    """`TuningTables` from the JSON object of a tuning file; ValueError saying what is wrong where."""
    _keys(obj, "the file", PROVENANCE_KEYS + ("measured", "fallback_cost"))
    cap = obj["capability"]
    if not (isinstance(cap, list) and len(cap) == 2 and all(type(c) is int for c in cap)):
        raise ValueError(f"capability must be [major, minor], got {cap!r}")
    bad = [k for k in PROVENANCE_KEYS if k != "capability" and not isinstance(obj[k], str)]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be strings")
    return TuningTables(
        measured=_table(obj["measured"], "measured", TABLE_FAMILIES, _plan_entry),
        fallback_cost=_table(obj["fallback_cost"], "fallback_cost", FALLBACK_FAMILIES,
                             lambda v, what: _number(v, what, 1.0)),
        provenance={k: obj[k] for k in PROVENANCE_KEYS})


def read_tuning_file(path) -> TuningTables:
    """The tables of a tuning file; a missing, unreadable or malformed file raises a one-line ValueError naming
    the file and what is wrong."""
    try:
        with open(path) as fh:
            return tables_from_json(json.load(fh))
    except OSError as e:
        problem = f"cannot be read ({e.strerror or e})"
    except json.JSONDecodeError as e:
        problem = f"is not JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except ValueError as e:
        problem = str(e)
    raise ValueError(f"tuning file {path}: {problem} (`quarl bench gemm --sweep --write-tuning {path}` writes a "
                     "valid one)") from None


@functools.lru_cache(maxsize=None)
def _gpu_name() -> str | None:
    """The current CUDA device's name at the first call, None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def shipped_tables_path(device_name: str | None) -> Path:
    """The tuning file shipped for a GPU name: tuning_tables/<gpu_slug>.json, else the H200's."""
    if device_name:
        own = TABLES_DIR / f"{gpu_slug(device_name)}.json"
        if own.is_file():
            return own
    return TABLES_DIR / f"{DEFAULT_GPU}.json"


_loaded: dict = {}  # $QUARL_TUNING_FILE (or None) -> TuningTables


def current_tables() -> TuningTables:
    """The tables `choose_plan` uses: the shipped file of the current GPU (the H200's where it has none), with the
    families of the file named by $QUARL_TUNING_FILE in place of the shipped ones. Read once per process."""
    user = os.environ.get(TUNING_FILE_ENV) or None
    tables = _loaded.get(user)
    if tables is None:
        tables = read_tuning_file(shipped_tables_path(_gpu_name()))
        if user is not None:
            try:
                own = read_tuning_file(user)
            except ValueError as e:
                raise ValueError(f"{TUNING_FILE_ENV}: {e}; unset it to use the shipped tables") from None
            tables = TuningTables({**tables.measured, **own.measured},
                                  {**tables.fallback_cost, **own.fallback_cost}, own.provenance)
        _loaded[user] = tables
    return tables


# A quantized plan runs only where its tabled speed-up reaches this: the same kernel's speed-up differs by a few
# percent between two GPUs of one model and between runs, and a near-tie is not worth the rounding of a quantized
# GEMM.
MIN_SPEEDUP = 1.05

C, P = Cfg, Plan

# Weight-only 8-bit (W8A16), not swept: set by hand after the W8A8 plans, which stream the same weight bytes.
W8A16_PLANS = {
    1: P("gemv", C(1, 8, 512), "raw"),
    16: P("w8a8", C(16, 64, 256, split_k=4, stages=4), "raw"),
    64: P("w8a8", C(64, 64, 128, split_k=2), "raw"),
    256: P("w8a8", C(64, 128, 128), "raw"),
    512: P("bf16"),
    1024: P("bf16"),
    4096: P("bf16"),
}


def family(fmt: str, weight_only: bool) -> str | None:
    """The plan family of a format + mode, or None where no kernel exists (fp4 activations: W4A4)."""
    spec = FORMATS.get(fmt)
    if spec is None:
        return None
    if spec.bits == 4:
        return "w4a16" if weight_only else None
    return "w8a16" if weight_only else fmt


def _table_key(fam: str) -> str:
    """The table a family reads: the format's `tuning_family` (fp8-tensor shares the rowwise "fp8" table)."""
    return FORMATS[fam].tuning_family if fam in FORMATS else fam


def _nearest_shape(table: dict, n: int, k: int) -> tuple[int, int]:
    """The key (N, K) of a per-shape table: (n, k) itself, else the tabled shape nearest in weight size N*K."""
    if (n, k) in table:
        return (n, k)
    return min(table, key=lambda s: abs(math.log(s[0] * s[1]) - math.log(max(n * k, 1))))


def measured_entry(fam: str, n: int, k: int, m: int) -> tuple[Plan, float] | None:
    """(plan, speed-up) of `current_tables` for this family at the shape nearest to (n, k) in weight size and the
    M bucket of m; None where the table has no entry."""
    table = current_tables().measured.get(_table_key(fam))
    if not table:
        return None
    entry = table[_nearest_shape(table, n, k)].get(m_bucket(m))
    if entry is None:
        return None
    plan, speedup = entry
    if FORMATS.get(fam) is not None and FORMATS[fam].per_tensor_scale and plan.kind in ("w8a8", "gemv") \
            and plan.x_mode == "fused":  # a per-tensor activation scale needs the whole tensor first
        plan = replace(plan, x_mode="prequant")
    return plan, speedup


def fallback_cost(fam: str, n: int, k: int, m: int) -> float:
    """Time of the path without a kernel over the bf16 GEMM's for this family, shape (nearest tabled, as
    `measured_entry`) and M bucket: `current_tables().fallback_cost` for the families with quantized activations,
    else 1."""
    table = current_tables().fallback_cost.get(_table_key(fam))
    if not table:
        return 1.0
    return table[_nearest_shape(table, n, k)].get(m_bucket(m), 1.0)


def choose_plan(fmt: str, weight_only: bool, m: int, n: int, k: int, prefer_kernel: bool = False) -> Plan:
    """The plan for an [m, k] x [n, k]^T product in `fmt`: Plan("bf16") when no kernel applies or the fastest
    tabled kernel (`measured_entry`) is not MIN_SPEEDUP times as fast as the path without a kernel (the bf16 GEMM,
    after fake quantization of the activations for the W8A8 families: `fallback_cost`).

    prefer_kernel: return the fastest quantized plan even where its speed-up is below that.
    """
    fam = family(fmt, weight_only)
    if fam is None:
        return Plan("bf16")
    if fam == "w8a16":
        plan = W8A16_PLANS[m_bucket(m)]
        if plan.kind == "bf16" and prefer_kernel:
            plan = P("w8a8", C(128, 128, 128, warps=8), "raw")
        return plan
    entry = measured_entry(fam, n, k, m)
    if entry is None:
        return Plan("bf16")
    plan, speedup = entry
    # (the fallback costs at least the bf16 GEMM: looked up only for kernels below MIN_SPEEDUP x bf16)
    if not prefer_kernel and speedup < MIN_SPEEDUP and speedup * fallback_cost(fam, n, k, m) < MIN_SPEEDUP:
        return Plan("bf16")
    return plan
