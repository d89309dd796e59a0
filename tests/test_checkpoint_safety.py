"""Checkpoint reliability: checksums, fallback to the newest intact checkpoint, retention, orphan temp files,
weights_only loading (no code runs from a file), a `latest` pointer confined to its folder, no checkpoint of
non-finite state, RNG round trips, and export safety (no silent overwrite, ordinary file modes)."""

import hashlib
import os
import random
import stat
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from quarl.export import check_export_target, export_from_run, export_run
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config, tiny_tokenizer
from quarl.rl import checkpoint as ck
from quarl.rl.checkpoint import (CheckpointCorrupt, CheckpointWarning, latest_checkpoint, load_checkpoint,
                                 load_latest_intact, save_checkpoint)
from quarl.rl.master_weights import MasterWeightAdamW

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def make_model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    model = QuarlForCausalLM(tiny_config("llama")).to(dtype)
    opt = MasterWeightAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train_step(model, opt, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 8), generator=g)
    model(ids).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_weights_equal(model, expected):
    got = weights(model)
    assert got.keys() == expected.keys()
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


def two_checkpoints(run):
    """step 1 and step 2 of a bf16 model (float32 masters); returns step 1's weights and step 2's."""
    model, opt = make_model()
    train_step(model, opt, 1)
    save_checkpoint(run, 1, model, opt)
    w1 = weights(model)
    train_step(model, opt, 2)
    save_checkpoint(run, 2, model, opt)
    w2 = weights(model)
    assert any(not torch.equal(w1[n], w2[n]) for n in w1)
    return w1, w2


def ckdir(run):
    return Path(run) / "checkpoints"


def tensor_data_span(path):
    """(start, length) of the bytes of the tensor record whose data holds the middle of the file."""
    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" not in info.filename or info.file_size == 0:
                continue
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            if start <= size // 2 < start + info.file_size:
                return start, info.file_size
    raise AssertionError("no tensor record spans the middle of the file")


def flip_bit_in_tensor(path):
    start, length = tensor_data_span(path)
    data = bytearray(Path(path).read_bytes())
    data[start + length // 2] ^= 0x01
    Path(path).write_bytes(bytes(data))


def corrupt(path, how):
    path = Path(path)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bitflip":
        flip_bit_in_tensor(path)
    elif how == "garbage":
        path.write_bytes(os.urandom(4096))
    elif how == "no-checksum":
        ck.checksum_path(path).unlink()
    elif how == "bad-checksum-file":
        ck.checksum_path(path).write_text("not a hash\n")
    else:
        raise ValueError(how)


def one_line_warnings(record, category=CheckpointWarning):
    msgs = [str(w.message) for w in record if issubclass(w.category, category)]
    assert all("\n" not in m for m in msgs), msgs
    return msgs


# ------------------------------------------------------------------------------------------------ checksums

def test_checkpoint_has_a_matching_checksum_and_loads_with_weights_only(tmp_path):
    model, opt = make_model()
    train_step(model, opt)
    path = save_checkpoint(tmp_path, 1, model, opt)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    sums = ck.checksum_path(path)
    assert sums.name == "step_000001.pt.sha256"
    assert sums.read_text() == f"{digest}  step_000001.pt\n"  # sha256sum -c format
    assert (ckdir(tmp_path) / "latest").read_text() == "step_000001.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)  # no pickled globals (numpy, tuples of RNG)
    assert state["optimizer"]["masters"], "bf16 parameters have float32 masters in the checkpoint"
    assert all(m.dtype == torch.float32 for m in state["optimizer"]["masters"].values())
    assert isinstance(state["rng"]["numpy"]["keys"], list) and isinstance(state["rng"]["python"]["internal"], list)


def test_plain_adamw_state_dict_loads_with_weights_only(tmp_path):
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    w = weights(model)
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    path = save_checkpoint(tmp_path, 1, model, opt)
    train_step(model, opt, 5)
    load_checkpoint(path, model, opt)
    assert_weights_equal(model, w)
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], moments[k])


