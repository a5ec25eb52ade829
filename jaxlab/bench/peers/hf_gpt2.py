# pyright: reportMissingImports=false
"""Hugging Face transformers GPT-2 (PyTorch eager, CPU) at a jaxlab preset's shape.

Run by the benchmark harness, by file path, under a Python that has torch and
transformers::

    PEER_PYTHON path/to/hf_gpt2.py

It speaks the session protocol of ``protocol.py`` beside it on stdin/stdout: the harness
prepares a case (``{"task": "train" | "generate" | "read", ...}``; its warm-up calls run
then) and asks for one timed repetition at a time, between jaxlab's own. It must not import jaxlab
(the peer environment may not have it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _model(spec: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=spec["vocab_size"],
        n_positions=spec["max_seq_len"],
        n_embd=spec["d_model"],
        n_layer=spec["n_layers"],
        n_head=spec["n_heads"],
        n_inner=spec["d_mlp"],
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def train(spec: dict) -> tuple[Callable[[], Any], dict]:
    import torch

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    model = _model(spec)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    b, t = spec["batch_size"], spec["seq_len"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec["vocab_size"], (b, t + 1), generator=g)
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> float:
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    n_params = sum(p.numel() for p in model.parameters())
    return step, {"task": "train", "tokens_per_step": b * t, "params": n_params}


def generate(spec: dict) -> tuple[Callable[[], Any], dict]:
    import torch

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    model = _model(spec)
    model.eval()
    b, p, n = spec["batch_size"], spec["prompt_len"], spec["new_tokens"]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec["vocab_size"], (b, p), generator=g)
    kwargs = dict(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=spec["use_cache"],
        pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(prompt, **kwargs)
        assert out.shape[1] == p + n

    return run, {"task": "generate", "new_tokens": b * n, "use_cache": spec["use_cache"]}


def read(spec: dict) -> tuple[Callable[[], Any], dict]:
    """``reads`` streaming reads of a float32 buffer of ``bytes`` (``torch.sum``, every
    thread): the rate at which this machine reads a decode step's weights, for the
    harness's batch-1 ceiling. A model-free task: torch's reduction is the fastest
    multi-threaded read either environment has (XLA:CPU's reduce and NumPy's are slower;
    docs/performance.md)."""
    import torch

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    buf = torch.ones(spec["bytes"] // 4, dtype=torch.float32)  # written, so paged in
    reads = spec["reads"]

    def run() -> None:
        for _ in range(reads):
            buf.sum()

    return run, {"task": "read", "bytes": buf.numel() * 4, "reads": reads}


def prepare(spec: dict) -> tuple[Callable[[], Any], dict]:
    import torch
    import transformers

    tasks = {"train": train, "generate": generate, "read": read}
    if spec.get("task") not in tasks:
        raise ValueError(f"task {spec.get('task')!r}: expected train, generate or read")
    run, info = tasks[spec["task"]](spec)
    info["peer"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
    info["threads"] = torch.get_num_threads()
    return run, info


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from protocol import serve

    serve(prepare)


if __name__ == "__main__":
    main()
