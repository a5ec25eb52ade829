"""``jaxlab serve``: serve a run directory over HTTP (native + OpenAI-compatible API)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from jaxlab.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    JsonOpt,
    SetOpt,
    UsageProblem,
    console,
    emit_json,
)


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def _quiet_libraries() -> None:
    """Orbax/absl warn about the read-only restore; keep that for --log-level DEBUG."""
    import logging

    from jaxlab.cli.common import STATE

    if STATE.log_level != "DEBUG":
        logging.getLogger("absl").setLevel(logging.ERROR)


def _check_step(run_dir: Path, step: int | None) -> None:
    ckpt = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []
    if not steps:
        raise UsageProblem(f"--run-dir {run_dir}: no checkpoints to serve")
    if step is not None and step not in steps:
        raise UsageProblem(f"--step {step}: no such checkpoint (steps: {steps})")


def _cache_note(sched: Any) -> str:
    """`` (n of m compiles from the compilation cache)`` when the persistent cache served any."""
    if sched is None:
        return ""
    hits = sched.engine.compile_cache_hits
    total = sum(sched.engine.compiles.values())
    return f" ({hits} of {total} compiles from the compilation cache)" if hits else ""


def _adapters_note(info: dict[str, Any]) -> str:
    names = info.get("adapters") or []
    return f" + {len(names)} adapter(s) {', '.join(names)}" if names else ""


def register(app: typer.Typer) -> None:
    @app.command(
        epilog="Example: jaxlab serve --run-dir artifacts/runs/demo --port 8000 --slots 8. "
        "SIGTERM drains (ready -> 503, in-flight requests finish) and exits 0."
    )
    def serve(
        run_dir: Annotated[Path, typer.Option("--run-dir", help="The run directory to serve.")],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, help="Checkpoint step (default: the latest)."),
        ] = None,
        host: Annotated[
            str | None, typer.Option("--host", help="Bind address (default serve.host).")
        ] = None,
        port: Annotated[
            int | None,
            typer.Option(
                "--port", min=0, max=65535, help="Port (default serve.port; 0 = any free)."
            ),
        ] = None,
        slots: Annotated[
            int | None, typer.Option("--slots", min=1, help="Decode slots (default serve.slots).")
        ] = None,
        adapter: Annotated[
            list[str] | None,
            typer.Option(
                "--adapter",
                help="Serve a LoRA run's adapter on this base as model NAME: NAME=LORA_RUN_DIR"
                " (repeatable; merged over serve.adapters). Its recorded base must be this"
                " checkpoint.",
            ),
        ] = None,
        set_: SetOpt = None,
        port_file: Annotated[
            Path | None,
            typer.Option("--port-file", help="Write the bound port to this file once listening."),
        ] = None,
        uds: Annotated[
            Path | None,
            typer.Option(
                "--uds",
                help="Listen on this unix socket instead of TCP (e.g. behind a reverse proxy; "
                "the URL is unix:PATH). A socket file left by a dead server is replaced.",
            ),
        ] = None,
        chunk_delay_s: Annotated[
            float,
            typer.Option(
                "--chunk-delay-s",
                min=0.0,
                hidden=True,
                help="Sleep between decode chunks (simulates a slow device; for tests).",
            ),
        ] = 0.0,
        json_: JsonOpt = False,
    ) -> None:
        """Serve a trained run: continuous batching over decode slots, /v1/completions + SSE.

        Prints `listening on URL` (stderr) once the port is bound and `ready: URL` once the
        model is loaded and every bucket is compiled; with --json, one JSON document on
        stdout at that point. Only serve.*, inference.* and runtime.* can be overridden.
        """
        from jaxlab.serve.config import serve_config
        from jaxlab.train.run_dir import RunDir

        if uds is not None:
            given = [
                n
                for n, v in (("--host", host), ("--port", port), ("--port-file", port_file))
                if v is not None
            ]
            if given:
                raise UsageProblem(f"--uds listens on a unix socket: drop {', '.join(given)}")
            if not uds.parent.is_dir():
                raise UsageProblem(f"--uds {uds}: no such directory {uds.parent}")
        if not RunDir(run_dir).exists():
            raise UsageProblem(f"--run-dir {run_dir}: not a run directory (no config.toml)")
        _check_step(run_dir, step)
        from jaxlab.serve.adapters import AdapterProblem, parse_adapter_options

        try:
            adapters = parse_adapter_options(adapter or [])
        except AdapterProblem as e:
            raise UsageProblem(str(e)) from None
        cfg = serve_config(
            run_dir, set_ or [], host=host, port=port, slots=slots, adapters=adapters or None
        )
        spec = cfg.inference.speculative
        if spec.method == "draft" and spec.draft_run_dir is not None:
            from jaxlab.infer.speculative.draft import draft_dir_problem

            problem = draft_dir_problem(run_dir, spec.draft_run_dir)
            if problem is not None:
                raise UsageProblem(problem)

        from jaxlab.runtime import configure_runtime

        configure_runtime(cfg.runtime)
        _quiet_libraries()
        if cfg.serve.adapters:
            from jaxlab.serve.adapters import check_adapters

            try:
                check_adapters(cfg.serve.adapters, run_dir, step)
            except AdapterProblem as e:
                raise UsageProblem(str(e)) from None

        from jaxlab.serve.server import run_server
        from jaxlab.serve.service import ModelService

        def note(line: str) -> None:  # a damaged checkpoint skipped: one line
            console.print(line, markup=False, soft_wrap=True)

        service = ModelService.from_run_dir(cfg, run_dir, step, on_note=note)
        service.chunk_delay_s = chunk_delay_s

        def on_listening(url: str, bound: int) -> None:
            if port_file is not None:
                _write_port_file(port_file, bound)
            console.print(f"listening on {url} (loading the model)", markup=False)

        def on_ready(url: str) -> None:
            info = service.info()
            sched = service.scheduler
            console.print(
                f"ready: {url}  model {info['model']}{_adapters_note(info)} (step {info['checkpoint_step']}, "
                f"{info['platform']}, {info['precision']}), {info['slots']} slots "
                f"in {info['decode_groups']} decode group(s), "
                f"max_len {info['max_len']}, buckets {info['prefill_buckets']}, "
                f"{info['kv_pages']} KV pages of {info['page_size']} tokens, "
                f"warm-up {sched.warmup_s if sched else 0:.1f}s{_cache_note(sched)}",
                markup=False,
                soft_wrap=True,
            )
            if cfg.serve.api_key is not None:
                console.print("API key required on /v1/* (Authorization: Bearer ...)", markup=False)
            if json_:
                doc: dict[str, Any] = {"url": url, **info}
                if uds is None:
                    doc["host"] = cfg.serve.host
                    doc["port"] = int(url.rsplit(":", 1)[1])
                else:
                    doc["uds"] = str(uds)
                doc["compiles"] = sched.compiles_after_warmup if sched else None
                emit_json(doc)

        try:
            result = run_server(service, uds=uds, on_listening=on_listening, on_ready=on_ready)
        except OSError as e:
            where = (
                f"unix socket {uds}" if uds is not None else f"{cfg.serve.host}:{cfg.serve.port}"
            )
            raise UsageProblem(f"cannot listen on {where}: {e.strerror or e}") from None
        # The server is down and uvicorn has put the default handlers back: a late signal
        # (a supervisor repeating SIGTERM) must not kill the process on its way out and turn
        # a clean drain into exit 143.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if result.error is not None and result.signal is None:
            console.print(f"[bold red]error:[/] model failed: {result.error}", markup=True)
            raise typer.Exit(EXIT_FAILURE)
        if result.signal is not None:
            name = signal.Signals(result.signal).name
            how = "drained" if result.drained else "stopped (drain incomplete)"
            console.print(f"{name}: {how}; exiting", markup=False)
            if result.forced:
                raise typer.Exit(
                    EXIT_TERMINATED if result.signal == signal.SIGTERM else EXIT_INTERRUPTED
                )
            if result.signal == signal.SIGINT:
                raise typer.Exit(EXIT_INTERRUPTED)
