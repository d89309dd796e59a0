"""`quarl bench gemm` pieces that need no GPU: which plans `--codes-given` times from codes made beforehand, and
the table's extra columns."""

import math
import random

from quarl.bench.gemm import _format_table, takes_codes
from quarl.kernels.tuning import Cfg, Plan


def test_codes_given_applies_to_the_plans_that_start_from_codes():
    pre = Plan("w8a8", Cfg(64, 64, 128, native=True), "prequant")
    assert takes_codes(pre, "int8", False) and takes_codes(pre, "fp8-block", False)
    assert takes_codes(Plan("gemv", Cfg(1, 8, 512), "prequant"), "fp8", False)
    assert takes_codes(Plan("scaled_mm"), "fp8", False) and takes_codes(Plan("scaled_mm"), "fp8-tensor", False)
    assert not takes_codes(Plan("scaled_mm"), "fp8-block", False)  # blockwise cuBLAS pads rows and groups first
    assert not takes_codes(Plan("w8a8", Cfg(64, 64, 128), "fused"), "fp8", False)  # quantizes inside
    assert not takes_codes(Plan("gemv", Cfg(1, 8, 512), "fused"), "fp8", False)
    assert not takes_codes(pre, "fp8", True)  # weight-only: no activation codes at all
    assert not takes_codes(Plan("fp4", Cfg(16, 64, 256)), "nvfp4", False)
    assert not takes_codes(Plan("deq_mm"), "nvfp4", False)


def _row(fmt, t, t_codes=None, bf16=10.0):
    r = dict(shape="o", n=3584, k=3584, m=16, fmt=fmt, path="p", time_us=t, speedup=bf16 / t, roof=0.5, err=1e-3,
             dispatch="kernel")
    if t_codes is not None:
        r.update(time_codes_us=t_codes, speedup_codes=bf16 / t_codes)
    return r


def test_table_shows_the_codes_given_columns_only_when_measured():
    t, tc = random.uniform(5, 20), random.uniform(2, 5)
    plain = _format_table([_row("bf16", 10.0), _row("fp8", t)], best_only=False).splitlines()
    assert all(line.count("|") == 10 for line in plain)
    rows = [_row("bf16", 10.0), _row("fp8", t, tc), _row("int8", t, math.nan)]
    lines = _format_table(rows, best_only=False).splitlines()
    assert "codes given (us)" in lines[0] and all(line.count("|") == 12 for line in lines)
    assert lines[3].endswith(f" {tc:.1f} | {10.0 / tc:.2f}x |")
    assert lines[2].endswith(" - | - |") and lines[4].endswith(" - | - |")  # bf16, and a plan not timed so


def _ranged_row(fmt, shape, m, speedup, dispatch):
    return dict(shape=shape, n=1, k=1, m=m, fmt=fmt, path="p", time_us=10.0 / speedup, speedup=speedup, roof=0.5,
                err=1e-3, dispatch=dispatch)


def test_targets_summary_counts_shapes_and_names_slower_dispatched_kernels():
    from quarl.bench.gemm import _targets_summary

    hi = random.uniform(1.7, 2.0)
    rows = [_ranged_row("fp8", "qkv", 16, 0.8, "bf16"), _ranged_row("fp8", "down", 16, hi, "kernel"),
            _ranged_row("fp8", "o", 64, 0.95, "kernel"), _ranged_row("fp8", "gate_up", 4096, 1.8, "kernel"),
            _ranged_row("fp8", "qkv", 256, 1.2, "kernel"), _ranged_row("fp8", "gate_up", 1, 1.0, "kernel")]
    rows[-1].update(time_us=math.nan, speedup=math.nan)  # a plan that failed
    lines = _targets_summary(rows).splitlines()
    decode = next(line for line in lines if line.startswith("- fp8 decode"))
    assert f"0.80x (qkv, M=16) to {hi:.3f}x (down, M=16)" in decode
    assert "target 1.7x missed (reached at 1 of 4 shape/M cases)" in decode
    assert "dispatch: kernel at 2, bf16 at 1" in decode  # over the cases that ran
    # the qkv kernel is slower too, but the dispatch runs bf16 there: only o is named
    assert "dispatched kernels slower than bf16 at o/M=64 (0.95x)" in decode
    assert decode.endswith("; failed at gate_up/M=1") and "nan" not in decode
    assert lines[-1].startswith("- never slower than bf16: missed at 1 dispatched")  # o/M=64
    assert _targets_summary(rows[1:2]).splitlines()[-1] == "- never slower than bf16: MET (no dispatched kernel " \
        "below 1.0x)"
    prefill = next(line for line in lines if line.startswith("- fp8 prefill"))
    assert "target 1.6x MET (reached at 1 of 1 shape/M cases)" in prefill and "slower" not in prefill
    mid = next(line for line in lines if line.startswith("- fp8 mid"))
    assert "target" not in mid  # no target between 64 and 1024 rows


