"""``runtime.xla_flags`` and ``runtime.libtpu_init_args``: appended to their variables before
a backend starts; the environment's own value of a flag wins; bad flags are config errors."""

from __future__ import annotations

import pytest

from jaxlab.config import ConfigError, load_config
from jaxlab.config.schema import RuntimeConfig
from jaxlab.runtime.platform import apply_flag_config


def test_flags_are_appended_to_their_variables():
    env = {"XLA_FLAGS": "--xla_a=1"}
    rt = RuntimeConfig(
        xla_flags=["--xla_b=2", "--xla_a=9"],
        libtpu_init_args=["--xla_tpu_scoped_vmem_limit_kib=98304"],
    )
    added = apply_flag_config(rt, env)
    assert env["XLA_FLAGS"] == "--xla_a=1 --xla_b=2"  # the environment's --xla_a stays
    assert env["LIBTPU_INIT_ARGS"] == "--xla_tpu_scoped_vmem_limit_kib=98304"
    assert added == {
        "XLA_FLAGS": ["--xla_b=2"],
        "LIBTPU_INIT_ARGS": ["--xla_tpu_scoped_vmem_limit_kib=98304"],
    }
    assert apply_flag_config(RuntimeConfig(), env) == {"XLA_FLAGS": [], "LIBTPU_INIT_ARGS": []}


def test_flags_after_a_backend_started_are_refused_not_ignored():
    import jax

    jax.devices()  # a backend exists now
    with pytest.raises(RuntimeError, match="before JAX starts a backend"):
        apply_flag_config(RuntimeConfig(xla_flags=["--xla_b=2"]))
    assert apply_flag_config(RuntimeConfig())["XLA_FLAGS"] == []  # nothing asked: fine


@pytest.mark.parametrize("bad", ["xla_b=2", "--", "--a b", "-x"])
def test_a_flag_must_look_like_one(bad):
    with pytest.raises(ConfigError, match=r"runtime\.xla_flags"):
        load_config(None, [f'runtime.xla_flags=["{bad}"]'], environ={})
