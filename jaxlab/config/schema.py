"""Typed, validated configuration: one pydantic model per concern.

Every field carries its unit in its name (``warmup_steps``, ``timeout_s``) and every
model forbids unknown keys, so a typo is an error rather than a silently ignored value.
Cross-field rules live on :class:`JaxlabConfig` and name the fix in their message.

This module must stay import-light: ``jaxlab --help`` and ``jaxlab config ...`` load it
without importing jax.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jaxlab.config.ranges import SAMPLING_RANGES

#: What a served LoRA adapter's name (the ``model`` of a request) may hold.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")

Dtype = Literal["float32", "bfloat16"]

# Tokens the tokenizer always appends after its learned ranks.
N_SPECIAL_TOKENS = 2
BYTE_VOCAB = 256 + N_SPECIAL_TOKENS
# The chat template's tokens (<|system|>, <|user|>, <|assistant|>, <|end|>), appended after
# those with tokenizer.chat_tokens = true.
N_CHAT_TOKENS = 4


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class DistributedConfig(Section):
    """Multi-process runtime (``jax.distributed``); ``off`` for one process."""

    mode: Literal["off", "auto", "manual"] = Field(
        default="off",
        description="'auto': cluster auto-detection (SLURM, Kubernetes, TPU pods); "
        "'manual': the coordinator fields below (set by `jaxlab launch`).",
    )
    coordinator_address: str | None = Field(default=None, description="host:port of process 0.")
    num_processes: int | None = Field(default=None, ge=1)
    process_id: int | None = Field(default=None, ge=0)
    cpu_collectives: Literal["gloo", "none"] = Field(
        default="gloo", description="CPU cross-process collectives implementation."
    )
    heartbeat_timeout_s: int = Field(
        default=30, ge=1, description="A silent peer fails the others after this long."
    )

    @model_validator(mode="after")
    def _manual(self) -> DistributedConfig:
        if self.mode == "manual":
            missing = [
                f
                for f in ("coordinator_address", "num_processes", "process_id")
                if getattr(self, f) is None
            ]
            if missing:
                raise ValueError(
                    f"runtime.distributed.mode='manual' needs {', '.join(missing)} "
                    "(or use `jaxlab launch -n N -- ...`, which sets them)"
                )
        return self


class RuntimeConfig(Section):
    seed: int = Field(default=0, ge=0, description="Root seed; every PRNG key is derived from it.")
    platform: Literal["auto", "cpu", "gpu", "tpu"] = Field(
        default="auto",
        description="JAX platform to use; 'cpu' forces CPU even on an accelerator host.",
    )
    artifacts_dir: str = Field(
        default="artifacts", description="Root for runs, caches and benchmarks."
    )
    compilation_cache_dir: str | None = Field(
        default=None,
        description=(
            "JAX's persistent compilation cache (a directory): train, resume, eval, generate "
            "and serve load the programs an earlier run compiled instead of compiling them "
            "again (a restarted server warms up in seconds). Unset: off. jaxlab bench never "
            "uses it, so its compile times stay real compiles."
        ),
    )
    xla_flags: list[str] = Field(
        default_factory=list,
        description=(
            "Flags appended to XLA_FLAGS before JAX starts its backend (['--name=value', ...]);"
            " a flag the variable already names keeps the variable's value. Read once per"
            " process."
        ),
    )
    libtpu_init_args: list[str] = Field(
        default_factory=list,
        description=(
            "Flags appended to LIBTPU_INIT_ARGS (the TPU compiler's and runtime's) before JAX"
            " starts its backend, as xla_flags; ignored by other platforms."
        ),
    )
    distributed: DistributedConfig = Field(default_factory=lambda: DistributedConfig())

    @field_validator("xla_flags", "libtpu_init_args")
    @classmethod
    def _flags(cls, flags: list[str]) -> list[str]:
        for f in flags:
            if not f.startswith("--") or len(f) < 3 or any(c.isspace() for c in f):
                raise ValueError(
                    f"expected flags of the form '--name' or '--name=value', without spaces"
                    f" (got {f!r})"
                )
        return flags


class ModelConfig(Section):
    vocab_size: int = Field(default=512, ge=2, description="Rows of the embedding table.")
    n_layers: int = Field(default=2, ge=1)
    d_model: int = Field(default=64, ge=1)
    n_heads: int = Field(default=4, ge=1)
    n_kv_heads: int = Field(default=4, ge=1, description="1 = MQA, n_heads = MHA, between = GQA.")
    d_mlp: int = Field(default=256, ge=1, description="Hidden width of the MLP.")
    max_seq_len: int = Field(
        default=256, ge=1, description="Longest sequence (positions) the model supports."
    )
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    positions: Literal["rope", "learned"] = Field(
        default="rope",
        description="'learned' gives the GPT-2-like variant (absolute position table).",
    )
    rope_theta: float = Field(default=10_000.0, gt=0)
    tie_embeddings: bool = False
    dropout_rate: float = Field(default=0.0, ge=0.0, lt=1.0)
    norm_eps: float = Field(default=1e-6, gt=0)
    attention_impl: Literal["auto", "reference", "xla", "xla_cpu", "xla_tpu", "pallas"] = Field(
        default="auto",
        description=(
            "Attention kernel (jaxlab.kernels): 'reference' the textbook einsum, 'xla'"
            " jax.nn.dot_product_attention, 'xla_cpu' / 'xla_tpu' layouts tuned for XLA on"
            " that platform, 'pallas' flash attention in Pallas (interpret mode on the CPU);"
            " 'auto' = xla_cpu on CPU, pallas on TPU, xla elsewhere."
            " 'einsum' (older configs) = xla_cpu."
        ),
    )

    scan_layers: bool = Field(
        default=False,
        description=(
            "Store the blocks' parameters stacked along a leading layer axis and run the"
            " blocks as one lax.scan: the step compiles one block instead of n_layers (a"
            " shorter compile); the same function as the unrolled model."
        ),
    )

    @field_validator("attention_impl", mode="before")
    @classmethod
    def _old_kernel_names(cls, v: object) -> object:
        return {"einsum": "xla_cpu"}.get(v, v) if isinstance(v, str) else v

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class TokenizerConfig(Section):
    kind: Literal["byte", "bpe"] = "bpe"
    vocab_size: int = Field(
        default=512, ge=BYTE_VOCAB, description="BPE vocabulary including the special tokens."
    )
    train_bytes: int = Field(
        default=2_000_000, ge=1, description="How many bytes of the corpus the BPE trainer reads."
    )
    path: str | None = Field(
        default=None, description="Directory of a saved tokenizer to load instead."
    )
    chat_tokens: bool = Field(
        default=False,
        description="Add the chat template's 4 special tokens (counted in vocab_size); "
        "needed by /v1/chat/completions and the chat-jsonl data source.",
    )

    @model_validator(mode="after")
    def _chat_room(self) -> TokenizerConfig:
        need = BYTE_VOCAB + N_CHAT_TOKENS
        if self.chat_tokens and self.kind == "bpe" and self.vocab_size < need:
            raise ValueError(
                f"tokenizer.vocab_size: must be >= {need} with tokenizer.chat_tokens = true "
                f"(got {self.vocab_size}); raise vocab_size"
            )
        return self

    @property
    def n_vocab(self) -> int:
        if self.kind == "byte":
            return BYTE_VOCAB + (N_CHAT_TOKENS if self.chat_tokens else 0)
        return self.vocab_size


class DataConfig(Section):
    source: Literal["synthetic", "text", "jsonl", "stdlib", "chat-jsonl"] = "synthetic"
    paths: list[str] = Field(
        default_factory=list, description="Files or globs ('text', 'jsonl', 'chat-jsonl')."
    )
    jsonl_text_field: str = "text"
    seq_len: int = Field(default=64, ge=2, description="Tokens per packed training window.")
    eval_fraction: float = Field(
        default=0.05, ge=0.0, lt=1.0, description="Share of documents held out."
    )
    max_bytes: int | None = Field(
        default=None, ge=1, description="Read at most this much of the corpus."
    )
    synthetic_docs: int = Field(
        default=4000, ge=1, description="Documents the synthetic source makes."
    )
    cache_dir: str | None = Field(
        default=None, description="Token cache; default <artifacts_dir>/cache."
    )


class OptimizerConfig(Section):
    learning_rate: float = Field(default=3e-3, gt=0)
    b1: float = Field(default=0.9, ge=0, lt=1)
    b2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    clip_norm: float = Field(
        default=1.0, ge=0, description="Global-norm clipping threshold; 0 = off."
    )


class ScheduleConfig(Section):
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(default=20, ge=0)
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final lr as a share of the peak."
    )


class PrecisionConfig(Section):
    param_dtype: Dtype = Field(
        default="float32",
        description=(
            "The parameters the model reads; also the optimizer's (its moments and updates)"
            " unless master_dtype is set."
        ),
    )
    compute_dtype: Dtype = Field(
        default="float32",
        description="Matmul inputs; logits, softmax, norms and loss stay float32.",
    )
    master_dtype: Dtype | None = Field(
        default=None,
        description=(
            "Master weights: the optimizer updates a copy of the parameters in this dtype"
            " (its moments too), and the parameters the model reads are rounded from it to"
            " param_dtype after every update. Must be wider than param_dtype. Unset (or"
            " 'none'): no master weights."
        ),
    )

    @field_validator("master_dtype", mode="before")
    @classmethod
    def _none(cls, v: object) -> object:
        return None if v == "none" else v  # TOML has no null: --set ...master_dtype=none

    @model_validator(mode="after")
    def _master_wider(self) -> PrecisionConfig:
        if self.master_dtype is not None and not (
            self.master_dtype == "float32" and self.param_dtype == "bfloat16"
        ):
            raise ValueError(
                f"master_dtype={self.master_dtype!r} with param_dtype={self.param_dtype!r}:"
                " master weights must be wider than the parameters; use param_dtype ="
                " 'bfloat16' with master_dtype = 'float32', or leave master_dtype unset"
            )
        return self


#: ``train.remat`` policies: which activations a block keeps for the backward pass (the rest
#: are recomputed there). Names follow ``jax.checkpoint_policies`` and MaxText.
RematPolicy = Literal[
    "none", "full", "save_dots", "save_dots_no_batch", "save_qkv_proj", "save_qkv_out_proj"
]


#: ``train.lora.targets``: the projections an adapter can sit on (``jaxlab.model.lora``).
LoraTarget = Literal["q", "k", "v", "o", "mlp"]


class LoraConfig(Section):
    """LoRA fine-tuning (``docs/lora.md``): low-rank adapters on the base's projections; only
    they train."""

    rank: int = Field(default=8, ge=1, le=1024, description="Rank of every adapter (A, B).")
    alpha: float = Field(
        default=16.0, gt=0, description="Scale numerator: the update is (x A B) * alpha / rank."
    )
    targets: list[LoraTarget] = Field(
        default_factory=lambda: ["q", "v"],
        min_length=1,
        description="Adapted projections: q, k, v (columns of w_qkv), o (w_out), mlp (both"
        " MLP kernels).",
    )
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (training)."
    )

    @field_validator("targets")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each target at most once (got {v})")
        return v


class TrainConfig(Section):
    steps: int = Field(default=200, ge=1)
    batch_size: int = Field(
        default=8, ge=1, description="Global batch in sequences per optimizer step."
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, description="Micro-batches scanned inside one step."
    )
    loss_chunk_tokens: int = Field(
        default=256,
        ge=1,
        le=1 << 20,
        description=(
            "Tokens per block of the fused LM head + cross-entropy (the [tokens, vocab]"
            " logits are made, reduced and differentiated a block at a time, never whole)."
            " 256 keeps a block in a CPU's cache; an accelerator wants fewer, larger blocks"
            " (the TPU presets' choice is measured in docs/performance.md)."
        ),
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    remat: RematPolicy = Field(
        default="none",
        description=(
            "Activation checkpointing per block: 'none' keeps every activation; 'full' keeps"
            " only each block's input; 'save_dots' keeps every matmul output (attention's"
            " too), 'save_dots_no_batch' those of the weight matmuls, 'save_qkv_proj' the"
            " fused QKV projection, 'save_qkv_out_proj' it and attention's output projection."
            " true/false (older configs) = 'full'/'none'."
        ),
    )
    nonfinite_policy: Literal["abort", "skip"] = "abort"
    log_every_steps: int = Field(default=10, ge=1)
    eval_every_steps: int = Field(default=0, ge=0, description="0 = only at the end.")
    eval_batches: int = Field(default=4, ge=1)
    init_from: str | None = Field(
        default=None,
        description=(
            "A run directory to start from (jaxlab train --from): its newest checkpoint's"
            " parameters, model section and tokenizer; fresh optimizer state, step 0."
        ),
    )
    lora: LoraConfig | None = Field(
        default=None,
        description="LoRA adapters on the init_from base (unset: full fine-tuning or training).",
    )

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, v: object) -> object:
        return ("full" if v else "none") if isinstance(v, bool) else v


class CheckpointConfig(Section):
    every_steps: int = Field(default=100, ge=1)
    keep_last: int = Field(default=3, ge=1)
    async_save: bool = True


class ParallelConfig(Section):
    """Mesh shape. -1 on one axis means 'all devices the others leave'."""

    data: int = Field(default=-1, description="Data-parallel axis size (-1 = fill).")
    fsdp: int = Field(default=1, description="Fully sharded data-parallel axis size.")
    tensor: int = Field(default=1, description="Tensor (Megatron) parallel axis size.")

    @model_validator(mode="after")
    def _axes(self) -> ParallelConfig:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        fills = [k for k, v in sizes.items() if v == -1]
        if len(fills) > 1:
            raise ValueError(
                f"only one mesh axis may be -1 (got -1 for {', '.join(fills)}); set the others"
            )
        bad = [k for k, v in sizes.items() if v == 0 or v < -1]
        if bad:
            raise ValueError(f"mesh axis {bad[0]} must be >= 1 or -1 (got {sizes[bad[0]]})")
        return self


class SpeculativeConfig(Section):
    """Speculative decoding (``docs/speculative.md``): a proposer drafts ``k`` tokens per row
    and the model verifies them in one forward pass over ``k + 1`` positions; the output
    follows the model's own distribution exactly (greedy: the same tokens)."""

    method: Literal["off", "ngram", "draft"] = Field(
        default="off",
        description=(
            "'ngram': prompt lookup (the continuation of the latest earlier match of the last"
            " n tokens); 'draft': a small model of the same tokenizer (draft_run_dir)."
        ),
    )
    k: int = Field(default=6, ge=1, le=16, description="Tokens drafted per verify pass.")
    ngram_max: int = Field(default=4, ge=1, le=16, description="Longest suffix n-gram looked up.")
    ngram_min: int = Field(default=2, ge=1, le=16, description="Shortest suffix n-gram looked up.")
    draft_run_dir: str | None = Field(
        default=None, description="The draft model's run directory (method 'draft')."
    )
    min_acceptance: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description=(
            "A request stops speculating once, after probe_tokens drafted tokens, fewer than"
            " this share of its drafted tokens were accepted (it decodes plainly from then on)."
        ),
    )
    probe_tokens: int = Field(
        default=36, ge=1, description="Drafted tokens before min_acceptance is applied."
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"inference.speculative.ngram_min = {self.ngram_min} exceeds ngram_max ="
                f" {self.ngram_max}; set ngram_min <= ngram_max"
            )
        if self.method == "draft" and not self.draft_run_dir:
            raise ValueError(
                "inference.speculative.method = 'draft' needs inference.speculative.draft_run_dir"
                " (a jaxlab run directory with the same tokenizer)"
            )
        return self


