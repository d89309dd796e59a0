"""The GEMM tuning tables as data (`quarl.kernels.tuning`): the shipped H200 file loads and writes back byte for
byte, entries match the results they came from, `choose_plan` keeps its choices, QUARL_TUNING_FILE replaces the
families it holds, and a malformed file fails in one line naming the file and the problem. CPU only."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from quarl.kernels import tuning
from quarl.kernels.tuning import Cfg as C
from quarl.kernels.tuning import Plan as P

SHIPPED = tuning.TABLES_DIR / "nvidia-h200.json"


@pytest.fixture(autouse=True)
def _no_user_tables(monkeypatch):
    monkeypatch.delenv("QUARL_TUNING_FILE", raising=False)


def test_shipped_table_loads_and_writes_back_byte_for_byte(tmp_path):
    tables = tuning.read_tuning_file(SHIPPED)
    assert tables.provenance["device"] == "NVIDIA H200" and tables.provenance["capability"] == [9, 0]
    assert sorted(tables.measured) == sorted(tuning.TABLE_FAMILIES)
    assert sorted(tables.fallback_cost) == sorted(tuning.FALLBACK_FAMILIES)
    out = tmp_path / "again.json"
    tuning.write_tuning_file(out, tables)
    assert out.read_text() == SHIPPED.read_text()
    assert tuning.read_tuning_file(out) == tables


def test_shipped_entries_match_the_results_they_came_from():
    """A few entries against bench/results/gemm.md: the nvfp4 decode sweep's winners (gate_up at 1 row, down at 16),
    int8 gate_up at 1 row (B1, 06:45), and the W8A8 fallback table of the 06:53 run (fp8 gate_up at 512 rows
    measured 0.99: stored as 1.00, the floor)."""
    t = tuning.read_tuning_file(SHIPPED)
    assert t.measured["w4a16"][(37888, 3584)][1] == (P("fp4_decode", C(16, 64, 128, stages=4)), 2.02)
    assert t.measured["w4a16"][(3584, 18944)][16] == (P("fp4_decode", C(16, 64, 128, split_k=7, stages=4)), 1.75)
    assert t.measured["int8"][(37888, 3584)][1] == (
        P("w8a8", C(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.92)
    assert t.fallback_cost["int8"][(4608, 3584)] == {1: 1.17, 16: 1.22, 64: 1.24, 256: 1.21, 512: 1.16, 1024: 1.13,
                                                     4096: 1.12}
    assert t.fallback_cost["fp8"][(3584, 18944)][1024] == 1.27
    assert t.fallback_cost["fp8"][(37888, 3584)][512] == 1.0


# (fmt, weight_only, m, n, k, prefer_kernel) -> plan, as choose_plan chose them when the tables were Python literals
GOLDEN = [
    (("int8", False, 1, 4608, 3584, False),
     P("w8a8", C(16, 64, 128, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant")),
    (("fp8-block", False, 64, 4608, 3584, False), P("bf16")),
    (("fp8-block", False, 64, 4608, 3584, True), P("scaled_mm")),
    (("nvfp4", True, 256, 4608, 3584, False), P("bf16")),
    (("nvfp4", True, 200, 4608, 3584, True), P("deq_mm")),
    (("nvfp4", False, 1, 4608, 3584, False), P("bf16")),
    (("fp8-tensor", False, 1, 3584, 3584, False), P("gemv", C(1, 8, 1024), "prequant")),
    (("int8", True, 512, 3584, 3584, False), P("bf16")),
    (("int8", True, 512, 3584, 3584, True), P("w8a8", C(128, 128, 128, warps=8), "raw")),
    (("int8", True, 10, 3584, 3584, False), P("w8a8", C(16, 64, 256, split_k=4, stages=4), "raw")),
    (("fp8", False, 3000, 5120, 5120, False),
     P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant")),
    (("mxfp4", True, 1, 3584, 3584, False), P("fp4_decode", C(1, 4, 1024, warps=2))),
    (("fp8", False, 200, 1536, 1536, False), P("w8a8", C(64, 128, 128, stages=4, native=True, tma=True), "prequant")),
    (("int8", False, 1000, 4608, 3584, False), P("bf16")),
    (("fp8", False, 65, 3584, 18944, False), P("scaled_mm")),
    (("fp8-block", False, 2, 37888, 3584, False),
     P("w8a8", C(16, 128, 128, split_k=4, stages=4, native=True, swap_ab=True), "prequant")),
    (("bf16", False, 16, 3584, 3584, True), P("bf16")),
]


@pytest.mark.parametrize("case,plan", GOLDEN)
def test_choose_plan_keeps_its_choices(case, plan):
    assert tuning.choose_plan(*case) == plan


def test_a_gpu_without_tables_of_its_own_uses_the_h200_ones():
    assert tuning.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuning.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuning.shipped_tables_path("NVIDIA H200") == SHIPPED
    assert tuning.shipped_tables_path("NVIDIA GeForce RTX 4090") == SHIPPED
    assert tuning.shipped_tables_path(None) == SHIPPED


def _tables(measured=None, fallback=None):
    return tuning.TuningTables(measured or {}, fallback or {}, {"device": "NVIDIA Test", "capability": [8, 9],
                                                                "torch": "2.x", "triton": "3.x", "command": "test"})


def test_user_file_replaces_the_families_it_holds(tmp_path, monkeypatch):
    speedup = round(random.uniform(1.1, 3.0), 2)
    plan = P("w8a8", C(64, 64, 128, split_k=2), "prequant")
    path = tmp_path / "mine.json"
    tuning.write_tuning_file(path, _tables({"int8": {(100, 200): {b: (plan, speedup) for b in tuning.M_BUCKETS}}}))
    monkeypatch.setenv("QUARL_TUNING_FILE", str(path))
    assert tuning.current_tables().provenance["device"] == "NVIDIA Test"
    assert tuning.choose_plan("int8", False, 1, 4608, 3584) == plan  # int8: the user's one shape
    assert tuning.measured_entry("int8", 7, 7, 3000) == (plan, speedup)
    assert tuning.fallback_cost("int8", 4608, 3584, 1) == 1.17  # fallback_cost: the file has none, shipped kept
    assert tuning.choose_plan("fp8", False, 3000, 5120, 5120) == GOLDEN[10][1]  # fp8: shipped


@pytest.mark.parametrize("edit,problem", [
    (lambda d: d.pop("measured"), "lacks ['measured']"),
    (lambda d: d.update(gpu="x"), "unknown keys ['gpu']"),
    (lambda d: d.update(capability="9.0"), "capability must be [major, minor]"),
    (lambda d: d["measured"].update(fp4={}), "unknown keys ['fp4']"),
    (lambda d: d["measured"]["int8"].update({"4608 x 3584": {}}), "is not a weight shape NxK"),
    (lambda d: d["measured"]["int8"]["4608x3584"].update({"32": d["measured"]["int8"]["4608x3584"]["16"]}),
     "unknown keys ['32']"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"].update(kind="cutlass"), "kind 'cutlass' is not one of"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"].update(cfg=None), "kind 'w8a8' needs a cfg"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"]["cfg"].update(bm=0), "cfg bm=0 must be a positive integer"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"]["cfg"].update(tma="yes"), "cfg tma='yes' must be true or"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"]["cfg"].pop("warps"), "lacks ['warps']"),
    (lambda d: d["measured"]["w4a16"]["4608x3584"]["1"]["cfg"].update(bm=8),
     "measured['w4a16']['4608x3584']['1']: fp4_decode cfg.bm=8 selects no path"),
    (lambda d: d["measured"]["int8"]["4608x3584"]["1"].update(speedup="1.03"), "speedup must be a number >= 0"),
    (lambda d: d["fallback_cost"]["fp8"]["4608x3584"].update({"1": 0.97}), "must be a number >= 1, got 0.97"),
])
def test_malformed_user_file_fails_in_one_line_naming_file_and_problem(tmp_path, monkeypatch, edit, problem):
    data = json.loads(SHIPPED.read_text())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("QUARL_TUNING_FILE", str(path))
    with pytest.raises(ValueError) as e:
        tuning.choose_plan("int8", False, 16, 4608, 3584)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"QUARL_TUNING_FILE: tuning file {path}: ") and problem in msg, msg
    assert msg.endswith(f"(`quarl bench gemm --sweep --write-tuning {path}` writes a valid one); unset it to use "
                        "the shipped tables")


def test_unreadable_or_non_json_file_fails_in_one_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"device": "x",\n  "capability": [9, 0]]')
    with pytest.raises(ValueError, match=r"^tuning file .*t\.json: is not JSON \(.* at line 2 column \d+\) "):
        tuning.read_tuning_file(path)
    with pytest.raises(ValueError, match=r"^tuning file .*missing\.json: cannot be read \(No such file"):
        tuning.read_tuning_file(tmp_path / "missing.json")


def test_writer_refuses_tables_that_would_not_load(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="speedup must be a number"):
        tuning.write_tuning_file(path, _tables({"fp8": {(8, 8): {1: (P("scaled_mm"), float("nan"))}}}))
    assert not path.exists()


def test_tuning_imports_and_chooses_without_triton():
    code = ("import sys; sys.modules['triton'] = None; from quarl.kernels.tuning import choose_plan; "
            "print(choose_plan('fp8', False, 1, 3584, 3584).kind)")
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "gemv", res.stderr[-2000:]


def test_a_bad_user_tuning_file_stops_a_run_before_the_model_loads(tmp_path, monkeypatch):
    from quarl.config import load_config
    from quarl.kernels import tuning
    from quarl.rl.trainer import Trainer

    bad = tmp_path / "mine.json"
    bad.write_text("{not json")
    monkeypatch.setenv(tuning.TUNING_FILE_ENV, str(bad))
    monkeypatch.setattr(tuning, "_loaded", {})
    cfg = load_config(None, ["model.name=/nonexistent/model", f"output.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="QUARL_TUNING_FILE: .*mine.json"):
        Trainer(cfg)
