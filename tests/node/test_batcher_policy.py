"""The batch loop runs the batch policy on a real engine: KV that does not fit waits, prompt chunks split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import trio

from hetnode.ids import SessionId
from hetnode.models.tiny import write_tiny_model
from hetnode.node.batcher import BatchLoop, Work
from hetnode.node.engine import EngineConfig, ItemResult, StepItem, TorchEngine
from hetnode.node.engine.sampling import GREEDY
from hetnode.policy import PREEMPTED

S = SessionId


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", num_layers=2)


def engine(model_dir: Path, *, blocks: int = 64, budget: int = 8192, first: int = 0,
           last: int | None = None) -> Iterator[TorchEngine]:
    e = TorchEngine.load(model_dir, first, last, engine_config=EngineConfig(block_size=4, num_kv_blocks=blocks,
                                                                            max_batch_tokens=budget))
    yield e
    e.close()


class Outcomes:
    def __init__(self) -> None:
        self.send, self.recv = trio.open_memory_channel[tuple[Work, ItemResult | str]](1000)

    async def deliver(self, done: list[tuple[Work, ItemResult]]) -> None:
        for pair in done:
            self.send.send_nowait(pair)

    async def fail(self, work: Work, reason: str, cause: str) -> None:
        self.send.send_nowait((work, reason))


async def run_items(eng: TorchEngine, works: list[Work], expect: int, *,
                    release_after: dict[str, int] | None = None) -> list[tuple[Work, ItemResult | str]]:
    """Submit `works`, collect `expect` outcomes; release a session once it has had the given number of them."""
    out = Outcomes()
    loop = BatchLoop(eng, deliver=out.deliver, fail=out.fail)
    got: list[tuple[Work, ItemResult | str]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        for w in works:
            await loop.submit(w)
        with trio.fail_after(30):
            while len(got) < expect:
                got.append(await out.recv.receive())
                s = str(got[-1][0].item.session)
                if release_after and sum(str(w.item.session) == s for w, _ in got) == release_after.get(s):
                    loop.release(S(s))
        await loop.stop("test over")
    assert loop.ledger.used >= eng.kv_usage().used_blocks
    return got


async def test_a_prompt_whose_kv_does_not_fit_waits_for_a_release(model_dir: Path) -> None:
    for eng in engine(model_dir, blocks=4):  # 16 tokens of KV
        a = Work(StepItem(S("a"), 0, token_ids=list(range(3, 15)), sampling=GREEDY))  # 3 blocks
        b = Work(StepItem(S("b"), 0, token_ids=list(range(3, 11)), sampling=GREEDY))  # 2 blocks: waits for a
        got = await run_items(eng, [a, b], 2, release_after={"a": 1})
        assert [str(w.item.session) for w, _ in got] == ["a", "b"]
        assert all(isinstance(r, ItemResult) and r.token is not None for _, r in got)


async def test_a_decode_that_cannot_grow_is_preempted_not_the_step(model_dir: Path) -> None:
    for eng in engine(model_dir, blocks=2):
        full = Work(StepItem(S("full"), 0, token_ids=list(range(3, 11)), sampling=GREEDY))
        got = await run_items(eng, [full], 1)
        assert isinstance(got[0][1], ItemResult)
        again = Work(StepItem(S("full"), 8, token_ids=[5], sampling=GREEDY))
        out = Outcomes()
        loop = BatchLoop(eng, deliver=out.deliver, fail=out.fail)
        loop.ledger.reserve(S("full"), 8)  # what the first loop reserved
        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            await loop.submit(again)
            with trio.fail_after(30):
                work, outcome = await out.recv.receive()
            await loop.stop("test over")
        assert outcome == PREEMPTED and work is again and S("full") not in loop.ledger


async def test_a_split_chunk_runs_in_pieces_and_samples_what_the_whole_chunk_samples(model_dir: Path) -> None:
    prompt = [(7 * i) % 90 + 3 for i in range(20)]
    whole_item = StepItem(S("w"), 0, token_ids=prompt, sampling=GREEDY)
    for big in engine(model_dir):
        [expected] = big.step([whole_item])
        # The second layer alone, fed the first layer's hidden states: pieces of hidden rows.
        for first_stage in engine(model_dir, last=1):
            [h] = first_stage.step([StepItem(S("h"), 0, token_ids=prompt)])
    assert expected.token is not None and h.hidden is not None
    for small in engine(model_dir, budget=8):
        got = await run_items(small, [Work(whole_item, ctx="c", prefill_end=20)], 3)
        pieces = [w.item for w, _ in got]
        assert [(p.start, p.num_tokens) for p in pieces] == [(0, 8), (8, 8), (16, 4)]
        assert [p.sampling for p in pieces] == [None, None, GREEDY] and all(w.ctx == "c" for w, _ in got)
        assert [r.token for _, r in got if isinstance(r, ItemResult)] == [None, None, expected.token]
    for tail in engine(model_dir, budget=8, first=1):
        got = await run_items(tail, [Work(StepItem(S("t"), 0, hidden=h.hidden, sampling=GREEDY))], 3)
        results = [r for _, r in got if isinstance(r, ItemResult)]
        assert [w.item.num_tokens for w, _ in got] == [8, 8, 4] and results[-1].token == expected.token
        assert all(torch.equal(w.item.hidden, h.hidden[w.item.start:w.item.start + 8])  # type: ignore[index]
                   for w, _ in got)


@pytest.mark.parametrize("first", [0, 1])
async def test_a_new_shard_times_one_prompt_and_frees_it(model_dir: Path, first: int) -> None:
    """A node that only decodes still knows its prefill rate (the coordinator weighs re-prefilling there against
    moving KV): the loop times one probe prompt through the shard, paced like any step, and keeps no KV of it."""
    for e in engine(model_dir, first=first):
        out = Outcomes()
        unpaced = BatchLoop(e, deliver=out.deliver, fail=out.fail)
        assert unpaced.prefill_rate.value == 0
        rate = await unpaced.measure_prefill(32)
        assert rate > 0 and unpaced.prefill_rate.value == rate
        assert e.kv_usage().used_blocks == 0
        paced = BatchLoop(e, deliver=out.deliver, fail=out.fail, pace=lambda items: 0.2 * items[0].num_tokens / 32)
        assert 0 < await paced.measure_prefill(32) <= 32 / 0.2
        too_long = BatchLoop(e, deliver=out.deliver, fail=out.fail)
        assert await too_long.measure_prefill(64 * 4 + 1) == 0  # more than its 64 blocks of 4: no rate, no harm
        assert too_long.prefill_rate.value == 0 and e.kv_usage().used_blocks == 0
