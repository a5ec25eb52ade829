#!/usr/bin/env bash
# The TPU measurements of issue #34, in phases that each fit one device call (<= 10 min).
#
#   bash jaxlab/bench/tpu_bench.sh PHASE [PHASE...]       from the repository root
#
# Phases, in the order worth running them (estimates for one v5e chip; compile time is the
# unknown, so every phase stops itself at the budget and keeps what it measured):
#
#   small    peak and the knobs of tpu-small, most telling first: the preset, the Pallas
#            flash kernel, bf16 params + f32 master weights, twice the batch (with and
#            without remat), scan, accumulation, the attention kernel of issue #34's 65k
#            tokens/s (xla), a remat policy. About 8-9 min.
#   decode   the decode suite of tpu-small with bf16 weights (bytes per step, GB/s, batch
#            1..32) through the paged cache, for the default kernel and Pallas's
#            (TPU_BENCH_DECODE_IMPLS), and with int8 weights too if TPU_BENCH_DECODE_WEIGHTS
#            is "bf16 int8". 3-5 min.
#   medium   the knobs of tpu-medium: the preset (16 as 2 x 8, full remat), Pallas flash,
#            lighter remat policies, micro-batch 4, master weights, scan; remat none last
#            (expected not to fit). 7-9 min.
#   serve    a one-step tpu-small run dir (byte tokenizer, bf16 weights; trained on the host's
#            CPU, which spares the chip a train step's compile), `jaxlab serve --uds`
#            with 64 slots, `jaxlab bench serve --url unix:...` (closed loop up to 64
#            concurrent, Poisson) from a CPU-only client process. About 5-6 min.
#   kernels  the Pallas paged decode kernel: tpu_kernel_smoke.py first (Mosaic lowering and
#            numerics against paged_reference, PASS/FAIL per shape, into the log), then the
#            paged-attention suite at the tpu-small shape (paged_xla, paged_pallas and its
#            block sweep, jax's paged_attention; batch 1/8/32, context 512 and 2,048, bf16:
#            microseconds and GB/s of K/V read). About 4-6 min.
#   smoke    tpu_kernel_smoke.py alone: whether the Pallas paged decode kernel and the decode
#            write lower and are right on the chip, before a decode phase measures them
#            (`smoke decode` in one call). About 1-2 min.
#   attention  the attention kernels alone at the tpu-small shape (batch 16 x 1,024, 12 heads
#            of 64, bf16, packed segments and none), forward and forward + backward:
#            jaxlab's reference, xla and pallas (at its tile sweep) against jax's own
#            flash_attention and splash_attention. About 3-4 min.
#   flags    the tpu-small preset's train step alone (profiled: its trace comes back), then
#            under XLA flag sets, one process each (libtpu reads them once): the scoped VMEM
#            limit at 64 and 96 MiB. About 3-4 min.
#   cpu-serve  the serve phase on the CPU (run it on the 2-core machine, not the TPU, with
#            PYTHON=.venv/bin/python TPU_BENCH_BUDGET_S=7200): the same server and load, for
#            the 10x comparison, in float32 (the CPU's fastest). Long (tens of minutes;
#            TPU_BENCH_SERVE_CONCURRENCY=[64] measures only the comparison's level).
#
# On the device machine (the `device` tool), with the project's wheels carried:
#   carry: [".whl-tpu"]   command: bash jaxlab/bench/tpu_bench.sh small
# It installs .whl-tpu/*.whl (and tensorstore from the machine's own index) under /tmp once
# per machine, keeps the machine's JAX first on PYTHONPATH, and writes the record sets under
# $TPU_BENCH_DIR (artifacts/tpu-bench), then one tarball per call into $OUT (without the
# profiler traces, but for a train step's and a decode call's). TPU_BENCH_BUDGET_S (default 540)
# bounds the call's measuring time. Unpack with `tar xzf tpu-bench-*.tgz -C docs/benchmarks`
# (each run directory is a record set), then `jaxlab bench results docs/benchmarks/*`.
#
# Choosing what a call measures (each unset: the phase as listed above):
#   TPU_BENCH_VARIANTS      the knobs phases' variants, ';'-separated ('' = the preset)
#   TPU_BENCH_DECODE_BATCHES  the decode phase's batch sizes, e.g. [1,32]
#   TPU_BENCH_SERVE_CONCURRENCY  the serve phases' closed-loop levels, e.g. [64]
#
# For a dry run of the machinery on a CPU (tests/bench/test_tpu_bench_script.py does this):
# TPU_BENCH_PLATFORM=cpu, TPU_BENCH_SMALL / TPU_BENCH_MEDIUM (presets to use instead) and
# TPU_BENCH_ARGS (more options for every `jaxlab bench`, e.g. --quick).
set -uo pipefail

cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
PLATFORM="${TPU_BENCH_PLATFORM:-tpu}"
SMALL="${TPU_BENCH_SMALL:-tpu-small}"
MEDIUM="${TPU_BENCH_MEDIUM:-tpu-medium}"
read -r -a ARGS <<<"${TPU_BENCH_ARGS:-}"
BUDGET_S="${TPU_BENCH_BUDGET_S:-540}"
DIR="${TPU_BENCH_DIR:-artifacts/tpu-bench}"
OUT="${OUT:-$DIR/out}"
T0=$(date +%s)
mkdir -p "$DIR" "$OUT"
LOG="$OUT/tpu-bench.log"
export PYTHONUNBUFFERED=1

say() { echo "[tpu-bench $(($(date +%s) - T0))s] $*" | tee -a "$LOG" >&2; }

left() { echo $((BUDGET_S - ($(date +%s) - T0))); }

# Run a jaxlab command with what is left of the budget (minus a margin to pack up).
jx() {
    local t=$(($(left) - 25))
    if [ "$t" -lt 30 ]; then
        say "skipped (budget): jaxlab $*"
        return 124
    fi
    say "jaxlab $* (timeout ${t}s)"
    timeout --signal=INT --kill-after=15 "$t" "$PY" -m jaxlab "$@" >>"$LOG" 2>&1
    local rc=$?
    say "exit $rc"
    return $rc
}

setup() {
    local site=/tmp/jaxlab-site
    if [ "$PLATFORM" = tpu ] && [ ! -f "$site/.done" ]; then
        say "installing .whl-tpu/*.whl and tensorstore into $site"
        PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$site" .whl-tpu/*.whl >>"$LOG" 2>&1 &&
            PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-deps \
                --no-compile --no-cache-dir --only-binary=:all: \
                --index-url file:///opt/pypi/simple --target "$site" tensorstore >>"$LOG" 2>&1 &&
            touch "$site/.done" || say "install failed: see $LOG"
    fi
    # The machine's JAX first; jaxlab from this checkout.
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$PWD"
    "$PY" -c 'import jax, flax, optax, orbax.checkpoint, typer, aiohttp, uvicorn, jaxlab
print("jax", jax.__version__, jax.devices())' >>"$LOG" 2>&1 || say "imports failed: see $LOG"
}

