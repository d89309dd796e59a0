"""Mismatch alarms: fire once after `patience` steps above a threshold, with advice that fits the config."""

import warnings
from types import SimpleNamespace

import pytest

from quarl.rl.mismatch_alarms import AlarmConfig, MismatchAlarms


def _run_cfg(flow="split", fmt="int8", correction="tis", guard="off", **precision):
    return SimpleNamespace(precision=SimpleNamespace(flow=flow, format=fmt, **precision),
                           loss=SimpleNamespace(correction=correction, is_cap=2.0, error_token_guard=guard))


def _feed(alarms, values, name="mismatch/kl"):
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, v in enumerate(values, 1):
            out.append(alarms.check(step, {name: v}))
    return out, [str(w.message) for w in caught]


def test_kl_alarm_fires_once_after_patience_with_advice():
    alarms = MismatchAlarms(AlarmConfig(kl=0.01, patience=3), _run_cfg(fmt="fp8"))
    out, caught = _feed(alarms, [0.002, 0.02, 0.03, 0.005, 0.02, 0.02, 0.03, 0.04, 0.05])
    # a dip at step 4 resets the streak: steps 5, 6, 7 are the first three in a row
    assert [bool(m) for m in out] == [False] * 6 + [True, False, False]
    assert len(caught) == 1 and caught == out[6]
    msg = caught[0]
    assert "step 7" in msg and "mismatch/kl=0.03" in msg and "alarms.kl=0.01" in msg
    assert "loss.correction=tbpo" in msg and "precision.format=fp8-block instead of fp8" in msg
    assert "precision.flow=unified" in msg
    assert "\n" not in msg


def test_advice_follows_the_config():
    alarms = MismatchAlarms(AlarmConfig(patience=1), _run_cfg(flow="unified", fmt="fp8-block", correction="mis"))
    (msg,), = [m for m in _feed(alarms, [0.5])[0] if m]
    assert "precision.flow=unified" not in msg and "loss.correction=" not in msg
    assert "quantize every linear" in msg
    alarms = MismatchAlarms(AlarmConfig(patience=1), _run_cfg())
    out, _ = _feed(alarms, [0.5], name="is/truncated_frac")
    assert "loss.is_cap" in out[0][0]
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(correction="tbpo")), [0.9], "is/masked_frac")
    assert "loss.tbpo_band" in out[0][0] and "loss.geo_high" not in out[0][0]  # only the band of this correction
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(correction="geo_mask")), [0.9], "is/masked_frac")
    assert "loss.geo_high" in out[0][0] and "loss.tbpo_band" not in out[0][0]
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg()), [0.2], "error/flagged_frac")
    assert "loss.error_token_guard=mask" in out[0][0]
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(guard="mask")), [0.2], "error/flagged_frac")
    assert "error_token_guard" not in out[0][0]
    # W8A8 INT8 split rollouts: smoothing the activations, unless already on
    w8a8 = dict(resolved_weight_only=False)
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(smooth_alpha=0.0, **w8a8)), [0.5])
    assert "precision.smooth_alpha=0.5" in out[0][0]
    out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(smooth_alpha=0.5, **w8a8)), [0.5])
    assert "smooth_alpha" not in out[0][0]


@pytest.mark.parametrize("fmt,finer", [("fp8", "fp8-block"), ("fp8-tensor", "fp8-block"), ("nvfp4", "int8"),
                                       ("mxfp4", "int8"), ("int8", None), ("fp8-block", None)])
def test_a_finer_format_is_advised_only_where_one_is(fmt, finer):
    """Smoothed INT8 W8A8 has less mismatch than FP8-block on SmolLM2 (bench/results/mismatch.md): an INT8 run is
    not sent to FP8-block; FP8 with coarser scales is, FP4 to INT8. Every alarm that names a format follows this."""
    for name, value in (("mismatch/kl", 0.5), ("is/masked_frac", 0.9), ("error/flagged_frac", 0.2)):
        out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), _run_cfg(fmt=fmt, smooth_alpha=0.5)), [value], name)
        msg = out[0][0]
        if finer:
            assert f"precision.format={finer} instead of {fmt}" in msg, (name, msg)
        else:
            assert "precision.format=" not in msg, (name, msg)


def test_the_default_kl_threshold_passes_the_smoothed_int8_level_and_catches_twice_it():
    """B6: smoothed INT8 rollouts logged mismatch/kl 0.014 on average and trained as well as bf16; an alarm there
    would teach users to ignore it. Twice that level must still warn."""
    assert not any(_feed(MismatchAlarms(AlarmConfig()), [0.015] * 10)[0])
    assert any(_feed(MismatchAlarms(AlarmConfig()), [0.03] * 10)[0])


def test_weight_only_advice_only_where_activations_are_quantized():
    """The unified flow's default is weight-only below hidden size 2048: no advice to turn on what is on."""
    from quarl.precision import PrecisionConfig

    def advice(hidden, **precision):
        cfg = SimpleNamespace(precision=PrecisionConfig(**precision),
                              loss=SimpleNamespace(correction="mis", is_cap=2.0, error_token_guard="off"))
        (msg,), = [m for m in _feed(MismatchAlarms(AlarmConfig(patience=1), cfg, hidden), [0.5])[0] if m]
        return msg

    assert "precision.weight_only=true" not in advice(576, flow="unified")
    assert "precision.weight_only=true" in advice(4096, flow="unified")
    assert "precision.weight_only=true" in advice(576, flow="unified", weight_only=False)
    assert "precision.weight_only=true" in advice(576, flow="split", format="int8")


def test_below_threshold_missing_nan_disabled_and_zero_threshold_never_fire():
    nan = float("nan")
    assert not any(_feed(MismatchAlarms(AlarmConfig(patience=1)), [0.009, 0.0, nan, -1.0])[0][i] for i in range(4))
    assert not any(_feed(MismatchAlarms(AlarmConfig(patience=1)), [0.5] * 3, name="other/metric")[0])
    assert not any(_feed(MismatchAlarms(AlarmConfig(enabled=False, patience=1)), [0.5] * 3)[0])
    assert not any(_feed(MismatchAlarms(AlarmConfig(kl=0, patience=1)), [0.5] * 3)[0])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kl=-0.1), "alarms.kl"), (dict(masked_frac=float("inf")), "alarms.masked_frac"),
    (dict(patience=0), "alarms.patience"),
])
def test_bad_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        AlarmConfig(**kwargs).validate()


def test_w8a8_rollouts_are_pointed_to_weight_only_quantization():
    from quarl.config import load_config

    for weight_only, expected in ((False, True), (True, False)):
        cfg = load_config(None, ["precision.flow=split", "precision.format=int8",
                                 f"precision.weight_only={str(weight_only).lower()}"])
        out, _ = _feed(MismatchAlarms(AlarmConfig(patience=1), cfg), [0.5])
        assert ("precision.weight_only=true" in out[0][0]) is expected
