"""EcoServe's constraint checks and rolling activation (Algorithms 1-2), and mitosis scaling (Fig. 7)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.policy.ecoserve import Decoding, InstanceState, MacroInstance, Mitosis, Slos, check

SLOS = Slos(ttft_s=1.0, tpot_s=0.1)


def prefill(n: int) -> float:
    return n / 1000  # 1,000 tokens a second


def test_each_constraint_can_refuse() -> None:
    roomy = InstanceState(free_kv_tokens=10_000)
    assert check(roomy, (), 500, 700, 0.0, SLOS, prefill) == ""
    assert check(roomy, (400, 300), 400, 600, 0.0, SLOS, prefill).startswith("ttft")  # 1.1 s of prefills
    # Decodes that ran 10 tokens in 0.9 s saved 0.1 s each: a 0.5 s prefill would break their TPOT.
    tight = InstanceState(decodes=(Decoding(10, 4.1), Decoding(10, 4.1)), free_kv_tokens=10_000)
    assert check(tight, (), 500, 700, 5.0, SLOS, prefill).startswith("tpot")
    slack = InstanceState(decodes=(Decoding(40, 4.1),), free_kv_tokens=10_000)
    assert check(slack, (), 500, 700, 5.0, SLOS, prefill) == ""  # 40 x 0.1 - 0.9 = 3.1 s saved
    # The burst's prefills count against the saved TPOT too: 3.1 s saved, 3.2 s of prefills with this one.
    assert check(slack, (900, 900, 900), 500, 700, 5.0, Slos(ttft_s=5.0, tpot_s=0.1), prefill).startswith("tpot")
    assert check(InstanceState(free_kv_tokens=600), (), 500, 700, 0.0, SLOS, prefill).startswith("memory")


def test_requests_stay_on_an_instance_while_it_passes_then_roll_to_the_next() -> None:
    macro = MacroInstance(instances=3)
    states = [InstanceState(free_kv_tokens=10_000) for _ in range(3)]
    bursts: list[tuple[int, ...]] = [(), (), ()]
    assert macro.route(states, bursts, 300, 400, 0.0, SLOS, prefill) == 0 and not macro.moved
    bursts[0] = (400, 400)
    assert macro.route(states, bursts, 300, 400, 0.0, SLOS, prefill) == 1  # 1.1 s of prefills there: the next one
    assert macro.moved
    bursts[1] = (900,)
    assert macro.route(states, bursts, 300, 400, 0.0, SLOS, prefill) == 2
    assert macro.route(states, bursts, 300, 400, 0.0, SLOS, prefill) == 2  # instance 2 is still fine
    assert not macro.moved
    with pytest.raises(ValueError):
        macro.route(states[:2], bursts[:2], 1, 1, 0.0, SLOS, prefill)


def test_mitosis_follows_figure_7() -> None:
    m = Mitosis(lower=3, upper=6, sizes=[6])
    m.expand()
    assert m.sizes == [4, 3]  # step 2: the seventh instance splits N_l off
    m.expand()
    m.expand()
    assert m.sizes == [6, 3]  # step 3: the original fills up again first
    m.expand()
    assert m.sizes == [6, 4]  # step 4: then the new one
    m = Mitosis(lower=3, upper=6, sizes=[6, 5])
    m.contract()
    m.contract()
    assert m.sizes == [6, 3]  # step 5: the smallest down to N_l
    m.contract()
    m.contract()
    m.contract()
    assert m.sizes == [3, 3]  # step 6: then the full one; together they hold N_u
    m.contract()
    assert m.sizes == [5]  # steps 7-8: one more removed, and they merge


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=120))
def test_mitosis_keeps_every_macro_instance_within_bounds(moves: list[bool]) -> None:
    m = Mitosis(lower=3, upper=6)
    for grow in moves:
        before = m.total
        if grow:
            m.expand()
            assert m.total == before + 1
        elif before:
            m.contract()
            assert m.total == before - 1
        assert all(1 <= s <= 6 for s in m.sizes)
        # At most one macro-instance is below N_l (the one being emptied or the first being filled).
        assert sum(s < 3 for s in m.sizes) <= 1