# knobs CONFIG VARIANT... : one `jaxlab bench knobs` run over these variants, most telling first.
knobs() {
    local config=$1
    shift
    local json  # TPU_BENCH_VARIANTS, when set, instead of the phase's list
    json=$("$PY" -c 'import json, os, sys
given = os.environ.get("TPU_BENCH_VARIANTS")
print(json.dumps(sys.argv[1:] if given is None else given.split(";")))' "$@")
    jx bench peak knobs --config "$config" --set "runtime.platform=$PLATFORM" \
        --set "bench.train_variants=$json" --out "$DIR" ${KNOBS_EXTRA:-} "${ARGS[@]}"
}

phase_small() {
    knobs "$SMALL" \
        "" \
        "model.attention_impl=pallas" \
        "model.attention_impl=pallas train.precision.param_dtype=bfloat16 train.precision.master_dtype=float32" \
        "model.attention_impl=pallas train.batch_size=32" \
        "model.attention_impl=pallas train.batch_size=32 train.remat=save_qkv_out_proj" \
        "model.attention_impl=pallas model.scan_layers=true" \
        "model.attention_impl=pallas train.batch_size=32 train.grad_accum_steps=2" \
        "model.attention_impl=xla" \
        "model.attention_impl=pallas train.remat=save_dots_no_batch"
}

phase_decode() {
    # Decode with bf16 weights: bytes per step and GB/s at batch 1..32, through the paged
    # cache, for the default kernel and for the Pallas one (paged_pallas).
    # TPU_BENCH_DECODE_WEIGHTS="bf16 int8" adds int8 weights (issue #35's TPU row) in this call.
    local impl weights
    for weights in ${TPU_BENCH_DECODE_WEIGHTS:-bf16}; do
        for impl in ${TPU_BENCH_DECODE_IMPLS:-auto pallas}; do
            jx bench decode --config "$SMALL" --set "runtime.platform=$PLATFORM" \
                --set train.precision.param_dtype=bfloat16 --set "model.attention_impl=$impl" \
                --set "inference.weights=$([ "$weights" = int8 ] && echo int8 || echo float)" \
                ${TPU_BENCH_DECODE_BATCHES:+--set "bench.decode_batches=$TPU_BENCH_DECODE_BATCHES"} \
                --out "$DIR" "${ARGS[@]}"
        done
    done
}

phase_medium() {
    knobs "$MEDIUM" \
        "" \
        "model.attention_impl=pallas" \
        "model.attention_impl=pallas train.remat=save_dots_no_batch" \
        "model.attention_impl=pallas train.remat=save_qkv_out_proj" \
        "model.attention_impl=pallas train.grad_accum_steps=4 train.remat=save_dots_no_batch" \
        "model.attention_impl=pallas train.precision.param_dtype=bfloat16 train.precision.master_dtype=float32" \
        "model.attention_impl=pallas train.grad_accum_steps=4 train.remat=none" \
        "model.attention_impl=pallas model.scan_layers=true" \
        "model.attention_impl=pallas train.remat=none"
}

phase_attention() {
    jx bench attention --config "$SMALL" --set "runtime.platform=$PLATFORM" --out "$DIR" "${ARGS[@]}"
}

phase_flags() {
    # The preset alone first, in this call: the flag runs' baseline (and a train step's trace).
    KNOBS_EXTRA=--profile knobs "$SMALL" ""
    local flag
    for flag in ${TPU_BENCH_FLAGS:---xla_tpu_scoped_vmem_limit_kib=65536 --xla_tpu_scoped_vmem_limit_kib=98304}; do
        jx bench peak knobs --config "$SMALL" --set "runtime.platform=$PLATFORM" \
            --set 'bench.train_variants=[""]' \
            --set "runtime.libtpu_init_args=[\"$flag\"]" --out "$DIR" "${ARGS[@]}"
    done
}

phase_smoke() {
    # Whether the Pallas paged kernels lower and are right on the chip (PASS/FAIL per shape
    # into the log); $1: seconds to leave for what follows in this call.
    local t=$(($(left) - ${1:-30}))
    [ "$t" -gt 180 ] && t=180
    if [ "$PLATFORM" != tpu ]; then
        say "skipped tpu_kernel_smoke.py: it checks Mosaic, and this run is on $PLATFORM"
    elif [ "$t" -lt 30 ]; then
        say "skipped (budget): tpu_kernel_smoke.py"
    else
        say "tpu_kernel_smoke.py (timeout ${t}s)"
        timeout --signal=INT --kill-after=15 "$t" "$PY" -m jaxlab.bench.tpu_kernel_smoke \
            >>"$LOG" 2>&1
        say "smoke exit $?"
    fi
}

phase_kernels() {
    # The smoke check is quick and says whether the kernel lowers at all; the suite's
    # records say how fast it is (a kernel that fails to lower leaves failed records).
    phase_smoke 240
    jx bench paged-attention --config "$SMALL" --set "runtime.platform=$PLATFORM" \
        --out "$DIR" "${ARGS[@]}"
}

# serve PLATFORM: a one-step run dir, the server on a unix socket, the load from a CPU client.
phase_serve() {
    local platform=$1
    local run="$DIR/serve-run-$platform"
    local sock
    sock=$(mktemp -u /tmp/jaxlab-XXXXXX.sock)
    # Each platform in the precision it runs fastest: bf16 on the chip; float32 on a CPU,
    # where XLA has no fast bf16 dot (a bf16 CPU server would flatter the chip's ratio).
    local dtype=bfloat16
    [ "$platform" = cpu ] && dtype=float32
    if [ ! -d "$run/checkpoints" ]; then
        rm -rf "$run"
        # Trained on the host's CPU whatever the platform: the step's weights are what the
        # server needs, not where they were made, and compiling a train step on the chip
        # cost the first sessions 90 s of device time. The server's --set picks its platform.
        jx train --config "$SMALL" --set runtime.platform=cpu --set tokenizer.kind=byte \
            --set "train.precision.param_dtype=$dtype" \
            --set "train.precision.compute_dtype=$dtype" --set data.source=synthetic \
            --set data.seq_len=128 --set train.batch_size=1 --set train.grad_accum_steps=1 \
            --set train.steps=1 \
            --set "runtime.artifacts_dir=$DIR/artifacts" --run-dir "$run" || return
    fi
    # One prompt bucket past the load's 64-token prompts: few compiles before /ready. A
    # request's timeout long enough for a 64-row CPU step's 128 tokens (about a minute).
    say "jaxlab serve --uds $sock"
    local err="$OUT/serve-$platform.err"
    "$PY" -m jaxlab serve --run-dir "$run" --uds "$sock" --json \
        --set "runtime.platform=$platform" --set 'inference.prefill_buckets=[128]' \
        --set serve.max_queue=512 --set serve.request_timeout_s=1800 \
        >"$OUT/serve-$platform.json" 2>"$err" &
    local server=$!
    while ! grep -q "^ready: unix:" "$err" 2>/dev/null || ! [ -S "$sock" ]; do
        if ! kill -0 "$server" 2>/dev/null || [ "$(left)" -lt 60 ]; then
            say "the server did not get ready"
            kill "$server" 2>/dev/null
            return 1
        fi
        sleep 2
    done
    say "server ready"
    # The client runs on the CPU: the chip is the server's (one process at a time holds it).
    jx bench serve --cpu --config "$SMALL" --set tokenizer.kind=byte \
        --set train.precision.param_dtype=bfloat16 --url "unix:$sock" \
        --set bench.serve_request_timeout_s=1800 \
        ${TPU_BENCH_SERVE_CONCURRENCY:+--set "bench.serve_concurrency=$TPU_BENCH_SERVE_CONCURRENCY"} \
        --out "$DIR" "${ARGS[@]}"
    kill -TERM "$server" 2>/dev/null
    wait "$server"
    say "server exit $?"
}

pack() {
    local name=$1
    local sets=()
    local d
    for d in "$DIR"/20*; do
        [ -f "$d/records.jsonl" ] && sets+=("$(basename "$d")")
    done
    [ ${#sets[@]} -eq 0 ] && return
    tar czf "$OUT/tpu-bench-$name.tgz" -C "$DIR" --exclude=profile "${sets[@]}"
    # Two profiles come back whole: a train step's and the first (batch-1) decode call's.
    local what trace
    for what in knobs-step_time decode-generate_s; do
        trace=$(find "$DIR" -path "*-$what/*" -name perfetto_trace.json.gz 2>/dev/null |
            sort | head -1)
        [ -n "$trace" ] && [ "$(stat -c %s "$trace")" -lt 15000000 ] &&
            cp "$trace" "$OUT/perfetto-$what.json.gz"
    done
    say "packed ${sets[*]} into $OUT/tpu-bench-$name.tgz"
}

[ $# -ge 1 ] || {
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2
    exit 2
}
name=$(IFS=-; echo "$*")
[ "$*" = cpu-serve ] && PLATFORM=cpu
setup
for phase in "$@"; do
    case "$phase" in
    small) phase_small ;;
    decode) phase_decode ;;
    medium) phase_medium ;;
    kernels) phase_kernels ;;
    smoke) phase_smoke ;;
    attention) phase_attention ;;
    flags) phase_flags ;;
    serve) phase_serve "$PLATFORM" ;;
    cpu-serve) phase_serve cpu ;;
    *)
        say "unknown phase $phase (small, decode, medium, kernels, smoke, attention, serve, flags, cpu-serve)"
        exit 2
        ;;
    esac
done
pack "$name"
say "done"
