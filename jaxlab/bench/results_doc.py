"""Generate ``docs/results.md`` from committed record sets: no number in it is typed by hand.

    jaxlab bench results docs/benchmarks/<run_id> [...] --out docs/results.md

The document holds a hardware disclosure taken from the records themselves, a headline
table of the ratios the project's targets are stated in, and one section per suite with
every record's median and derived figures. Each section says what its numbers show and
what they do not. A test regenerates the file from the committed records and requires
byte equality.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jaxlab.bench.record import Record, RecordError, case_label, cpu_label, load_records
from jaxlab.config.loader import not_utf8

# What each suite's numbers show and do not show (prose; the numbers come from records).
EXPLAIN: dict[str, tuple[str, str]] = {
    "peak": (
        "The device's own ceiling in this run: a jitted square matmul (f32 and bf16) and a "
        "large elementwise copy. Every MFU figure in the same run divides by this peak.",
        "A vendor peak. The CPU's practical matmul rate varies with load and clocks, so MFU "
        "compares runs only when each uses its own run's peak.",
    ),
    "train": (
        "Steady-state time of the jitted, donated train step (forward, backward, AdamW), "
        "with tokens/s and MFU. Compile time is separate and excluded.",
        "End-to-end wall time of `jaxlab train`. The data pipeline and checkpoints run on "
        "the host in parallel with the step and are not part of these samples.",
    ),
    "checkpoint": (
        "Orbax save (sync; the blocking part of an async save, and the same save until "
        "durable), restore, and one train step with and without an async save in flight. "
        "Record sets whose step case reads `async save started, then step, then wait` predate "
        "a fix: each of their async samples also waited for the previous save to finish "
        "(Orbax serialises saves), so their blocking part is a whole save and that step time "
        "includes one.",
        "Durability on other filesystems. These numbers come from a local disk.",
    ),
    "compile": (
        "trace, lower and compile, timed apart with the AOT API, then the first call and "
        "the steady state, plus the cost of compiling for a new input shape.",
        "The model's own compile time. That is logged by each training run (`compile` "
        "events in metrics.jsonl).",
    ),
    "knobs": (
        "The train step of one config under each setting of the training knobs (remat policy, "
        "scan over layers, bf16 parameters with f32 master weights, batch and accumulation), "
        "one record per variant: tokens/s, MFU against the datasheet and the measured peak, "
        "the compile time in stages and the compiled step's memory.",
        "XLA flags, which a process reads once: each flag set is a run of its own (its "
        "run.json says which). Nor the loss: the variants compute the same function.",
    ),
    "prefill": (
        "Prefill latency per prompt length, bucketed (padded to powers of two) against "
        "exact shapes, and the compiles that a sweep of distinct lengths costs in each mode.",
        "Batched prefill of many prompts at once.",
    ),
    "decode": (
        "Whole greedy generate() calls (prefill plus a fully jitted decode loop), as "
        "tokens/s and per-token latency against batch size, with compile counts.",
        "Serving throughput under concurrent arrivals. See the serve suite.",
    ),
    "speculative": (
        "Batch-1 greedy generation with and without speculative decoding (prompt lookup), the "
        "two sides alternating, on code completion over held-out stdlib files and on random "
        "prompts, with the acceptance rate; the speculative tokens are checked to equal the "
        "plain ones. The model is the one named in the case (weights=).",
        "Other models: the speedup follows how often the model repeats what it has seen, "
        "and on this CPU a verify pass costs about 2.5 plain steps (docs/performance.md).",
    ),
    "kv-cache": (
        "Cached decoding against the naive full-prefix path (the whole sequence recomputed "
        "every token) as the generated length grows.",
        "Memory: the cache reserves max_len positions per row either way.",
    ),
    "tokenizer": (
        "The BPE trainer (ours) and tiktoken encoding, in MB/s, on the Python stdlib source.",
        "Other corpora. Throughput depends on the text's pre-token statistics.",
    ),
    "peer": (
        "jaxlab's GPT-2-like variant (GELU MLP, learned positions, tied embeddings, same "
        "FLOPs per token) side by side with Hugging Face transformers GPT-2 in PyTorch eager "
        "mode on the CPU, with the same shapes, AdamW, and the same run. Record sets marked "
        "interleaved=True alternate the two sides one repetition at a time, so each ratio's "
        "medians share the machine's conditions and pair_ratios gives every pair's own ratio "
        "(with warm_each=1 each side also makes an untimed call right before each timed one, "
        "so neither starts with the other's data in the caches); older sets took each side's "
        "repetitions back to back, minutes apart.",
        "A comparison with compiled PyTorch (torch.compile), which was not measured, or with "
        "other hardware. Both sides share the same 2 cores.",
    ),
    "serve": (
        "A real server on loopback under closed-loop concurrency and open-loop Poisson "
        "arrivals: requests/s, output tokens/s, TTFT, TPOT, ITL and end-to-end latency, with "
        "16 slots against 1 slot (the serialized design). Record sets with the paged KV "
        "cache add its comparisons, each between two servers in interleaved rounds: prefix "
        "caching on against off over requests sharing a prefix (cached_tokens is what the "
        "server reported), 64 slots against 16 with the same KV pool (running_peak is the "
        "running gauge's peak, scraped from /metrics), and the gaps between a running "
        "stream's tokens while long prompts arrive, with chunked prefill and without.",
        "Network effects. Client and server share the same 2 cores, which understates the "
        "server's capacity. A --quick set's paged comparisons use fewer requests and one "
        "round; the headline takes only the full-size ones.",
    ),
}

HEADLINES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("peer", "train_speedup_vs_peer", {}, "training tokens/s, jaxlab / HF GPT-2 (target >= 1.2x)"),
    (
        "peer",
        "generate_speedup_vs_peer",
        {"batch": 1, "weights": None},
        "cached generate, batch 1, jaxlab / HF (target >= 5x)",
    ),
    (
        "peer",
        "generate_ceiling_vs_peer",
        {"batch": 1, "weights": None},
        "batch 1 ceiling: one read of the step's weights per token (torch.sum's rate), / HF",
    ),
    (
        "peer",
        "generate_speedup_vs_peer",
        {"batch": 1, "weights": "int8"},
        "int8 vs HF float32: cached generate, batch 1, jaxlab int8 weights / HF (target >= 5x)",
    ),
    (
        "peer",
        "generate_ceiling_vs_peer",
        {"batch": 1, "weights": "int8"},
        "batch 1 ceiling at int8 bytes: one read of the int8 step's weights per token, / HF",
    ),
    (
        "peer",
        "generate_speedup_vs_peer",
        {"batch": 8},
        "cached generate, batch 8, jaxlab / HF (target >= 2x)",
    ),
    ("peer", "cached_over_naive", {"batch": 8}, "cached / naive generate, batch 8 (target >= 10x)"),
    # Speculative decoding (issue #35): its own suite, or the decode suite's last cases.
    (
        "speculative|decode",
        "speculative_speedup",
        {"workload": "code", "speculative": "ngram", "new_tokens": 128},
        "batch-1 generate, prompt lookup / plain, code completion (target >= 2x)",
    ),
    (
        "speculative|decode",
        "speculative_speedup",
        {"workload": "random", "speculative": "ngram", "new_tokens": 128},
        "the same, random prompts (target >= 0.9x)",
    ),
    # The serve target is set at 128 output tokens; a --quick run's 32-token comparison
    # (more prefill per token) is in its own section but never the headline.
    (
        "serve",
        "slots_speedup",
        {"sampling": "greedy", "new_tokens": 128},
        "server output tokens/s, 16 slots / 1 slot, concurrency 16, greedy, 128 new tokens "
        "(target >= 4x)",
    ),
    (
        "serve",
        "slots_speedup",
        {"sampling": "temperature=0.8", "new_tokens": 128},
        "the same, sampled at temperature 0.8",
    ),
    # The paged KV cache's targets (issue #33), at their full sizes only.
    (
        "serve",
        "prefix_cache_ttft_speedup",
        {"prefix_len": 192, "requests": 48, "rounds": 3},
        "p50 TTFT, prefix caching off / on, 48 requests sharing a 192-token prefix (target >= 3x)",
    ),
    (
        "serve",
        "prefix_cache_throughput_speedup",
        {"prefix_len": 192, "requests": 48, "rounds": 3},
        "output tokens/s, prefix caching on / off, the same requests (target >= 1.5x)",
    ),
    (
        "serve",
        "paged_concurrency_ratio",
        {"prompt_len": 32, "requests": 256, "rounds": 3},
        "peak running requests, 64 slots / 16 slots, one pool of 16 x max_len (target >= 4x)",
    ),
    (
        "serve",
        "paged_throughput_speedup",
        {"prompt_len": 32, "requests": 256, "rounds": 3},
        "output tokens/s at concurrency 64, 64 slots / 16 slots, the same pool (target >= 1.5x)",
    ),
    (
        "serve",
        "interference_itl_p99_ratio",
        {"arrival_prompt_len": 224, "prefill_chunk_tokens": 64, "rounds": 3},
        "p99 gap between a running stream's tokens, 224-token prompts arriving / none, "
        "chunked prefill (target <= 2x)",
    ),
    (
        "serve",
        "interference_itl_p99_ratio",
        {"arrival_prompt_len": 224, "prefill_chunk_tokens": 0, "rounds": 3},
        "the same without chunked prefill (no target: the figure beside it)",
    ),
)


def _fmt(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        a = abs(x)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{x:,.0f}"
        if a >= 1:
            return f"{x:.3g}" if a < 100 else f"{x:.1f}"
        return f"{x:.3g}"
    if isinstance(x, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in x.items())
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)


def _time(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"
    return f"{_fmt(v)} {unit}"


_DERIVED_SHOWN = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "per_token_latency_ms",
    "mfu",
    "mfu_basis",
    "mfu_measured",
    "step_s",
    "bytes_per_step",
    "bw_util",
    "bw_util_basis",
    "step_vs_batch1",
    "gflops",
    "gb_per_s",
    "mb_per_s",
    "prompt_tokens_per_s",
    "prefill_compiles",
    "compile_s",
    "first_over_steady",
    "jaxlab_tokens_per_s",
    "peer_tokens_per_s",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "cached_tokens",
    "running_peak",
    "pages_peak",
    "preemptions",
    "itl_p99_s",
    "tokens_per_event",
    "target",
    "meets_target",
    "loadavg_1m",
    "recompiles_while_timed",
    "interleaved",
    "warm_each",
    "acceptance_rate",
    "switched_off_requests",
    "pair_ratios",
)


def _derived(r: Record) -> str:
    keys = [k for k in _DERIVED_SHOWN if k in r.derived and r.derived[k] is not None]
    return "; ".join(f"{k}={_fmt(r.derived[k])}" for k in keys)


def _matches(r: Record, suite: str, metric: str, case: dict[str, Any]) -> bool:
    return (
        r.suite in suite.split("|")
        and r.metric == metric
        and all(r.case.get(k) == v for k, v in case.items())
    )


def machine(r: Record) -> str:
    """Where a record ran: the CPU's model on the CPU platform, else the devices; for a
    server measured from another process (``server_platform``), the server's platform
    first."""
    here = (
        cpu_label(r.cpu) if r.devices.platform == "cpu" else f"{r.devices.count} x {r.devices.kind}"
    )
    server = r.derived.get("server_platform")
    if server is not None and server != r.devices.platform:
        return f"server on {server}, client on {here}"
    return here


def headline_table(recs: Sequence[Record]) -> list[str]:
    lines = ["| what | ratio | from | machine |", "|---|---|---|---|"]
    for suite, metric, case, what in HEADLINES:
        hit = [r for r in recs if _matches(r, suite, metric, case) and r.status == "ok"]
        if hit:
            r = hit[-1]
            verdict = ""
            if isinstance(r.derived.get("meets_target"), bool):
                met = r.derived["meets_target"]
                verdict = " (target met in every round)" if met else " (target missed)"
            lines.append(
                f"| {what} | **{_fmt(r.stats.median)}x**{verdict} | {r.suite}: "
                f"{case_label(r.case)} | {machine(r)} |"
            )
        else:
            lines.append(f"| {what} | not measured in these record sets | - | - |")
    return lines


START, END = "<!-- results:start -->", "<!-- results:end -->"


def readme_with_results(readme: str, recs: Sequence[Record]) -> str:
    """The README with its results block (between the markers) regenerated."""
    if START not in readme or END not in readme:
        return readme
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    block = "\n".join(["", *headline_table(recs), ""])
    return f"{head}{START}{block}\n{END}{tail}"


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"{path}: {not_utf8(e)}") from None


def _run_meta_note(run_dir: Path, rel: Path, recs: Sequence[Record]) -> str:
    """``: `command` (config)`` from the set's ``run.json``; for an older set without one,
    the suites its records hold."""
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        suites = list(dict.fromkeys(r.suite for r in recs if r.run_id == run_dir.name))
        return f": suites {', '.join(suites)}" if suites else ""
    try:
        meta = json.loads(_read_utf8(meta_path))
    except json.JSONDecodeError as e:
        raise RecordError(f"{meta_path}: not JSON ({e.msg})") from None
    note = f": `{meta['command']}`" if meta.get("command") else ""
    if (run_dir / "config.toml").is_file():
        note += f" ([resolved config]({rel}/config.toml))"
    return note


def render(run_dirs: Sequence[Path], records: Iterable[Record], root: Path) -> str:
    recs = list(records)
    lines = ["# Results", ""]
    lines += [
        "Generated by `jaxlab bench results` from the committed record sets below. Do not edit "
        "by hand: `tests/bench/test_results_doc.py` regenerates this file and fails if it "
        "differs. The rules behind every number are in [benchmarking.md](benchmarking.md).",
        "",
        "Record sets:",
        "",
    ]
    for d in run_dirs:
        rel = (
            d.resolve().relative_to(root.resolve())
            if d.resolve().is_relative_to(root.resolve())
            else d
        )
        machines = sorted({machine(r) for r in recs if r.run_id == d.name})
        on = f" (on {', '.join(machines)})" if machines else ""
        lines.append(f"- [`{rel}`]({rel}/records.jsonl){on}{_run_meta_note(d, rel, recs)}")
    lines += ["", "## Hardware and software", ""]
    envs = sorted(
        {
            (r.cpu.model, r.cpu.cores, r.devices.platform, r.devices.kind, r.devices.count)
            for r in recs
        }
    )
    for cpu, cores, platform, kind, count in envs:
        lines.append(f"- CPU: {cpu}, {cores} cores; JAX devices: {count} x {platform} ({kind})")
    vers = sorted({tuple(sorted(r.versions.items())) for r in recs})
    for v in vers:
        lines.append("- versions: " + ", ".join(f"{k} {val}" for k, val in v))
    commits = sorted(
        {
            f"{r.git.commit[:10] if r.git.commit else 'unknown'}{' (dirty)' if r.git.dirty else ''}"
            for r in recs
        }
    )
    lines.append(f"- git: {', '.join(commits)}")
    lines.append(
        f"- measured: {min(r.timestamp for r in recs)[:19]} to {max(r.timestamp for r in recs)[:19]} UTC"
    )
    lines += ["", "## Headline ratios", "", *headline_table(recs)]
    suites = list(dict.fromkeys(r.suite for r in recs))
    for s in suites:
        shows, not_shows = EXPLAIN.get(s, ("", ""))
        lines += ["", f"## {s}", ""]
        if shows:
            lines += [f"**What it shows.** {shows}", "", f"**What it does not.** {not_shows}", ""]
        lines += [
            "| case | machine | metric | median | p90 / p99 | n | derived |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in recs if r.suite == s):
            if r.status != "ok":
                lines.append(
                    f"| {case_label(r.case)} | {machine(r)} | {r.metric} | FAILED | - | - "
                    f"| {r.error} |"
                )
                continue
            st = r.stats
            tails = (
                "withheld (n < 20)"
                if st.tails_withheld
                else f"{_time(st.p90, r.unit)} / {_time(st.p99, r.unit)}"
            )
            lines.append(
                f"| {case_label(r.case)} | {machine(r)} | {r.metric} | {_time(st.median, r.unit)} "
                f"| {tails} | {st.n} | {_derived(r)} |"
            )
    return "\n".join(lines) + "\n"


def load_all(run_dirs: Sequence[Path]) -> list[Record]:
    recs: list[Record] = []
    for d in run_dirs:
        recs += load_records(d)
    return recs


def write_results(run_dirs: Sequence[Path], out: Path, readme: Path | None = None) -> Path:
    """Write ``out``; also refresh the results block of ``readme`` when given."""
    recs = load_all(run_dirs)
    out.write_text(render(run_dirs, recs, out.parent), encoding="utf-8")
    if readme is not None and readme.is_file():
        readme.write_text(readme_with_results(_read_utf8(readme), recs), encoding="utf-8")
    return out
