"""`quarl bench gemm` pieces that need no GPU: which plans `--codes-given` times from codes made beforehand, the
tables and summaries, `--sweep --write-tuning` on a fake sweep, the options, and `--training` / `--sustained`'s
CPU-runnable parts."""

import math
import random

import pytest

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


def test_fallback_table_and_sweep_lines():
    """The W8A8 fallback's table (time and cost over bf16 per shape, M, format) comes from the rows' fallback times;
    formats without a fallback (nvfp4) are left out; a slower dispatched kernel is named with its speed-up over that
    fallback; the sweep summary names the fastest plan that matched the reference."""
    from quarl.bench.gemm import _fallback_table, _sweep_summary, _targets_summary

    fb, fb_int8 = random.uniform(11, 14), random.uniform(9.0, 9.9)
    plan = {"kind": "scaled_mm", "x_mode": "fused", "cfg": None}
    rows = [dict(_row("bf16", 10.0), fallback_us={"fp8": fb, "int8": fb_int8, "fp8-tensor": fb}),
            dict(_row("fp8", 10.5), plan=plan, path="scaled_mm"),
            dict(_row("fp8", 9.5), plan=plan, path="wrong", err=0.5),  # faster, but not the product
            dict(_row("nvfp4", 9.0), plan={"kind": "deq_mm", "x_mode": "fused", "cfg": None})]
    table = _fallback_table(rows).strip().splitlines()
    # int8 has no kernel row here: its fallback is still reported (it is timed with the bf16 GEMM)
    assert table[-1] == f"| o | 16 | {fb_int8:.1f} ({fb_int8 / 10.0:.2f}) | {fb:.1f} ({fb / 10.0:.2f}) | " \
        f"{fb:.1f} ({fb / 10.0:.2f}) |" and "nvfp4" not in table[-3]
    sweep = _sweep_summary(rows).splitlines()
    assert sweep[1] == "fp8 o 16: scaled_mm 10.5 (0.95x, err 1.0e-03) | wrong 9.5"
    assert _fallback_table([_row("bf16", 10.0), rows[3]]) == ""
    lines = _targets_summary(rows[:2] + rows[3:]).splitlines()
    decode = next(line for line in lines if line.startswith("- fp8 decode"))
    assert f"o/M=16 (0.95x; {fb / 10.5:.2f}x the W8A8 fallback)" in decode
    assert lines[-1].startswith("- never slower than bf16: missed at 1 dispatched")


# ---------------------------------------------------------------- --sweep --write-tuning


def _sweep_rows():
    """A sweep's rows on two shapes and two M values (one of them not a bucket), with random times: per (format,
    shape, M) a fast plan that fails its reference check, a plan that did not run, and two correct ones."""
    from quarl.bench.gemm import _plan_dict

    plans = {"fp8": [Plan("w8a8", Cfg(16, 64, 128, split_k=4, stages=4, native=True, swap_ab=True, tma=True),
                          "prequant"), Plan("scaled_mm")],
             "nvfp4": [Plan("fp4_decode", Cfg(16, 64, 128, split_k=7)), Plan("deq_mm")]}
    rows, best = [], {}
    for shape, (n, k) in (("o", (3584, 3584)), ("down", (3584, 18944))):
        for m in (16, 20):
            t_bf16 = random.uniform(10, 40)
            t_fallback = t_bf16 * random.uniform(0.9, 1.3)
            rows.append(dict(shape=shape, n=n, k=k, m=m, fmt="bf16", path="cuBLAS", time_us=t_bf16, err=0.0,
                             fallback_us={"fp8": t_fallback, "fp8-tensor": t_bf16 * 1.5}))
            for fmt, (good, other) in plans.items():
                t = random.uniform(5, 50)
                t_other = t * random.uniform(1.01, 2)
                rows += [dict(shape=shape, n=n, k=k, m=m, fmt=fmt, path="x", time_us=t, err=1.7e-3,
                              plan=_plan_dict(good)),
                         dict(shape=shape, n=n, k=k, m=m, fmt=fmt, path="y", time_us=t_other, err=2.1e-3,
                              plan=_plan_dict(other)),
                         dict(shape=shape, n=n, k=k, m=m, fmt=fmt, path="z", time_us=t / 2, err=0.3,
                              plan=_plan_dict(other)),
                         dict(shape=shape, n=n, k=k, m=m, fmt=fmt, path="f", time_us=math.nan,
                              err="CompilationError: out of resources", plan=_plan_dict(other))]
                best[(fmt, (n, k), m)] = (good, round(t_bf16 / t, 2))
            best[("fallback", (n, k), m)] = round(max(1.0, t_fallback / t_bf16), 2)
    return rows, best


