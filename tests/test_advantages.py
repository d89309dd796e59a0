"""group_advantages, dynamic_sampling_keep, overlong_penalty against float64 references and hand values."""

import pytest
import torch

from quarl.rl.advantages import dynamic_sampling_keep, group_advantages, overlong_penalty


def _reference_advantages(rewards, g, scale):
    out = []
    for grp in rewards.double().view(-1, g).tolist():
        mean = sum(grp) / g
        if scale == "none":
            out += [r - mean for r in grp]
        elif g == 1:
            out += [0.0]
        else:
            std = (sum((r - mean) ** 2 for r in grp) / (g - 1)) ** 0.5  # Bessel, as TRL / verl
            out += [(r - mean) / (std + 1e-6) for r in grp]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("g", [1, 2, 5, 8])
def test_group_advantages_match_float64_reference(scale, g):
    rewards = torch.randn(4 * g)
    rewards[:g] = 1.0  # an all-equal group
    got = group_advantages(rewards, g, scale)
    assert got.shape == rewards.shape and got.dtype == torch.float32
    want = _reference_advantages(rewards, g, scale)
    # float32 rounds r - mean to about 2^-24 max|r| of the group, and "std" divides that error by the group's spread:
    # two close rewards (G = 2) amplify it, so the bound scales with max|r| / std, not with the result
    grouped = rewards.double().view(-1, g)
    spread = grouped.std(1, keepdim=True) + 1e-6 if scale == "std" and g > 1 else torch.ones(grouped.shape[0], 1)
    bound = 16 * 2.0 ** -24 * (grouped.abs().amax(1, keepdim=True) / spread + 1)
    assert bool(((got.double() - want).view(-1, g).abs() <= bound).all())
    assert (got[:g] == 0).all()  # no signal from an all-equal group
    # float64 in, float64 out, to rounding
    torch.testing.assert_close(group_advantages(rewards.double(), g, scale), want, rtol=1e-12, atol=1e-12)


def test_group_advantages_by_hand():
    # rewards [1, 0] : mean 0.5, unbiased std sqrt(0.5) → ±0.5/0.70710678
    got = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2)
    a = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(got, torch.tensor([a, -a, 0.0, 0.0]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0]), 2, "none"),
                               torch.tensor([0.5, -0.5, -1.0, 1.0]))
    # integer / bool rewards are accepted
    assert group_advantages(torch.tensor([1, 0, 0, 0]), 4).dtype == torch.float32


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="batch")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5001])
    keep = dynamic_sampling_keep(rewards, 3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, False, True]
    r = torch.randint(0, 2, (40,)).float()
    want = torch.tensor([len(set(grp)) > 1 for grp in r.view(-1, 4).tolist()])
    assert torch.equal(dynamic_sampling_keep(r, 4), want)
    with pytest.raises(ValueError, match="multiple"):
        dynamic_sampling_keep(torch.zeros(5), 2)


def test_overlong_penalty_by_hand_and_reference():
    # L_max = 100, buffer 20, penalty 1: 0 up to 80, −(len − 80)/20 to −1 at 100, −1 beyond
    lengths = torch.tensor([0, 50, 80, 81, 90, 100, 130])
    got = overlong_penalty(lengths, 100, 20, 1.0)
    torch.testing.assert_close(got, torch.tensor([0, 0, 0, -0.05, -0.5, -1.0, -1.0]))
    lens = torch.randint(0, 300, (64,))
    got = overlong_penalty(lens, 256, 64, 0.7)
    want = torch.tensor([-min(max(n - 192, 0), 64) / 64 * 0.7 for n in lens.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("args,needle", [
    ((100, 0, 1.0), "buffer"), ((100, 101, 1.0), "buffer"), ((0, 1, 1.0), "max_new_tokens"),
    ((100, 10, -1.0), "penalty"),
])
def test_overlong_penalty_errors(args, needle):
    with pytest.raises(ValueError, match=needle):
        overlong_penalty(torch.tensor([1, 2]), *args)
