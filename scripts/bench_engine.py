#!/usr/bin/env python
"""Greedy decoding throughput: our single-process engine (every layer in one shard) vs transformers.generate.

Both run the same model, dtype, prompts and thread count, and generate exactly `new_tokens` tokens per
prompt (EOS is ignored by both), timed end to end (prefill included). `run_benchmark` returns a dict so that
the end-to-end benchmark can reuse it.

    .venv/bin/python scripts/bench_engine.py [--model smollm2-135m] [--batch 1 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Before torch loads: an OpenMP pool that spin-waits between ops steals the core the other side of the comparison
# needs on a shared 2-core machine (measured: 2.4 instead of 36 tokens/s at batch 1).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.ids import SessionId
from hetnode.models import resolve_model
from hetnode.models.resolve import is_gguf
from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer
from hetnode.node.engine import EngineConfig, LocalPipeline, Request, TorchEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a short recipe for pancakes.",
    "Who wrote Pride and Prejudice, and when was it published?",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


def default_threads() -> int:
    # Matmuls are memory-bound at these sizes; more threads than cores only adds contention.
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _load_reference(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    # No EOS at all, rather than min_new_tokens: that would mask EOS out of the logits and change the greedy
    # choice, so the two engines could no longer be compared token for token. (generate() fills a None in
    # the config it is given from the model's own generation config, so it is cleared there.)
    model.generation_config.eos_token_id = None
    return model.eval()


def _time_ours(pipe: LocalPipeline, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    requests = [Request(SessionId(f"bench-{i}"), p, new_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    out = pipe.generate(requests)
    elapsed = time.perf_counter() - start
    return elapsed, [c.tokens for c in out]


def _time_reference(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding, as generate expects
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def run_benchmark(
    model: str = "smollm2-135m",
    batch_sizes: tuple[int, ...] = (1, 8),
    new_tokens: int = 64,
    threads: int | None = None,
    dtype: str = "float32",
    repeats: int = 3,
) -> dict[str, Any]:
    """Tokens/s of ours and of transformers for each batch size, and their ratio.

    The two are timed alternately `repeats` times and the best run of each is kept, so that load from other
    processes on a shared machine slows both alike instead of one of them.
    """
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    threads = threads or default_threads()
    torch.set_num_threads(threads)
    path = resolve_model(model)
    tokenizer = load_tokenizer(path, progress=False)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    engine = TorchEngine.load(path, dtype=torch_dtype, engine_config=EngineConfig(kv_cache_bytes=128 << 20))
    pipe = LocalPipeline([engine])
    reference = _load_reference(path, torch_dtype)
    _time_ours(pipe, prompts[:1], 4)  # warm-up: first-call allocations, thread pool start
    _time_reference(reference, tokenizer, prompts[:1], 4)

    result: dict[str, Any] = {"model": str(path.name), "dtype": dtype, "threads": threads, "new_tokens": new_tokens}
    for batch in batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        ours_times, ref_times = [], []
        for _ in range(repeats):
            elapsed, ours_tokens = _time_ours(pipe, batch_prompts, new_tokens)
            ours_times.append(elapsed)
            elapsed, ref_tokens = _time_reference(reference, tokenizer, batch_prompts, new_tokens)
            ref_times.append(elapsed)
        # transformers pads a batch on the left, which perturbs its float32 results slightly, so a batched
        # reference can drift from ours (and from itself at batch 1) late in a long greedy generation.
        agree = sum(a == b for a, b in zip(ours_tokens, ref_tokens, strict=True))
        tokens = batch * new_tokens
        result[f"batch{batch}"] = {
            "ours_tok_s": tokens / min(ours_times),
            "transformers_tok_s": tokens / min(ref_times),
            "ratio": min(ref_times) / min(ours_times),
            "identical_outputs": f"{agree}/{batch}",
        }
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON only")
    args = parser.parse_args()
    result = run_benchmark(args.model, tuple(args.batch), args.new_tokens, args.threads, args.dtype, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}  {result['dtype']}  threads={result['threads']}  {result['new_tokens']} new tokens")
    print(f"{'batch':>5}  {'ours tok/s':>10}  {'transformers tok/s':>18}  {'ours/transformers':>17}  identical")
    for batch in args.batch:
        r = result[f"batch{batch}"]
        print(
            f"{batch:>5}  {r['ours_tok_s']:>10.1f}  {r['transformers_tok_s']:>18.1f}  {r['ratio']:>16.2f}x"
            f"  {r['identical_outputs']:>9}"
        )


if __name__ == "__main__":
    main()
