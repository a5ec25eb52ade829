"""Suite ``serve-lora``: serving throughput with LoRA adapters mixed in one batch, against the
base model alone (``jaxlab bench serve-lora``).

Two in-process servers (:mod:`jaxlab.bench.serve_servers`) over the same randomly initialised
model of the configured shape, :data:`SLOTS` slots each: one serves the base model alone, the
other the same base with :data:`ADAPTERS` LoRA adapters of rank :data:`RANK` on every
projection (``q, k, v, o, mlp``: the most work an adapter adds). The adapters are built in
memory with random ``A`` and random, nonzero ``B`` (a fresh adapter's ``B`` is zero, which
would still run every low-rank product; random weights make no difference to the speed,
which is what this measures, and ``ignore_eos`` fixes every output length).

Both servers get the same prompts and new-token counts, closed-loop at concurrency
:data:`CONCURRENCY`; the adapter server's requests name the adapters round-robin, so every
batched step mixes all of them. The two are measured interleaved (base, adapters, base,
adapters, ...), so a slow spell of a shared machine falls on both. ``--quick`` runs one round
of 16 requests on :data:`QUICK_SLOTS` slots at that concurrency (a check that the suite
works: its ratio is not the figure).

Records: per round and server, the serve suite's ``e2e_s``/``ttft_s``/``tpot_s``/``itl_s``
(:func:`~jaxlab.bench.serve_records.run_records`; case ``model`` is ``base`` or
``adapters``), the adapters' ``e2e_s`` also carrying the base's output tokens/s of the same
round and ``lora_to_base`` (their ratio); then ``lora_throughput_ratio``, one ratio per
round, against :data:`TARGET_RATIO`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.serve_records import ratio_record, run_records
from jaxlab.bench.suites import suite

if TYPE_CHECKING:
    from jaxlab.config import JaxlabConfig
    from jaxlab.serve import ServedModel
    from jaxlab.serve.loadgen import LoadResult

SERVE_LORA_SUITE = "serve-lora"
ADAPTERS = 4
RANK = 8
TARGETS = ("q", "k", "v", "o", "mlp")
SLOTS = 16
CONCURRENCY = 16
#: ``--quick``'s slots and concurrency: one per adapter, still every step mixing all of them,
#: with a fraction of the warm-up compiles of 16 slots (it checks the suite, not the speed).
QUICK_SLOTS = ADAPTERS
#: The adapters' output tokens/s over the base's, at least (issue #36).
TARGET_RATIO = 0.7


def adapter_names() -> list[str]:
    return [f"lora-{i}" for i in range(ADAPTERS)]


@suite(
    SERVE_LORA_SUITE,
    new_shapes=True,
    default=False,
    description=(
        f"HTTP serving: {ADAPTERS} LoRA adapters (rank {RANK}) mixed in one batch vs the base "
        f"alone, output tokens/s at concurrency {CONCURRENCY}"
    ),
)
def serve_lora_suite(ctx: BenchContext) -> Iterator[Record]:
    from jaxlab.bench.serve_servers import Servers
    from jaxlab.bench.serve_suite import request_shape
    from jaxlab.serve.loadgen import closed_loop, completion_bodies, make_prompts

    cfg = ctx.config
    prompt_len, new = request_shape(ctx)
    cap = cfg.inference.max_len or cfg.model.max_seq_len
    names = adapter_names()
    slots = QUICK_SLOTS if ctx.quick else SLOTS
    concurrency = QUICK_SLOTS if ctx.quick else CONCURRENCY
    shape = {"prompt_len": prompt_len, "new_tokens": new, "concurrency": concurrency}
    lora_case = {"adapters": ADAPTERS, "rank": RANK, "targets": ",".join(TARGETS)}
    n = 16 if ctx.quick else 96
    rounds = 1 if ctx.quick else 3

    def bodies(seed: int, adapters: bool) -> list[dict[str, Any]]:
        prompts = make_prompts(n, prompt_len, seed=seed)
        out = completion_bodies(prompts, new, temperature=0.0, seed=seed)
        if adapters:
            for i, body in enumerate(out):
                body["model"] = names[i % len(names)]
        return out

    def warm(adapters: bool) -> Callable[[str, int], object]:
        # Untimed: every bucket is compiled at start-up; this runs the first requests.
        return lambda url, slots: closed_loop(url, bodies(999, adapters)[:slots], slots)

    base_model, lora_model, lora_cfg = _models(cfg, names)
    with (
        Servers(base_model, cfg, cap, warm=warm(False), status=ctx.status) as base_pool,
        Servers(lora_model, lora_cfg, cap, warm=warm(True), status=ctx.status) as lora_pool,
    ):
        urls = {"base": base_pool.get(slots).url, "adapters": lora_pool.get(slots).url}
        results: dict[str, list[LoadResult]] = {"base": [], "adapters": []}
        for rnd in range(rounds):
            for model, url in urls.items():
                ctx.status(f"{model}: concurrency {concurrency}, {n} requests, round {rnd + 1}")
                load = closed_loop(
                    url, bodies(700 + rnd, adapters=model == "adapters"), concurrency
                )
                results[model].append(load)
                case = {"mode": "lora-compare", "model": model, "round": rnd, **shape}
                extra: dict[str, Any] = {"sampling": "greedy"}
                if model == "adapters":
                    case |= lora_case
                    base_tps = results["base"][-1].output_tokens_per_s
                    extra |= {
                        "adapter_weights": "random (A and B); this measures speed only",
                        "output_tokens_per_s_base": base_tps,
                        "lora_to_base": load.output_tokens_per_s / base_tps if base_tps else None,
                    }
                yield from run_records(ctx, load, case, extra, in_process=True)
        ratios = [
            a.output_tokens_per_s / b.output_tokens_per_s
            if a.ok and b.ok and b.output_tokens_per_s > 0
            else None
            for a, b in zip(results["adapters"], results["base"], strict=True)
        ]
        lora, base = results["adapters"], results["base"]
        yield ratio_record(
            ctx,
            "lora_throughput_ratio",
            ratios,
            case={**shape, **lora_case},
            target=TARGET_RATIO,
            derived={
                "output_tokens_per_s": sum(r.output_tokens_per_s for r in lora) / len(lora),
                "output_tokens_per_s_base": sum(r.output_tokens_per_s for r in base) / len(base),
                "adapter_weights": "random (A and B); this measures speed only",
                "errors": sum(r.errors for r in [*lora, *base]),
            },
        )


def _models(cfg: JaxlabConfig, names: list[str]) -> tuple[ServedModel, ServedModel, JaxlabConfig]:
    """The base model alone, the same weights with ``names`` as random adapters, and the
    config naming them (``serve.adapters``: a name's position is its adapter id; the paths
    are never read, the adapters are built here)."""
    from jaxlab.config import JaxlabConfig
    from jaxlab.infer.engine import Engine
    from jaxlab.model import lora, make_model, split_model
    from jaxlab.serve import ServedModel
    from jaxlab.tokenizer import Tokenizer, byte_tokenizer

    tok = Tokenizer.load(cfg.tokenizer.path) if cfg.tokenizer.path else byte_tokenizer()
    graphdef, params = split_model(make_model(cfg.model, cfg.train.precision, seed=0))
    scale = lora.scale_of(2.0 * RANK, RANK)
    adapters = [(random_adapter(cfg, i), scale) for i in range(len(names))]
    engine = Engine(graphdef, params, cfg, adapters=lora.stack(cfg.model, adapters))
    data = cfg.model_dump()
    data["serve"]["adapters"] = {name: f"(random, in memory) {name}" for name in names}
    lora_cfg = JaxlabConfig.model_validate(data)
    return ServedModel(Engine(graphdef, params, cfg), tok), ServedModel(engine, tok), lora_cfg


def random_adapter(cfg: JaxlabConfig, seed: int) -> Any:
    """One rank-:data:`RANK` adapter on :data:`TARGETS` with random ``A`` and ``B`` (``B``
    at the scale a trained one reaches, so the adapted model stays finite)."""
    import jax

    from jaxlab.model import lora

    key = jax.random.PRNGKey(1000 + seed)
    w = lora.init_weights(cfg.model, RANK, TARGETS, jax.random.fold_in(key, 0))
    return {
        name: {
            "a": p["a"],
            "b": 0.01 * jax.random.normal(jax.random.fold_in(key, 1 + i), p["b"].shape),
        }
        for i, (name, p) in enumerate(w.items())
    }