class InferenceConfig(Section):
    max_len: int | None = Field(
        default=None, ge=2, description="KV-cache capacity in tokens; default model.max_seq_len."
    )
    prefill_buckets: list[int] | None = Field(
        default=None, description="Prompt length buckets; default powers of two up to max_len."
    )
    # The sampling defaults; their ranges are a request's (jaxlab.config.ranges).
    max_new_tokens: int = 64
    temperature: float = Field(default=0.0, description="0 = greedy.")
    top_k: int = Field(default=0, description="0 = off.")
    top_p: float = Field(default=1.0, description="1.0 = off.")
    seed: int = 0
    stream_chunk_tokens: int = Field(
        default=8, ge=1, description="Tokens decoded per host round trip."
    )
    decode_unroll: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description=(
            "Decode steps per trip of the jitted decode loop (1: one). Unset: the platform's "
            "choice (runtime/tuning.py: two on a TPU for small batches, where XLA then "
            "prefetches a step's first weights behind the step before)."
        ),
    )
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    page_size: int = Field(default=16, ge=1, le=4096, description="Tokens per KV-cache page.")
    num_pages: int | None = Field(
        default=None,
        ge=1,
        description=(
            "KV-cache pages in all (every slot group's pool together). Default: enough for"
            " every slot to hold max_len tokens. Exclusive with kv_cache_mib."
        ),
    )
    kv_cache_mib: float | None = Field(
        default=None,
        gt=0,
        description="KV-cache memory budget in MiB, instead of num_pages.",
    )
    weights: Literal["float", "int8"] = Field(
        default="float",
        description=(
            "The weights inference reads: 'float' as trained (train.precision.param_dtype);"
            " 'int8' quantizes every dense layer and the LM head when the weights are loaded"
            " (per-output-channel symmetric int8, scale applied to the matmul's output;"
            " docs/quantization.md)."
        ),
    )
    activations: Literal["float", "int8"] = Field(
        default="float",
        description=(
            "With weights = 'int8': 'float' multiplies the int8 weights with the activations"
            " in the compute dtype (weight-only); 'int8' also quantizes each matmul's input"
            " per row and runs an int8 x int8 -> int32 dot (the accelerators' int8 path)."
        ),
    )
    kv_cache_dtype: Literal["compute", "int8"] = Field(
        default="compute",
        description=(
            "What the paged KV pool stores: 'compute' the compute dtype; 'int8' int8 K/V with"
            " one float32 scale per (token, kv head), a quarter of a float32 pool's bytes"
            " plus the scales."
        ),
    )

    @model_validator(mode="after")
    def _one_pool_size(self) -> InferenceConfig:
        if self.num_pages is not None and self.kv_cache_mib is not None:
            raise ValueError(
                f"inference.num_pages = {self.num_pages} and inference.kv_cache_mib ="
                f" {self.kv_cache_mib} both size the KV pool: set one of them"
            )
        return self

    @field_validator(*SAMPLING_RANGES)
    @classmethod
    def _in_sampling_range(cls, value: float, info: ValidationInfo) -> float:
        name = info.field_name or ""
        problem = SAMPLING_RANGES[name].problem(name, value)
        if problem is not None:
            raise ValueError(problem)
        return value


class ServeConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    slots: int = Field(
        default=4,
        ge=1,
        description=(
            "Concurrent decode slots, split evenly over serve.decode_groups slot groups; each"
            " group has its own KV page pool, an even share of the server's pages."
        ),
    )
    prefill_batch: int = Field(
        default=8,
        ge=1,
        description=(
            "Largest group of waiting requests prefilled together as one batch; smaller"
            " groups use the powers of two below it (1 = one at a time)."
        ),
    )
    decode_groups: int = Field(
        default=0,
        ge=0,
        description=(
            "Slot groups decoded concurrently, each its own batch on its own thread; must"
            " divide serve.slots. 0 = auto: on the CPU backend the largest divisor of slots"
            " at most the usable cores, elsewhere 1."
        ),
    )
    prefix_caching: bool = Field(
        default=True,
        description="Share the KV pages of prompt prefixes already computed (hash chain).",
    )
    prefill_chunk_tokens: int = Field(
        default=64,
        ge=0,
        description=(
            "Prompt tokens each slot group prefills per scheduler step, between decode chunks,"
            " so running requests keep their pace while a long prompt enters. 0 = whole"
            " prompts."
        ),
    )
    max_queue: int = Field(
        default=64, ge=1, description="Waiting requests before 503 + Retry-After."
    )
    request_timeout_s: float = Field(default=60.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=1_000_000, ge=1)
    max_tokens_limit: int = Field(
        default=256, ge=1, description="Largest max_tokens a request may ask."
    )
    api_key: SecretStr | None = Field(
        default=None, description="If set, /v1/* needs 'Bearer <key>'."
    )
    model_name: str = "jaxlab"
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters served on the base model: {name = LoRA run directory}. A request"
            " picks one with its 'model' field (the base is serve.model_name); each adapter's"
            " recorded base must be the served checkpoint."
        ),
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r}: use letters, digits, '.', '_', ':' or '-' (it is"
                    " the 'model' a request names)"
                )
            if not path:
                raise ValueError(f"adapter {name!r}: the LoRA run directory is empty")
        return v

    @model_validator(mode="after")
    def _adapter_not_base(self) -> ServeConfig:
        if self.model_name in self.adapters:
            raise ValueError(
                f"adapters: {self.model_name!r} is serve.model_name, the base model's name;"
                " give the adapter another name"
            )
        return self


