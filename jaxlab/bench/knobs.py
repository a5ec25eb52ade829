"""Suite ``knobs``: the train step of one config under each setting of the knobs MaxText
measures, one record per setting (``jaxlab bench knobs --config tpu-small``).

A case is a *variant*: space-separated ``section.field=value`` overrides of the run's
config (``bench.train_variants``). By default the config itself comes first, then one knob
changed at a time:

* ``train.remat``: every other policy (none, full, save_dots, save_dots_no_batch,
  save_qkv_proj, save_qkv_out_proj; :mod:`jaxlab.model.remat`);
* ``model.scan_layers``: the other way round (compile time against step time);
* parameters: bf16 parameters with f32 master weights against f32 parameters
  (``train.precision.param_dtype`` / ``master_dtype``);
* batch and accumulation: twice the batch over twice the micro-batches (the same
  micro-batch), twice the micro-batches (half the micro-batch), twice the batch;
* the LM head's cross-entropy block (``train.loss_chunk_tokens``): 16 times larger, or
  16 times smaller where it is large already.

XLA and libtpu flags are read once per process, so they cannot vary between the cases of
one run: run the suite once per flag set (``--set runtime.libtpu_init_args=[...]``); the
run's ``run.json`` records the flags in force.

Each record (metric ``step_time``) carries tokens/s, MFU against both denominators
(``BenchContext.mfu``), the compile time in stages (trace, lower, compile; never in the
samples), the compiled step's memory (``step_memory_bytes``, from XLA's buffer assignment)
and the device's peak so far where the backend reports one. A variant that does not fit
the device, or is not a valid config, is a failed record and the sweep goes on. Each case
builds its own state and frees it before the next, so two never share the device.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite
from jaxlab.config import ConfigError, JaxlabConfig, with_overrides
from jaxlab.config.schema import RematPolicy

KNOBS_SUITE = "knobs"
#: The case label of the config as it is.
AS_CONFIGURED = "as configured"


def default_variants(cfg: JaxlabConfig) -> list[str]:
    """The config itself (``""``), then each knob changed alone (module docstring)."""
    from typing import get_args

    t, p = cfg.train, cfg.train.precision
    out = [""]
    out += [f"train.remat={r}" for r in get_args(RematPolicy) if r != t.remat]
    out.append(f"model.scan_layers={str(not cfg.model.scan_layers).lower()}")
    if p.master_dtype is None and p.param_dtype == "float32":
        out.append("train.precision.param_dtype=bfloat16 train.precision.master_dtype=float32")
    elif p.master_dtype is not None:
        out.append("train.precision.param_dtype=float32 train.precision.master_dtype=none")
    b, a = t.batch_size, t.grad_accum_steps
    out.append(f"train.batch_size={2 * b} train.grad_accum_steps={2 * a}")
    if b % (2 * a) == 0:
        out.append(f"train.grad_accum_steps={2 * a}")
    out.append(f"train.batch_size={2 * b}")
    c = t.loss_chunk_tokens
    out.append(f"train.loss_chunk_tokens={c // 16 if c >= 4096 else c * 16}")
    return out


def variants(cfg: JaxlabConfig) -> list[str]:
    """``bench.train_variants``, or :func:`default_variants`."""
    given = cfg.bench.train_variants
    return list(given) if given is not None else default_variants(cfg)


def variant_config(cfg: JaxlabConfig, variant: str) -> JaxlabConfig:
    """``cfg`` with ``variant``'s overrides (``ConfigError`` naming the variant)."""
    label = f"bench.train_variants {variant!r}"
    return with_overrides(cfg, variant.split(), label=label)


def check(cfg: JaxlabConfig) -> None:
    """Every variant must make a valid config (checked before jax starts: exit 2)."""
    issues: list[str] = []
    for v in variants(cfg):
        try:
            variant_config(cfg, v)
        except ConfigError as e:
            issues += e.issues
    if issues:
        raise ConfigError(issues)


def knob_case(cfg: JaxlabConfig, variant: str) -> dict[str, Any]:
    """A record's case: the variant, and the knobs' values it resolves to."""
    from jaxlab import kernels

    t, p = cfg.train, cfg.train.precision
    return {
        "variant": variant or AS_CONFIGURED,
        "remat": t.remat,
        "scan_layers": cfg.model.scan_layers,
        "param_dtype": p.param_dtype,
        "master_dtype": p.master_dtype or "none",
        "compute_dtype": p.compute_dtype,
        "batch_size": t.batch_size,
        "grad_accum_steps": t.grad_accum_steps,
        "seq_len": cfg.data.seq_len,
        "attention_impl": kernels.resolve(cfg.model.attention_impl),
    }


def knob_record(ctx: BenchContext, base: JaxlabConfig, variant: str) -> Record:
    """One variant's record. Everything it allocates is dropped when it returns."""
    from jaxlab.bench.model_suites import StepRunner
    from jaxlab.model import flops_per_token, param_count

    try:
        cfg = variant_config(base, variant)
    except ConfigError as e:
        return ctx.failure("step_time", "; ".join(e.issues), case={"variant": variant})
    case = knob_case(cfg, variant)
    ctx.status(f"compiling {case['variant']}")
    try:
        runner = StepRunner(cfg, cfg.train.batch_size, cfg.train.grad_accum_steps)
        runner.compile()
    except Exception as e:
        return ctx.failure("step_time", e, case=case)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, training=True)
    fixed = {
        **runner.stages,
        "compile_total_s": sum(runner.stages.values()),
        "params": param_count(cfg.model),
        **runner.memory(),
    }

    def derive(s: Stats) -> dict[str, Any]:
        tps = runner.tokens_per_step / s.median_value
        return {
            "tokens_per_s": tps,
            **ctx.mfu(fpt * tps, dtype=cfg.train.precision.compute_dtype),
            **fixed,
        }

    return ctx.bench("step_time", runner, case=case, derive=derive)


@suite(
    KNOBS_SUITE,
    needs_peak=True,
    default=False,
    check=check,
    description="train step per knob setting: remat, scan, param precision, batch/accum",
)
def knobs_suite(ctx: BenchContext) -> Iterator[Record]:
    for variant in variants(ctx.config):
        yield knob_record(ctx, ctx.config, variant)
        gc.collect()  # the last case's state must be gone before the next one allocates


__all__ = ["KNOBS_SUITE", "check", "default_variants", "knob_record", "variants"]
