"""The new corrections, GSPO, the error-token guard and the mismatch alarms inside real trainer steps on a tiny
random model (split INT8 rollout, so the mismatch is real)."""

import math

import pytest
import torch

from quarl.config import ConfigError, load_config
from tests.test_trainer import ScriptedEngine, make_cfg, make_trainer, read_metrics

SPLIT = ["precision.flow=split", "precision.format=int8", "train.steps=1"]

RUNS = [
    ("tbpo", ["loss.correction=tbpo", "loss.tbpo_band=1.2"], ["clip/frac_dual"]),
    ("ais", ["loss.correction=ais"], ["ais/lambda", "ais/ess_seq", "ais/ess_token", "ais/kl"]),
    ("geo_mask", ["loss.correction=geo_mask", "loss.geo_high=1.05"], []),
    ("seq_mask_tis", ["loss.correction=seq_mask_tis", "loss.geo_high=1.05"], []),
    ("icepop-gspo", ["loss.correction=icepop", "loss.importance_sampling_level=sequence"], []),
]


@pytest.mark.parametrize("name,overrides,keys", RUNS, ids=[r[0] for r in RUNS])
def test_correction_trains_and_reports(tmp_path, name, overrides, keys):
    trainer = make_trainer(make_cfg(tmp_path, *SPLIT, *overrides))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    rec = read_metrics(tmp_path / "run")[-1]
    for key in ("train/loss", "is/weight_mean", "is/masked_frac", "is/ess", "mismatch/kl", "error/flagged_frac",
                "error/loop_frac", "error/spike_frac", *keys):
        assert key in rec and math.isfinite(rec[key]), key
    assert 0.0 <= rec["ais/lambda" if name == "ais" else "is/ess"] <= 1.0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


LOOP = "ab" * 10  # 20 tokens of a 2-gram loop


def _scripted(tmp_path, guard):
    cfg = make_cfg(tmp_path, "train.steps=1", "rollout.max_new_tokens=24", f"loss.error_token_guard={guard}",
                   "loss.error_max_abs_log_ratio=0", name=f"run-{guard}")
    trainer = make_trainer(cfg)
    trainer.engine = ScriptedEngine([[[LOOP, "12", "1a", "a1"], ["33", "x", LOOP, "3"]]])
    seen = {}
    update = trainer.update

    def spy(batch, proximal, reference, step, collect_proximal=False):
        seen["rows"], seen["counted"] = len(batch), batch.answer_mask.sum(1).tolist()
        seen["collect"] = collect_proximal
        return update(batch, proximal, reference, step, collect_proximal)

    trainer.update = spy
    trainer.train()
    return seen, read_metrics(tmp_path / f"run-{guard}")[-1]


@pytest.mark.parametrize("guard", ["off", "mask", "drop"])
def test_error_guard_in_the_trainer(tmp_path, guard):
    seen, rec = _scripted(tmp_path, guard)
    assert rec["error/flagged_frac"] == pytest.approx(2 / 8) and rec["error/loop_frac"] == pytest.approx(2 / 8)
    assert rec["train/optimizer_steps"] >= 1
    if guard == "off":
        assert seen["rows"] == 8 and all(c > 0 for c in seen["counted"])
    elif guard == "mask":
        # the looping answers (row 0 of group 0, row 2 of group 1) reach the update with no counted token
        assert seen["rows"] == 8 and seen["counted"][0] == 0 and seen["counted"][6] == 0
        assert sum(c > 0 for c in seen["counted"]) == 6
        assert not seen["collect"]  # the guard scored π_prox before the update
    else:
        assert seen["rows"] == 6 and all(c > 0 for c in seen["counted"])


def test_alarm_warns_once_in_a_run(tmp_path):
    cfg = make_cfg(tmp_path, *SPLIT, "train.steps=2", "loss.is_cap=1.0001", "alarms.truncated_frac=0.01",
                   "alarms.patience=1", "alarms.window=1")
    trainer = make_trainer(cfg)
    with pytest.warns(UserWarning, match=r"is/truncated_frac=.* alarms.truncated_frac=0.01") as caught:
        trainer.train()
    assert sum("alarms.truncated_frac" in str(w.message) for w in caught) == 1  # once, not at every step


@pytest.mark.parametrize("override,needle", [
    ("loss.correction=tbpo2", "unknown; choose one of"),
    ("loss.tbpo_band=0.9", "loss.tbpo_band"),
    ("loss.importance_sampling_level=seq", "importance_sampling_level"),
    ("loss.error_token_guard=on", "error_token_guard"),
    ("alarms.kl=-1", "alarms.kl"),
    ("alarms.patience=0", "alarms.patience"),
])
def test_config_errors_are_one_line(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_a_bare_off_in_yaml_means_off():
    assert load_config(None, ["loss.error_token_guard=off"]).loss.error_token_guard == "off"
    assert load_config(None, ["loss.error_token_guard=mask"]).loss.error_token_guard == "mask"
