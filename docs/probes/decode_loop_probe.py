"""The probe behind docs/performance.md's "Two decode steps per loop trip" table (not part
of jaxlab; kept so the table can be reproduced): the decode step at batch 1 and 32 under
per-program XLA options and an unrolled decode loop, every variant in one process.

It times ``measure_generate`` (what the ``decode`` suite calls) on an engine built per
variant with ``inference.decode_unroll`` set, and each program's XLA options passed at
compile time (``Lowered.compile``'s ``compiler_options``, patched in) where a process
flag (``runtime.libtpu_init_args``) would need a process per set. (The table's run
patched an equivalent two-step loop into ``jaxlab.infer.steps``, before
``decode_loop(..., unroll)`` existed.) On the device machine, the project's wheels
installed:

    PROBE_SET="runtime.platform=tpu train.precision.param_dtype=bfloat16 model.attention_impl=pallas" \
      python3 docs/probes/decode_loop_probe.py tpu-small base mblo unroll2 mblo_unroll2 vmem64
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import jax

from jaxlab.bench.infer_suites import step_bytes
from jaxlab.config.loader import load_config, with_overrides
from jaxlab.infer.engine import Engine
from jaxlab.infer.measure import measure_generate

OPTS: dict = {}
_orig_compile = jax.stages.Lowered.compile


def _compile(self, compiler_options=None, **kw):
    opts = {**OPTS, **(compiler_options or {})}
    return _orig_compile(self, opts or None, **kw)


jax.stages.Lowered.compile = _compile  # type: ignore[method-assign]
MBLO = {
    "xla_tpu_memory_bound_loop_optimizer_options": "enabled:true",
    "xla_tpu_enforce_prefetch_fifo_order": "true",
}
VARIANTS = {
    "base": ({}, 1),
    "unroll2": ({}, 2),
    "mblo": (MBLO, 1),
    "mblo_unroll2": (MBLO, 2),
    "mblo_only": ({"xla_tpu_memory_bound_loop_optimizer_options": "enabled:true"}, 1),
    "sched": ({"xla_tpu_enable_all_experimental_scheduler_features": "true"}, 1),
    "vmem64": ({"xla_tpu_scoped_vmem_limit_kib": "65536"}, 1),
    "unroll4": ({}, 4),
}


def main() -> None:
    if os.environ.get("PROBE_REFERENCE_TUNING"):
        from jaxlab.runtime import tuning

        tuning.current = lambda: tuning.REFERENCE  # type: ignore[assignment]
    check = os.environ.get("PROBE_CHECK")
    config = sys.argv[1]
    names = sys.argv[2:] or list(VARIANTS)
    over = os.environ.get("PROBE_SET", "").split()
    cfg = load_config(config, over)
    batches = json.loads(os.environ.get("PROBE_BATCHES", "[1, 32]"))
    new = int(os.environ.get("PROBE_NEW", "128"))
    prompt = 32
    results = []
    print("devices", jax.devices(), flush=True)
    for name in names:
        opts, u = VARIANTS[name]
        OPTS.clear()
        OPTS.update(opts)
        t0 = time.perf_counter()
        try:
            engine = Engine.from_config(
                with_overrides(cfg, [f"inference.decode_unroll={u}"], label=name), seed=0
            )
            row = {"variant": name, "opts": opts, "unroll": u}
            for b in batches:
                t1 = time.perf_counter()
                r = measure_generate(engine, b, prompt, new, repeats=7, warmup=1)
                step = r["decode_s"] / (new - 1)
                total = sum(step_bytes(engine, b, prompt, new))  # what the decode suite counts
                row[f"b{b}_step_ms"] = round(step * 1e3, 4)
                row[f"b{b}_gbps"] = round(total / step / 1e9, 1)
                row[f"b{b}_s"] = round(time.perf_counter() - t1, 1)
            if check:
                from jaxlab.infer import offline
                from jaxlab.infer.measure import generation_requests

                gen = offline.generate(engine, generation_requests(engine, 3, prompt, new))
                row["tokens"] = gen[0].token_ids[:12]
                row["digest"] = hash(tuple(tuple(r.token_ids) for r in gen))
            if len(batches) > 1:
                row["ratio"] = round(
                    row[f"b{batches[-1]}_step_ms"] / row[f"b{batches[0]}_step_ms"], 3
                )
        except Exception as e:  # a flag the compiler refuses: say so, go on
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        row["total_s"] = round(time.perf_counter() - t0, 1)
        print("RESULT", json.dumps(row), flush=True)
        results.append(row)
        engine = None
        gc.collect()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_probe.json"), "a") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
