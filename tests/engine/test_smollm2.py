"""SmolLM2-135M-Instruct from the packaged GGUF: our sharded engine against transformers' GGUF loader.

transformers dequantizes the same Q4_1/Q8_0 tensors to float32 and undoes the same Q/K permutation, so the
two run identical weights. Greedy tokens must match exactly; logits within LOGIT_ATOL (observed differences
are ~1e-4 on logits of magnitude ~20, from oneDNN's summation order).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from engine_helpers import reference_greedy, sessions

from hetnode.models import resolve_model
from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer
from hetnode.node.engine import EngineConfig, LocalPipeline, Request, SamplingParams, TorchEngine

pytestmark = pytest.mark.slow

LOGIT_ATOL = 2e-3
NEW_TOKENS = 24
SPLITS = {1: [0, 30], 2: [0, 13, 30], 3: [0, 7, 19, 30]}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_transformers: Any) -> dict[str, Any]:
    path = resolve_model()
    tokenizer = load_tokenizer(path, progress=False)
    prompts = [
        chat_prompt_ids(tokenizer, QUESTION),
        tokenizer.encode("The three primary colors are"),
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "Write one sentence about the ocean."}]),
    ]
    expected = [reference_greedy(smollm2_transformers, p, NEW_TOKENS) for p in prompts]
    return {"path": path, "tokenizer": tokenizer, "prompts": prompts, "expected": expected}


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_sharded_greedy_matches_transformers(smol: dict[str, Any], shards: int) -> None:
    bounds = SPLITS[shards]
    config = EngineConfig(kv_cache_bytes=16 << 20)
    stages = [TorchEngine.load(smol["path"], a, b, engine_config=config) for a, b in itertools.pairwise(bounds)]
    pipe = LocalPipeline(stages, max_batch_tokens=16)
    params = SamplingParams(stop_token_ids=(2,), return_logits=True)
    requests = [
        Request(s, p, NEW_TOKENS, params, arrival_step=a)
        for s, p, a in zip(sessions(3), smol["prompts"], [0, 2, 3], strict=True)
    ]
    for done, (tokens, logits) in zip(pipe.generate(requests), smol["expected"], strict=True):
        assert done.tokens == tokens
        for ours, theirs in zip(done.logits, logits, strict=True):
            torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    assert all(stage.kv_usage().used_blocks == 0 for stage in stages)


def test_answers_paris(smol: dict[str, Any]) -> None:
    engine = TorchEngine.load(smol["path"], engine_config=EngineConfig(kv_cache_bytes=16 << 20))
    [done] = LocalPipeline([engine]).generate(
        [Request(sessions(1)[0], smol["prompts"][0], 32, SamplingParams(stop_token_ids=(2,)))]
    )
    answer = smol["tokenizer"].decode(done.tokens, skip_special_tokens=True)
    assert "Paris" in answer
    assert done.finish_reason == "stop"