def test_write_tuning_writes_the_sweep_winners_as_a_loadable_file(tmp_path, monkeypatch):
    """--write-tuning: per swept family, shape and M bucket the fastest plan that matched the reference, with its
    speed-up to 2 decimals, and the fallback cost (at least 1); M values that are not buckets and fp8-tensor's
    fallback (fp8's serves it) are left out; the file records where it was measured, loads back equal, and
    choose_plan follows it once QUARL_TUNING_FILE names it."""
    import argparse

    from quarl.bench.gemm import tuning_tables_from_rows, write_tuning
    from quarl.kernels.tuning import choose_plan, read_tuning_file

    rows, best = _sweep_rows()
    path = tmp_path / "gpu.json"
    provenance = {"device": "NVIDIA Test GPU", "capability": [9, 0], "torch": "2.x", "triton": "3.x",
                  "command": "quarl bench gemm --sweep --write-tuning gpu.json"}
    write_tuning(argparse.Namespace(write_tuning=str(path), weight_only=False), rows, provenance)
    tables = read_tuning_file(path)
    assert tables == tuning_tables_from_rows(rows, False, provenance)
    assert tables.provenance == provenance
    assert sorted(tables.measured) == ["fp8", "w4a16"] and sorted(tables.fallback_cost) == ["fp8"]
    for fam, fmt in (("fp8", "fp8"), ("w4a16", "nvfp4")):
        assert tables.measured[fam] == {s: {16: best[(fmt, s, 16)]} for s in ((3584, 3584), (3584, 18944))}
    assert tables.fallback_cost["fp8"] == {s: {16: best[("fallback", s, 16)]} for s in ((3584, 3584), (3584, 18944))}
    monkeypatch.setenv("QUARL_TUNING_FILE", str(path))
    fp8_plan, fp8_speedup = best[("fp8", (3584, 18944), 16)]
    assert choose_plan("fp8", False, 9, 3584, 18944, prefer_kernel=True) == fp8_plan
    want = fp8_plan if fp8_speedup * best[("fallback", (3584, 18944), 16)] >= 1.05 else Plan("bf16")
    assert choose_plan("fp8", False, 9, 3584, 18944) == want
    assert choose_plan("nvfp4", True, 16, 3584, 3584, prefer_kernel=True) == best[("nvfp4", (3584, 3584), 16)][0]
    # weight-only 8-bit sweeps fill no table (W8A16 plans are set by hand)
    assert sorted(tuning_tables_from_rows(rows, True, provenance).measured) == ["w4a16"]


def test_gemm_options_parse_and_bad_combinations_fail_in_one_line(tmp_path, capsys):
    from quarl.bench.gemm import default_m
    from quarl.cli import build_parser, main

    parse = build_parser().parse_args
    args = parse(["bench", "gemm", "--sweep", "--write-tuning", str(tmp_path / "t.json")])
    assert args.sweep and args.write_tuning == str(tmp_path / "t.json")
    assert default_m(args) == "1,16,64,256,512,1024,4096"  # every bucket a tuning file holds
    args = parse(["bench", "gemm", "--sustained", "--seconds", "0.5", "--shapes", "qkv-1.5b"])
    assert args.sustained and args.seconds == 0.5 and default_m(args) == "1024,4096"
    args = parse(["bench", "gemm", "--training", "--m", "128"])
    assert args.training and default_m(args) == "128"
    assert default_m(parse(["bench", "gemm"])) == "1,16,64,256,1024,4096"
    with pytest.raises(SystemExit):  # one mode per run
        parse(["bench", "gemm", "--sweep", "--training"])
    capsys.readouterr()
    for argv, words in ((["--write-tuning", str(tmp_path / "t.json")], "add --sweep"),
                        (["--sweep", "--write-tuning", str(tmp_path / "no" / "t.json")], "does not exist"),
                        (["--shapes", "qkv,lm_head"], "unknown shapes ['lm_head']")):
        assert main(["bench", "gemm", *argv]) == 2  # before any GPU work
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("quarl bench: error: ") and words in err, err


