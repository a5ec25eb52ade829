# pyright: reportMissingImports=false
"""Hugging Face transformers GPT-2 (PyTorch eager, CPU) at a jaxlab preset's shape.

Run by the benchmark harness under a Python that has torch and transformers::

    PEER_PYTHON -m jaxlab.bench.peers.hf_gpt2 '{"task": "train", ...}'   (or as a file path)

It prints one JSON document: raw per-repetition timings in seconds, and what was
measured. It must not import jaxlab (the peer environment may not have it), and it does
no warm-up-free timing: warm-up iterations run first, then each repetition is timed.
"""

from __future__ import annotations

import json
import sys
import time


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


def train(spec: dict) -> dict:
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

    for _ in range(spec.get("warmup", 2)):
        step()
    samples = []
    for _ in range(spec.get("repeats", 5)):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    return {"task": "train", "samples_s": samples, "tokens_per_step": b * t, "params": n_params}


def generate(spec: dict) -> dict:
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

    for _ in range(spec.get("warmup", 1)):
        run()
    samples = []
    for _ in range(spec.get("repeats", 3)):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return {
        "task": "generate",
        "samples_s": samples,
        "new_tokens": b * n,
        "use_cache": spec["use_cache"],
    }


def main(argv: list[str]) -> None:
    import torch
    import transformers

    spec = json.loads(argv[1])
    result = {"train": train, "generate": generate}[spec["task"]](spec)
    result["peer"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