def test_sustained_bench_reads_nvidia_smi_samples(tmp_path):
    """bench/gemm_sustained.py keeps each well-formed nvidia-smi sample (time, MHz, W, reasons) and skips headers,
    partial lines and N/A fields instead of failing the run."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "gemm_sustained.py")
    spec = importlib.util.spec_from_file_location("gemm_sustained", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mhz = random.randint(300, 1980)
    watts = round(random.uniform(50, 700), 2)
    log = tmp_path / "smi.csv"
    log.write_text(
        "timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active\n"
        f"2026/11/30 05:01:02.250, {mhz} MHz, {watts} W, 0x0000000000000004\n"
        "2026/11/30 05:01:02.300, [N/A], [N/A], [N/A]\n"
        "2026/11/30 05:01:02.3\n"
        f"2026/11/30 05:01:02.350, {mhz + 15} MHz, {watts} W, 0x0000000000000000\n"
    )
    rows = mod._parse_smi(str(log))
    assert [(r[1], r[2], r[3]) for r in rows] == [
        (float(mhz), watts, "0x0000000000000004"), (float(mhz + 15), watts, "0x0000000000000000")]
    assert math.isclose(rows[1][0] - rows[0][0], 0.1, abs_tol=1e-6)


def test_fallback_table_and_sweep_lines():
    """The W8A8 fallback's table (time and cost over bf16 per shape, M, format) and the sweep's FALLBACK_COST
    source lines come from the rows' fallback times; formats without a fallback (nvfp4) are left out; a slower
    dispatched kernel is named with its speed-up over that fallback."""
    from quarl.bench.gemm import _fallback_table, _sweep_summary, _targets_summary

    fb, fb_int8 = random.uniform(11, 14), random.uniform(9.0, 9.9)  # int8: faster than bf16 (noise) -> 1.00
    plan = {"kind": "scaled_mm", "x_mode": "fused", "cfg": None}
    rows = [dict(_row("bf16", 10.0), fallback_us={"fp8": fb, "int8": fb_int8, "fp8-tensor": fb}),
            dict(_row("fp8", 10.5), plan=plan),
            dict(_row("nvfp4", 9.0), plan={"kind": "deq_mm", "x_mode": "fused", "cfg": None})]
    table = _fallback_table(rows).strip().splitlines()
    # int8 has no kernel row here: its fallback is still reported (it is timed with the bf16 GEMM)
    assert table[-1] == f"| o | 16 | {fb_int8:.1f} ({fb_int8 / 10.0:.2f}) | {fb:.1f} ({fb / 10.0:.2f}) | " \
        f"{fb:.1f} ({fb / 10.0:.2f}) |" and "nvfp4" not in table[-3]
    sweep = _sweep_summary(rows)
    assert f'tuning.FALLBACK_COST["fp8"][(3584, 3584)][16] = {fb / 10.0:.2f}' in sweep
    assert 'tuning.FALLBACK_COST["int8"][(3584, 3584)][16] = 1.00' in sweep and "fp8-tensor" not in sweep
    assert _fallback_table([_row("bf16", 10.0), rows[2]]) == ""
    lines = _targets_summary(rows).splitlines()
    decode = next(line for line in lines if line.startswith("- fp8 decode"))
    assert f"o/M=16 (0.95x; {fb / 10.5:.2f}x the W8A8 fallback)" in decode
    assert lines[-1].startswith("- never slower than bf16: missed at 1 dispatched")
