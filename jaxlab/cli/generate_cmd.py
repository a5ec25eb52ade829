"""``jaxlab generate``: sample text from a trained run's checkpoint.

Human output: the generated text on stdout (streamed as it arrives with ``--stream``) and a
one-line summary on stderr. ``--json``: one document on stdout (text, ids, timings,
compile counts, bucket, checkpoint step, platform, precision); with ``--stream --json`` the
text streams to stderr instead. jax is imported only inside the command body.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from jaxlab.cli.common import JsonOpt, SetOpt, UsageProblem, console, emit_json

#: The sections ``jaxlab generate`` takes from the environment and ``--set``.
GENERATE_SECTIONS = ("inference", "runtime")


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise UsageProblem("give either --prompt or --prompt-file, not both")
    if prompt is None and prompt_file is None:
        raise UsageProblem("no prompt: give --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        from jaxlab.config.loader import not_utf8

        try:
            return prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageProblem(f"--prompt-file {prompt_file}: {not_utf8(e)}") from None
        except OSError as e:
            raise UsageProblem(
                f"--prompt-file {prompt_file}: cannot read it ({e.strerror or e})"
            ) from None
    assert prompt is not None
    return prompt


def _check_sampling(given: dict[str, Any]) -> None:
    """The options given, against the server's ranges (``SamplingParams.problem``, the check
    every request passes), before anything loads: a bad value names its option."""
    from jaxlab.infer.sampling import SamplingParams

    # The defaults are valid, so a problem is one of the given values.
    bad = SamplingParams(**{k: v for k, v in given.items() if v is not None}).problem()
    if bad is not None:
        field, message = bad
        raise UsageProblem(f"--{field.replace('_', '-')}: {message}")


def _speculative_choice(value: str | None) -> tuple[str, str | None] | None:
    """``--speculative`` as ``(method, draft run dir)``; None when not given."""
    if value is None:
        return None
    if value in ("off", "ngram"):
        return value, None
    method, sep, run = value.partition(":")
    if method == "draft" and sep and run:
        return "draft", run
    raise UsageProblem(
        f"--speculative {value!r}: expected 'ngram' (prompt lookup), 'draft:RUN_DIR' (a draft"
        " model trained with the same tokenizer) or 'off'"
    )


def _quiet_libraries() -> None:
    import logging

    from jaxlab.cli.common import STATE

    if STATE.log_level != "DEBUG":
        logging.getLogger("absl").setLevel(logging.WARNING)


def register(app: typer.Typer) -> None:
    @app.command(
        epilog=(
            "Example: jaxlab generate --run-dir artifacts/runs/demo --prompt 'Once upon' "
            "--max-new-tokens 64 --stream"
        )
    )
    def generate(
        run_dir: Annotated[Path, typer.Option("--run-dir", help="A training run directory.")],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, help="Checkpoint step (default: the latest)."),
        ] = None,
        prompt: Annotated[str | None, typer.Option("--prompt", help="The prompt text.")] = None,
        prompt_file: Annotated[
            Path | None, typer.Option("--prompt-file", help="Read the prompt from a file.")
        ] = None,
        max_new_tokens: Annotated[
            int | None,
            typer.Option("--max-new-tokens", min=1, help="Default inference.max_new_tokens."),
        ] = None,
        temperature: Annotated[
            float | None, typer.Option("--temperature", help="0 = greedy (the default).")
        ] = None,
        top_k: Annotated[int | None, typer.Option("--top-k", min=0, help="0 = off.")] = None,
        top_p: Annotated[float | None, typer.Option("--top-p", help="1.0 = off.")] = None,
        seed: Annotated[int | None, typer.Option("--seed", min=0, help="Sampling seed.")] = None,
        kv_cache: Annotated[
            bool,
            typer.Option(
                "--kv-cache/--no-kv-cache",
                help="--no-kv-cache recomputes the whole sequence per token (for comparison).",
            ),
        ] = True,
        stream: Annotated[
            bool,
            typer.Option(
                "--stream", help="Print text as it is generated (inference.stream_chunk_tokens)."
            ),
        ] = False,
        speculative: Annotated[
            str | None,
            typer.Option(
                "--speculative",
                help="Speculative decoding: 'ngram' (prompt lookup), 'draft:RUN_DIR' (a draft"
                " model of the same tokenizer) or 'off'; default inference.speculative.method."
                " The output is the same (greedy) or follows the same distribution (sampled).",
            ),
        ] = None,
        set_: SetOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Generate text from a checkpoint (KV-cached, decode loop inside jit).

        The model, tokenizer and training sections are the run's; inference.* and runtime.*
        take JAXLAB_* variables and --set over the run's config.toml.
        """
        text_prompt = _read_prompt(prompt, prompt_file)
        spec_choice = _speculative_choice(speculative)
        sampled = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
        }
        from jaxlab.train.run_dir import RunDir

        rd = RunDir(run_dir)
        if not rd.exists():
            raise UsageProblem(f"--run-dir {run_dir}: not a run directory (no config.toml)")
        from jaxlab.config.run_config import run_config

        cfg = run_config(run_dir, set_ or [], GENERATE_SECTIONS, "jaxlab generate")
        spec_cfg = cfg.inference.speculative
        if spec_choice is not None:
            method, draft_dir = spec_choice
            spec_cfg = spec_cfg.model_copy(update={"method": method, "draft_run_dir": draft_dir})
        if spec_cfg.method != "off" and not kv_cache:
            raise UsageProblem("--no-kv-cache runs the cache-free baseline, which cannot speculate")
        from jaxlab.runtime import configure_runtime

        configure_runtime(cfg.runtime)  # before jax is imported
        _quiet_libraries()
        _check_sampling(sampled)
        if not rd.checkpoint_dir.is_dir():
            raise UsageProblem(f"--run-dir {run_dir}: no checkpoints to generate from")
        if spec_cfg.method == "draft" and spec_cfg.draft_run_dir is not None:
            from jaxlab.infer.speculative.draft import draft_dir_problem

            problem = draft_dir_problem(run_dir, spec_cfg.draft_run_dir)
            if problem is not None:  # before the target's weights are loaded
                raise UsageProblem(f"--speculative: {problem}")

        from jaxlab.checkpoint import CheckpointNotFound
        from jaxlab.infer import Engine, Request, RequestError, SamplingParams, load_run, offline
        from jaxlab.tokenizer import Detokenizer

        try:
            run = load_run(run_dir, step, cfg=cfg)
        except CheckpointNotFound as e:
            raise UsageProblem(str(e)) from None
        if run.note is not None:
            console.print(run.note, markup=False, soft_wrap=True)
        engine = Engine(run.graphdef, run.params, run.cfg)
        from jaxlab.infer.speculative import DraftMismatch, with_speculation

        try:
            device = with_speculation(engine, spec_cfg, run.tokenizer)
        except (DraftMismatch, FileNotFoundError, CheckpointNotFound) as e:
            raise UsageProblem(f"--speculative: {e}") from None
        sampling = SamplingParams.from_config(run.cfg.inference, **sampled)
        try:
            limits = engine.limits(run.tokenizer.eot_id)
            request = Request.create(run.tokenizer.encode(text_prompt), sampling, limits)
        except RequestError as e:
            raise UsageProblem(str(e)) from None

        if stream:
            out = sys.stderr if json_ else sys.stdout
            detok = Detokenizer(run.tokenizer)
            st = offline.stream(device, [request], kv_cache=kv_cache, tokenizer=run.tokenizer)
            for new in st:
                piece = "".join(detok.feed(t) for t in new[0])
                if piece:
                    out.write(piece)
                    out.flush()
            out.write(detok.finish() + "\n")
            out.flush()
            gen = st.generation
            assert gen is not None
        else:
            gen = offline.generate(device, [request], kv_cache=kv_cache, tokenizer=run.tokenizer)
        res = gen[0]
        doc: dict[str, Any] = {
            "text": res.text,
            "token_ids": res.token_ids,
            "prompt_tokens": res.prompt_tokens,
            "generated_tokens": res.generated_tokens,
            "finish_reason": res.finish_reason,
            "ttft_s": gen.ttft_s,
            "prefill_s": gen.prefill_s,
            "decode_s": gen.decode_s,
            "tokens_per_s": gen.tokens_per_s,
            "compile_s": gen.compile_s,
            "compiles": gen.compiles,
            "compile_cache_hits": engine.compile_cache_hits,
            "bucket": gen.bucket,
            "kv_cache": kv_cache,
            "speculative": None if res.speculative is None else res.speculative.doc(),
            "stream": stream,
            "checkpoint_step": run.step,
            "skipped_checkpoints": [{"step": k.step, "reason": k.reason} for k in run.skipped],
            "platform": engine.platform,
            "precision": engine.precision,
        }
        if json_:
            emit_json(doc)
            return
        if not stream:
            sys.stdout.write((res.text or "") + "\n")
            sys.stdout.flush()
        bucket = f", bucket {gen.bucket}" if gen.bucket is not None else ", no kv cache"
        if res.speculative is not None:
            u = res.speculative
            off = ", then switched off (too few accepted)" if u.switched_off else ""
            bucket += f", {u.method}: {u.accepted_tokens}/{u.draft_tokens} drafts accepted{off}"
        console.print(
            f"{res.generated_tokens} tokens ({res.finish_reason}) from a {res.prompt_tokens}-token "
            f"prompt: ttft {gen.ttft_s * 1e3:.1f} ms, {gen.tokens_per_s:,.0f} tok/s, "
            f"compile {gen.compile_s:.2f}s{bucket}; step {run.step}, "
            f"{engine.platform}, {engine.precision}",
            markup=False,
            soft_wrap=True,
        )