@pytest.mark.parametrize("how", ["truncated", "empty", "bitflip", "garbage", "no-checksum", "bad-checksum-file"])
def test_a_damaged_latest_falls_back_to_the_previous_intact_checkpoint(tmp_path, how):
    w1, _ = two_checkpoints(tmp_path)
    bad = ckdir(tmp_path) / "step_000002.pt"
    corrupt(bad, how)
    if how == "bitflip":  # the zip still reads: only the checksum tells that a tensor changed
        state = torch.load(bad, map_location="cpu", weights_only=True)
        assert any(not torch.equal(state["model"][n].to(w1[n].dtype), w1[n]) for n in w1)
    model, opt = make_model(seed=7)
    with pytest.warns(CheckpointWarning) as record:
        state, path = load_latest_intact(tmp_path, model, opt)
    msgs = one_line_warnings(record)
    assert path.name == "step_000001.pt" and state["step"] == 1
    assert any("step_000002.pt" in m and "not intact" in m for m in msgs), msgs
    assert_weights_equal(model, w1)
    # the old entry point falls back too (it checks checksums only)
    with pytest.warns(CheckpointWarning):
        assert latest_checkpoint(tmp_path).name == "step_000001.pt"
    # an explicit path to the damaged file is refused in one line
    with pytest.raises(CheckpointCorrupt) as err:
        load_checkpoint(bad, make_model()[0])
    assert "step_000002.pt" in str(err.value) and "\n" not in str(err.value)


def test_a_file_torch_cannot_load_is_skipped_even_with_a_matching_checksum(tmp_path):
    w1, _ = two_checkpoints(tmp_path)
    bad = ckdir(tmp_path) / "step_000002.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip" * 50)
    ck.checksum_path(bad).write_text(f"{hashlib.sha256(bad.read_bytes()).hexdigest()}  {bad.name}\n")
    model, opt = make_model(seed=7)
    with pytest.warns(CheckpointWarning, match=r"step_000002\.pt.*torch\.load failed"):
        _, path = load_latest_intact(tmp_path, model, opt)
    assert path.name == "step_000001.pt"
    assert_weights_equal(model, w1)