#: A list of sizes or counts, each at least 1 (batch sizes, concurrency levels).
PositiveInts = list[Annotated[int, Field(ge=1)]]


class BenchConfig(Section):
    warmup: int = Field(default=2, ge=0, description="Untimed calls before sampling.")
    repeats: int = Field(default=10, ge=1, description="Timed samples per case.")
    min_samples_for_tails: int = Field(
        default=20, ge=1, description="p90/p99 need this many samples."
    )
    out_dir: str | None = Field(default=None, description="Default <artifacts_dir>/benchmarks.")
    peer_python: str | None = Field(
        default=None,
        description="A Python with torch + transformers, for the 'peer' suite (HF GPT-2).",
    )
    serve_url: str | None = Field(
        default=None,
        pattern=r"^(https?://|unix:.)",
        description=(
            "A running server for the 'serve' suite to load instead of the ones it starts"
            " (its sweep and Poisson cases; no slot comparison): http(s)://HOST:PORT[/prefix],"
            " or unix:PATH for one on a unix socket (`jaxlab serve --uds PATH`)."
            " `jaxlab bench serve --url`."
        ),
    )
    speculative_run_dir: str | None = Field(
        default=None,
        description=(
            "A trained run (e.g. `jaxlab train --config bench-small`, which trains on the"
            " stdlib corpus) for the 'decode' suite's speculative cases: code completion"
            " needs a model that has learnt code. Unset: those cases run the suite's"
            " random-init model on random prompts only."
        ),
    )
    speculative_draft_run_dir: str | None = Field(
        default=None,
        description=(
            "A draft run of speculative_run_dir's tokenizer: the speculative cases then also"
            " measure the 'draft' method."
        ),
    )
    decode_batches: PositiveInts | None = Field(
        default=None,
        min_length=1,
        description=(
            "The 'decode' suite's batch sizes, in order (step_vs_batch1 needs 1 first)."
            " Unset: 1, 4, 8, 16 on a CPU, up to 32 on an accelerator (--quick: fewer)."
        ),
    )
    serve_concurrency: PositiveInts | None = Field(
        default=None,
        min_length=1,
        description=(
            "The 'serve' suite's closed-loop concurrency levels. Unset: 1, 4, 16, 64"
            " (--quick: 1, 4, 16). The Poisson cases need 16 among them (their rate is a"
            " share of its throughput)."
        ),
    )
    serve_request_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "The 'serve' suite's client timeout per request (a request past it counts as"
            " failed, and so does its load's record). A slow server at high concurrency"
            " needs more: a 64-row CPU step serves 128 tokens in about a minute."
        ),
    )
    train_variants: list[str] | None = Field(
        default=None,
        description=(
            "The 'knobs' suite's cases: each a space-separated list of section.field=value"
            " overrides of this config ('' = the config as it is), one record each. Unset:"
            " the preset itself, then one knob changed at a time (remat policies, scan over"
            " layers, param precision, batch and accumulation)."
        ),
    )

    @field_validator("train_variants")
    @classmethod
    def _variants(cls, variants: list[str] | None) -> list[str] | None:
        for v in variants or []:
            for item in v.split():
                key, sep, _ = item.partition("=")
                if not sep or "." not in key:
                    raise ValueError(
                        f"expected space-separated section.field=value items (got {item!r}"
                        f" in {v!r})"
                    )
                if key.startswith("runtime.") or key.startswith("bench."):
                    raise ValueError(
                        f"{key} cannot vary between the cases of one run (XLA reads its flags"
                        " once per process; the runtime and bench sections are the run's):"
                        " run the suite once per value instead"
                    )
        return variants