def test_training_mode_times_the_three_modes_on_cpu():
    """--training's measurement (bf16, unified, fp8-backward forward + backward) runs on a CPU on a tiny layer."""
    import torch

    from quarl.bench.gemm_modes import training_times

    times = training_times(torch, 128, 256, 8, 2, "cpu")
    assert sorted(times) == ["bf16", "fp8-backward", "unified", "unified-bf16"]
    assert all(0 < t < 60e3 for t in times.values()), times


def test_sustained_reads_nvidia_smi_samples_and_tables_each_window(tmp_path):
    """--sustained keeps each well-formed nvidia-smi sample (time, MHz, W, reasons), skipping headers, partial lines
    and N/A fields; each timed window gets the median clock and power of its samples and the reasons seen there."""
    from quarl.bench.gemm_modes import parse_smi, sustained_table

    mhz = random.randint(300, 1900)
    watts = round(random.uniform(50, 700), 2)
    log = tmp_path / "smi.csv"
    log.write_text(
        "timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active\n"
        f"2026/11/30 05:01:02.250, {mhz} MHz, {watts} W, 0x0000000000000004\n"
        "2026/11/30 05:01:02.300, [N/A], [N/A], [N/A]\n"
        "2026/11/30 05:01:02.3\n"
        f"2026/11/30 05:01:02.350, {mhz + 15} MHz, {watts} W, 0x0000000000000000\n"
        f"2026/11/30 05:01:02.450, {mhz + 40} MHz, {watts + 1} W, 0x0000000000000000\n"
    )
    samples = parse_smi(str(log))
    assert [(r[1], r[2], r[3]) for r in samples] == [
        (float(mhz), watts, "0x0000000000000004"), (float(mhz + 15), watts, "0x0000000000000000"),
        (float(mhz + 40), watts + 1, "0x0000000000000000")]
    assert math.isclose(samples[1][0] - samples[0][0], 0.1, abs_tol=1e-6)
    t0 = samples[0][0]
    windows = [("o M=1024 | bf16 | F.linear", t0 - 0.01, t0 + 0.11, 40.0, 600.0, 25.0),
               ("o M=1024 | int8 | w8a8", t0 + 0.15, t0 + 0.25, 32.0, 700.0, 200.0)]
    lines = sustained_table(windows, samples).splitlines()
    assert lines[2] == f"| o M=1024 | bf16 | F.linear | 40.0 | 1.00x | 600 | {mhz + 7.5:.0f} | {watts:.0f} | " \
        "0x0000000000000000 0x0000000000000004 | 25 |"
    assert lines[3] == f"| o M=1024 | int8 | w8a8 | 32.0 | 1.25x | 700 | {mhz + 40} | {watts + 1:.0f} | " \
        "0x0000000000000000 | 200 |"


def test_sweep_candidates_are_writable_and_cover_the_shipped_tables():
    """Every plan `--sweep` times can be written to a tuning file and read back (fp4_decode tiles pass the
    kernel's checks), and every plan of the shipped tables is among the candidates of its format and bucket, so a
    new sweep can choose it again."""
    from quarl.bench.gemm import SWEPT_FAMILIES, _sweep_candidates
    from quarl.kernels.tuning import (M_BUCKETS, TuningTables, read_tuning_file, shipped_tables_path,
                                      tables_from_json, tables_to_json)

    cands = _sweep_candidates()
    assert sorted(cands) == sorted(SWEPT_FAMILIES) and all(sorted(c) == list(M_BUCKETS) for c in cands.values())
    assert {m for m, ps in cands["nvfp4"].items() if any(p.kind == "fp4_decode" for p in ps)} == {1, 16, 64}
    measured = {SWEPT_FAMILIES[f]: {(i + 1, 1): {b: (p, 1.0)} for b, ps in by_m.items() for i, p in enumerate(ps)}
                for f, by_m in cands.items()}
    tables = TuningTables(measured, {}, {"device": "-", "capability": [0, 0], "torch": "-", "triton": "-",
                                         "command": "-"})
    assert tables_from_json(tables_to_json(tables)) == tables
    shipped = read_tuning_file(shipped_tables_path(None))
    family_format = {fam: f for f, fam in SWEPT_FAMILIES.items()}
    for fam, shapes in shipped.measured.items():
        for shape, by_m in shapes.items():
            for m, (plan, _) in by_m.items():
                assert plan in cands[family_format[fam]][m], (fam, shape, m, plan)
