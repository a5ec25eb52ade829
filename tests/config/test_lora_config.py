"""``train.lora`` and ``train.init_from``: off by default, any subset of the targets accepted,
and every bad value a config error that names the field and the fix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.config import ConfigError, load_config, to_toml
from jaxlab.config.loader import from_toml

BASE = "train.init_from='/runs/base'"


def test_lora_is_off_by_default():
    cfg = load_config("tiny", [], environ={})
    assert cfg.train.lora is None and cfg.train.init_from is None


@settings(max_examples=10, deadline=None)
@given(
    targets=st.lists(st.sampled_from(["q", "k", "v", "o", "mlp"]), min_size=1, unique=True),
    rank=st.integers(1, 64),
    alpha=st.floats(0.5, 64.0),
)
def test_any_subset_of_targets_round_trips(targets, rank, alpha):
    sets = [BASE, f"train.lora.rank={rank}", f"train.lora.alpha={alpha}"]
    cfg = load_config("tiny", [*sets, f"train.lora.targets={targets!r}"], environ={})
    assert cfg.train.lora is not None and cfg.train.lora.targets == targets
    assert from_toml(to_toml(cfg)) == cfg


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("train.lora.rank=0", "train.lora.rank"),
        ("train.lora.alpha=0", "train.lora.alpha"),
        ("train.lora.dropout=1.0", "train.lora.dropout"),
        ("train.lora.targets=['q','x']", "train.lora.targets"),
        ("train.lora.targets=[]", "train.lora.targets"),
        ("train.lora.targets=['v','v']", "train.lora.targets"),
        ("train.lora.ranks=4", "did you mean 'rank'"),
    ],
)
def test_bad_lora_values_name_the_field(setting, named):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [BASE, setting], environ={})
    assert named in "\n".join(e.value.issues)


def test_lora_needs_a_base():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.lora.rank=8"], environ={})
    assert "train.lora" in e.value.issues[0] and "--from BASE_RUN_DIR" in e.value.issues[0]