class JaxlabConfig(Section):
    """The whole resolved configuration of a jaxlab run."""

    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> JaxlabConfig:
        m, t = self.model, self.train
        errors: list[str] = []
        if m.d_model % m.n_heads:
            errors.append(
                f"model.d_model: must be divisible by model.n_heads (got {m.d_model} and "
                f"{m.n_heads}); pick d_model as a multiple of n_heads"
            )
        elif m.positions == "rope" and m.head_dim % 2:
            errors.append(
                f"model.d_model: rotary positions need an even head_dim (got d_model/n_heads = "
                f"{m.head_dim}); pick d_model = n_heads * an even number"
            )
        if m.n_kv_heads > m.n_heads or m.n_heads % m.n_kv_heads:
            errors.append(
                f"model.n_kv_heads: must divide model.n_heads (got n_kv_heads={m.n_kv_heads}, "
                f"n_heads={m.n_heads}); use 1 (MQA), n_heads (MHA) or a divisor"
            )
        if self.data.seq_len > m.max_seq_len:
            errors.append(
                f"data.seq_len: must be <= model.max_seq_len (got {self.data.seq_len} > "
                f"{m.max_seq_len}); lower seq_len or raise max_seq_len"
            )
        if self.tokenizer.n_vocab > m.vocab_size:
            errors.append(
                f"model.vocab_size: smaller than the tokenizer's vocabulary (got "
                f"{m.vocab_size}, expected >= {self.tokenizer.n_vocab}); raise model.vocab_size"
            )
        if self.data.source == "chat-jsonl" and not (
            self.tokenizer.chat_tokens or self.tokenizer.path
        ):
            errors.append(
                "data.source: 'chat-jsonl' renders conversations with the chat template, whose "
                "tokens the tokenizer lacks; set tokenizer.chat_tokens = true"
            )
        if t.batch_size % t.grad_accum_steps:
            errors.append(
                f"train.batch_size: must be divisible by train.grad_accum_steps (got "
                f"{t.batch_size} and {t.grad_accum_steps})"
            )
        if t.lora is not None and t.init_from is None:
            errors.append(
                "train.lora: LoRA trains adapters on a base model, and none is given; pass"
                " --from BASE_RUN_DIR (train.init_from), or remove train.lora"
            )
        p = self.parallel
        if p.data > 0 and p.fsdp > 0:
            dp = p.data * p.fsdp
            micro = t.batch_size // t.grad_accum_steps if t.grad_accum_steps else t.batch_size
            if micro % dp:
                errors.append(
                    f"train.batch_size: the micro-batch (batch_size / grad_accum_steps = "
                    f"{micro}) must be divisible by the data-parallel size "
                    f"(parallel.data * parallel.fsdp = {dp})"
                )
        inf = self.inference
        if inf.max_len is not None and inf.max_len > m.max_seq_len:
            errors.append(
                f"inference.max_len: must be <= model.max_seq_len (got {inf.max_len} > "
                f"{m.max_seq_len})"
            )
        if inf.prefill_buckets is not None:
            cap = inf.max_len or m.max_seq_len
            bs = inf.prefill_buckets
            if not bs or sorted(set(bs)) != bs or bs[0] < 1 or bs[-1] > cap:
                errors.append(
                    f"inference.prefill_buckets: must be strictly increasing, >= 1 and <= "
                    f"{cap} (got {bs})"
                )
        if self.serve.adapters and inf.speculative.method != "off":
            errors.append(
                f"inference.speculative.method: speculative decoding does not run LoRA adapters"
                f" (serve.adapters names {len(self.serve.adapters)}); set"
                " inference.speculative.method=off or serve without adapters"
            )
        if inf.activations == "int8" and inf.weights != "int8":
            errors.append(
                f"inference.activations: 'int8' quantizes the input of int8 weights, but"
                f" inference.weights = {inf.weights!r}; set inference.weights = 'int8' too, or"
                " leave activations at 'float'"
            )
        if m.positions == "learned" and (inf.max_len or m.max_seq_len) > m.max_seq_len:
            errors.append("inference.max_len: learned positions stop at model.max_seq_len")
        sv = self.serve
        if sv.decode_groups and sv.slots % sv.decode_groups:
            errors.append(
                f"serve.decode_groups: must divide serve.slots (got {sv.decode_groups} and "
                f"{sv.slots}); use a divisor of {sv.slots}, or 0 for one group per CPU core"
            )
        if errors:
            raise ValueError("\n".join(errors))
        return self


SECTIONS: dict[str, type[Section]] = {
    name: info.annotation  # type: ignore[misc]
    for name, info in JaxlabConfig.model_fields.items()
}