@pytest.mark.parametrize("how", ["truncated", "empty", "bitflip", "no-checksum"])
def test_no_intact_checkpoint_is_one_clear_error_naming_the_folder(tmp_path, how):
    two_checkpoints(tmp_path)
    for p in ck.checkpoint_files(ckdir(tmp_path)):
        corrupt(p, how)
    model, opt = make_model()
    for fn in (lambda: load_latest_intact(tmp_path, model, opt), lambda: latest_checkpoint(tmp_path)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            with pytest.raises(FileNotFoundError) as err:
                fn()
        msg = str(err.value)
        assert str(ckdir(tmp_path)) in msg and "no intact checkpoint" in msg and "\n" not in msg
        assert "step_000001.pt" in msg and "step_000002.pt" in msg


def test_no_checkpoint_at_all(tmp_path):
    assert latest_checkpoint(tmp_path) is None  # existing callers test for None
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        load_latest_intact(tmp_path, make_model()[0])


# ------------------------------------------------------------------------------------------------ pointer

def _touch(path):
    Path(path).write_text("code ran")
    return {}


class Evil:
    """Unpickled with weights_only=False, this creates a marker file (any code could run instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def plant_evil(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": 99, "model": {}, "evil": Evil(marker)}, path)
    ck.checksum_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    # the plant works: a full unpickle runs it
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder", "newline"])
def test_latest_pointer_outside_plain_names_is_not_followed(tmp_path, monkeypatch, where):
    run = tmp_path / "run"
    w1, w2 = two_checkpoints(run)
    marker = tmp_path / "marker"
    folder = ckdir(run)
    if where == "parent":
        evil, name = run / "evil.pt", "../evil.pt"
    elif where == "absolute":
        evil = tmp_path / "elsewhere" / "evil.pt"
        name = str(evil)
    elif where == "subfolder":
        evil, name = folder / "sub" / "step_000009.pt", "sub/step_000009.pt"
    else:
        evil, name = run / "step_000009.pt", "step_000009.pt\n../step_000009.pt"
    plant_evil(evil, marker)
    (folder / "latest").write_text(name)
    loaded = []
    real_load = torch.load

    def spy(f, *a, **kw):
        loaded.append(Path(f).resolve())
        return real_load(f, *a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    model, opt = make_model(seed=7)
    with pytest.warns(CheckpointWarning, match="latest") as record:
        state, path = load_latest_intact(run, model, opt)
    one_line_warnings(record)
    assert path == folder / "step_000002.pt" and state["step"] == 2
    assert_weights_equal(model, w2)
    with pytest.warns(CheckpointWarning):
        assert latest_checkpoint(run) == folder / "step_000002.pt"
    assert evil.resolve() not in loaded
    assert not marker.exists()
    # even when handed the file directly, weights_only=True refuses to run its code
    with pytest.raises(CheckpointCorrupt, match="torch.load failed"):
        load_checkpoint(evil, model)
    assert not marker.exists()


def test_pointer_to_an_older_intact_checkpoint_is_honoured(tmp_path):
    w1, _ = two_checkpoints(tmp_path)
    (ckdir(tmp_path) / "latest").write_text("step_000001.pt\n")
    model, opt = make_model(seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        _, path = load_latest_intact(tmp_path, model, opt)
    assert path.name == "step_000001.pt"
    assert_weights_equal(model, w1)


# ------------------------------------------------------------------------------------------------ retention

def test_keep_n_keeps_the_newest_n_with_their_checksums(tmp_path):
    model, opt = make_model()
    for step in range(1, 6):
        train_step(model, opt, step)
        save_checkpoint(tmp_path, step, model, opt, keep=3)
    names = sorted(p.name for p in ckdir(tmp_path).iterdir())
    assert names == ["latest"] + [f"step_00000{s}.pt{x}" for s in (3, 4, 5) for x in ("", ".sha256")]
    save_checkpoint(tmp_path, 6, model, opt, keep=1)
    assert sorted(p.name for p in ckdir(tmp_path).iterdir()) == ["latest", "step_000006.pt",
                                                                  "step_000006.pt.sha256"]


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_a_positive_integer(tmp_path, keep):
    model, opt = make_model()
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, model, opt, keep=keep)
    assert not (ckdir(tmp_path) / "step_000001.pt").exists()


def test_orphan_temp_files_are_removed(tmp_path):
    model, opt = make_model()
    save_checkpoint(tmp_path, 1, model, opt)
    folder = ckdir(tmp_path)
    orphans = [folder / ".step_000002.pt.k3j4h5.tmp", folder / ".latest.abc123.tmp",
               folder / ".step_000002.pt.sha256.zz9.tmp", folder / "step_000000.pt.sha256"]
    for p in orphans:
        p.write_bytes(b"partial")
    keepers = [folder / "notes.txt", folder / ".hidden"]
    for p in keepers:
        p.write_text("mine")
    train_step(model, opt)
    save_checkpoint(tmp_path, 2, model, opt)
    assert [p for p in orphans if p.exists()] == []
    assert all(p.exists() for p in keepers)
    assert (folder / "step_000001.pt").exists() and (folder / "step_000002.pt").exists()


def test_written_checkpoint_files_have_ordinary_modes(tmp_path):
    model, opt = make_model()
    path = save_checkpoint(tmp_path, 1, model, opt)
    for p in (path, ck.checksum_path(path), ckdir(tmp_path) / "latest"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


# ------------------------------------------------------------------------------------------------ non-finite

@pytest.mark.parametrize("where", ["param", "master", "moment"])
def test_non_finite_state_is_not_saved_and_latest_is_unchanged(tmp_path, where):
    model, opt = make_model()
    train_step(model, opt)
    first = save_checkpoint(tmp_path, 1, model, opt)
    before = first.read_bytes()
    train_step(model, opt, 2)
    name = "model.layers.0.self_attn.q_proj.weight"
    index = [n for n, p in model.named_parameters() if p.requires_grad].index(name)
    with torch.no_grad():
        if where == "param":
            model.get_parameter(name).view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            expect = rf"{name} holds 3 non-finite"
        elif where == "master":
            opt.masters[index].view(-1)[5] = float("nan")
            expect = rf"optimizer\.masters\.{index} holds 1 non-finite"
        else:
            opt.optimizer.state[opt.masters[index]]["exp_avg_sq"].view(-1)[0] = float("inf")
            expect = rf"optimizer\.optimizer\.state\.{index}\.exp_avg_sq holds 1 non-finite"
    with pytest.raises(ValueError, match=expect) as err:
        save_checkpoint(tmp_path, 2, model, opt)
    assert "\n" not in str(err.value)
    folder = ckdir(tmp_path)
    assert not (folder / "step_000002.pt").exists() and not (folder / "step_000002.pt.sha256").exists()
    assert (folder / "latest").read_text() == "step_000001.pt"
    assert first.read_bytes() == before
    assert not list(folder.glob(".*.tmp"))


# ------------------------------------------------------------------------------------------------ RNG

def draws():
    return (torch.rand(4).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1),
            np.random.rand(3).tolist(), float(np.random.standard_normal()))


def test_rng_states_round_trip(tmp_path):
    model, opt = make_model()
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    random.gauss(0, 1)  # python caches the second value of its Box-Muller pair (gauss_next)
    np.random.standard_normal()  # so does numpy's legacy generator (has_gauss)
    path = save_checkpoint(tmp_path, 1, model, opt)
    expected = draws()
    draws()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    assert draws() != expected
    load_checkpoint(path, model, opt)
    assert draws() == expected


def test_rng_restore_rejects_an_unknown_layout():
    state = ck.rng_state()
    state["numpy"] = np.random.get_state()  # the old layout: a tuple with an ndarray
    with pytest.raises(ValueError, match="RNG state in an unknown layout"):
        ck.set_rng_state(state)


# ------------------------------------------------------------------------------------------------ bad contents

def save_raw(run, state, step=1):
    path = ckdir(run) / f"step_{step:06d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    ck.checksum_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    return path


def test_state_missing_expected_keys_is_one_clear_error(tmp_path):
    model, opt = make_model()
    path = save_raw(tmp_path, {"step": 1, "model": weights(model)})  # no optimizer / RNG
    load_checkpoint(path, model)  # weights only: enough
    with pytest.raises(ValueError, match=r"lacks \['optimizer', 'rng'\]") as err:
        load_checkpoint(path, model, opt)
    assert "\n" not in str(err.value)
    path = save_raw(tmp_path, {"step": 1}, step=2)
    with pytest.raises(ValueError, match=r"lacks \['model'\]"):
        load_checkpoint(path, model)


def test_parameters_the_model_lacks_or_misses_are_clear_errors(tmp_path):
    model, opt = make_model()
    extra = weights(model)
    extra["model.not_there"] = torch.zeros(2)
    with pytest.raises(ValueError, match="holds parameters this model lacks"):
        load_checkpoint(save_raw(tmp_path, {"step": 1, "model": extra}), model)
    fewer = weights(model)
    fewer.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"lacks 1 trainable parameter\(s\).*model\.norm\.weight"):
        load_checkpoint(save_raw(tmp_path, {"step": 2, "model": fewer}, step=2), model)
    shaped = weights(model)
    shaped["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="parameter shapes differ"):
        load_checkpoint(save_raw(tmp_path, {"step": 3, "model": shaped}, step=3), model)


def test_optimizer_state_that_does_not_fit_is_one_clear_error(tmp_path):
    model, opt = make_model()
    train_step(model, opt)
    path = save_checkpoint(tmp_path, 1, model, opt)
    float_model = QuarlForCausalLM(tiny_config("llama"))  # float32: no masters
    plain = torch.optim.AdamW(float_model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="optimizer state does not fit") as err:
        load_checkpoint(path, float_model, plain)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ trainer

def test_trainer_resume_skips_a_damaged_latest(tmp_path):
    from test_trainer import make_cfg, make_trainer

    part = make_trainer(make_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=2"))
    part.train()
    folder = ckdir(tmp_path / "run")
    assert (folder / "latest").read_text() == "step_000004.pt"
    corrupt(folder / "step_000004.pt", "truncated")
    cfg = make_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=2")
    cfg.resume = str(tmp_path / "run")
    trainer = make_trainer(cfg)
    with pytest.warns(CheckpointWarning, match="step_000004.pt"):
        trainer.prepare_run_dir()
    trainer.log.close()
    assert trainer.start_step == 2


# ------------------------------------------------------------------------------------------------ export

def test_export_refuses_a_non_empty_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    check_export_target(out)  # empty: fine
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="--overwrite") as err:
        export_from_run(tmp_path / "no-such-run", out)  # refused before anything is loaded
    assert "\n" not in str(err.value)
    assert (out / "precious.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        check_export_target(tmp_path / "file", overwrite=True)


def test_export_run_overwrite_and_modes(tmp_path):
    from quarl.config import load_config

    cfg = load_config(None, ["lora.rank=4", "model.device=cpu"])
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama"))
    from quarl.model.precision_apply import apply_precision

    apply_precision(model, cfg.precision)
    out = tmp_path / "out"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "stale.bin").write_text("old")
    with pytest.raises(ValueError, match="--overwrite"):
        export_run(model, tiny_tokenizer(), cfg, out, overwrite=False)
    assert (out / "hf" / "stale.bin").exists()
    export_run(model, tiny_tokenizer(), cfg, out, overwrite=True)
    assert not (out / "hf" / "stale.bin").exists()
    assert (out / "hf" / "model.safetensors").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    for folder, dirs, files in os.walk(out):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755, folder
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) == 0o644, (folder, f)


def test_export_from_run_refuses_then_overwrites(tmp_path):
    from test_trainer import make_cfg, make_trainer

    from quarl.model.loading import save_pretrained

    cfg = make_cfg(tmp_path, "lora.rank=4")
    trainer = make_trainer(cfg)
    trainer.train()
    run = tmp_path / "run"
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    save_pretrained(QuarlForCausalLM(tiny_config("llama")), tiny_tokenizer(), base_dir)
    cfg_path = run / "config.yaml"
    cfg_path.write_text(cfg_path.read_text().replace("smollm2-135m-instruct", str(base_dir)))
    out = export_from_run(run)
    assert out == run / "export" and (out / "hf" / "model.safetensors").is_file()
    first = (out / "hf" / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="--overwrite"):
        export_from_run(run)
    assert (out / "hf" / "model.safetensors").stat().st_mtime_ns == first
    assert export_from_run(run, overwrite=True) == out
    for folder, dirs, files in os.walk(out):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755, folder
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) == 0o644, (folder, f)


def test_extra_fields_must_be_plain_types(tmp_path):
    model, opt = make_model()
    path = save_checkpoint(tmp_path, 1, model, opt, note="ok", sizes=[1, 2.5, None], meta={"a": torch.zeros(2)})
    state = load_checkpoint(path, model)
    assert state["note"] == "ok" and state["sizes"] == [1, 2.5, None]
    assert torch.equal(state["meta"]["a"], torch.zeros(2))
    with pytest.raises(TypeError, match=r"meta\.b is a ndarray"):
        save_checkpoint(tmp_path, 2, model, opt, meta={"b": np.zeros(2)})
    with pytest.raises(TypeError, match="where is a .*Path"):
        save_checkpoint(tmp_path, 2, model, opt, where=Path("x"))
    assert not (ckdir(tmp_path) / "step_000002.pt").exists()


def test_after_a_fallback_resume_the_damaged_newer_checkpoint_is_retired(tmp_path):
    w1, _ = two_checkpoints(tmp_path)
    folder = ckdir(tmp_path)
    corrupt(folder / "step_000002.pt", "truncated")
    model, opt = make_model(seed=7)
    with pytest.warns(CheckpointWarning):
        load_latest_intact(tmp_path, model, opt)
    save_checkpoint(tmp_path, 1, model, opt, keep=2)  # the run goes on from step 1: its step 2 is redone
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_000001.pt", "step_000001.pt.sha256"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        _, path = load_latest_intact(tmp_path, make_model()[0])
    assert path.name == "step_000001.pt"
