"""Workloads: the Azure trace loader and Helix's filter, rate scaling, Poisson arrivals, the shipped samples;
and the metrics' aggregates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.testnet.sim import workload as wl
from hetnode.testnet.sim.metrics import RequestRecord, percentiles, slo_attainment

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.0000000,100,10
2023-11-16 18:15:47.5000000,3000,20
2023-11-16 18:15:48.0000000,200,2000
2023-11-16 18:15:50.0000000,300,30
2023-11-16 18:15:56.0000000,400,40
"""


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    return path


def test_load_azure_trace(trace_file: Path) -> None:
    t = wl.load_azure_trace(trace_file)
    assert t.timestamps == (0.0, 1.5, 2.0, 4.0, 10.0)
    assert t.inputs == (100, 3000, 200, 300, 400) and t.outputs == (10, 20, 2000, 30, 40)
    assert t.rate == pytest.approx(4 / 10.0)


def test_helix_length_filter(trace_file: Path) -> None:
    t = wl.load_azure_trace(trace_file).filtered()
    assert t.inputs == (100, 300, 400) and t.outputs == (10, 30, 40)
    assert t.timestamps == (0.0, 4.0, 10.0)  # still relative to the first request kept
    with pytest.raises(ConfigError):
        wl.load_azure_trace(trace_file).filtered(max_input=10)


def test_bad_trace_files(tmp_path: Path) -> None:
    (tmp_path / "cols.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="missing column"):
        wl.load_azure_trace(tmp_path / "cols.csv")
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(ConfigError, match="line 2"):
        wl.load_azure_trace(tmp_path / "bad.csv")
    with pytest.raises(ConfigError, match="cannot read"):
        wl.load_azure_trace(tmp_path / "missing.csv")


def test_replay_scales_time_to_the_rate(trace_file: Path) -> None:
    t = wl.load_azure_trace(trace_file)
    own = wl.replay(t, duration_s=100.0)
    assert own.arrivals[:5] == t.timestamps  # the trace's own clock...
    assert own.arrivals[5] == pytest.approx(10.0 + 2.5)  # ...repeating after one mean gap (10 s / 4)
    fast = wl.replay(t, rate=2.0, duration_s=10.0)
    assert len(fast) == 20  # exactly rate x duration requests
    assert max(fast.arrivals) < 10.0
    # Request 20 of the repeated trace (the first one left out) lands on the duration: 20 = 4 passes of 12.5 s.
    assert fast.arrivals[1] == pytest.approx(1.5 * 10.0 / 50.0)
    assert fast.inputs[:6] == (100, 3000, 200, 300, 400, 100)
    slow = wl.replay(t, rate=0.1, duration_s=20.0)
    assert len(slow) == 2 and slow.arrivals == (0.0, pytest.approx(1.5 * 20.0 / 2.0))


def test_replay_keeps_the_trace_pattern() -> None:
    t = wl.load_trace("conv")
    w = wl.replay(t, rate=3.0, duration_s=200.0)
    gaps = [b - a for a, b in zip(t.timestamps, t.timestamps[1:], strict=False)][:50]
    scale = w.arrivals[1] / t.timestamps[1]
    assert [b - a for a, b in zip(w.arrivals, w.arrivals[1:], strict=False)][:50] == pytest.approx(
        [g * scale for g in gaps])
    assert w.rate == pytest.approx(3.0, rel=0.02)


def test_poisson_is_seeded_and_draws_lengths_from_the_trace(trace_file: Path) -> None:
    t = wl.load_azure_trace(trace_file)
    a = wl.poisson(5.0, lengths=t, duration_s=200.0, seed=1)
    assert a == wl.poisson(5.0, lengths=t, duration_s=200.0, seed=1)
    assert a != wl.poisson(5.0, lengths=t, duration_s=200.0, seed=2)
    assert len(a) == pytest.approx(1000, rel=0.1)
    assert set(zip(a.inputs, a.outputs, strict=True)) <= set(zip(t.inputs, t.outputs, strict=True))
    gaps = [y - x for x, y in zip(a.arrivals, a.arrivals[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.1)


def test_offline_and_helix_rate(trace_file: Path) -> None:
    t = wl.load_azure_trace(trace_file)
    off = wl.offline(t, backlog=8)
    assert off.offline and off.backlog == 8 and not off.arrivals and len(off) == 5
    assert math.isnan(off.rate)
    # 75% of 10,000 tokens/s in requests of 750 + 250 tokens.
    assert wl.helix_online_rate(10_000.0, 750.0, 250.0) == pytest.approx(7.5)
    with pytest.raises(ConfigError):
        wl.helix_online_rate(0.0, 750.0, 250.0)


def test_shipped_samples_and_trace_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         trace_file: Path) -> None:
    monkeypatch.setattr(wl, "trace_dirs", lambda: [tmp_path / "nowhere"])
    for name in ("conv", "code"):
        path, sample = wl.find_trace(name)
        assert sample and path.parent == wl.SAMPLE_DIR
        t = wl.load_trace(name, length_filter=False)
        assert len(t) == 400 and "shipped sample" in t.source
    (tmp_path / wl.TRACE_FILES["conv"]).write_text(CSV)
    monkeypatch.setattr(wl, "trace_dirs", lambda: [tmp_path])
    assert wl.find_trace("conv") == (tmp_path / wl.TRACE_FILES["conv"], False)
    assert wl.find_trace(str(trace_file)) == (trace_file, False)
    with pytest.raises(ConfigError, match="no trace"):
        wl.find_trace("neither")


def test_trace_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HETNODE_TRACE_DIR", str(tmp_path))
    assert wl.trace_dirs()[0] == tmp_path


def test_sample_conversation_lengths_look_like_the_trace() -> None:
    t = wl.SAMPLE_DIR / wl.SAMPLE_FILES["conv"]
    sample = wl.load_azure_trace(t).filtered()
    assert 500 < sample.mean_input < 1100 and 150 < sample.mean_output < 350


# -- metrics -------------------------------------------------------------------------------------------------


def record(ttft: float, tpot: float, e2e: float, *, finished: bool = True) -> RequestRecord:
    nan = math.nan
    return RequestRecord(id="r", arrival=0.0, input_len=10, output_len=5, generated=5, admitted=0.0,
                         first_token=ttft, finish=e2e if finished else nan, ttft=ttft, tpot=tpot,
                         e2e=e2e if finished else nan, queue=0.0, kv_wait=0.0, max_tbt=tpot, depth=2, path="",
                         measured=True)


def test_percentiles() -> None:
    p = percentiles([float(x) for x in range(1, 101)] + [math.nan])
    assert p["count"] == 100 and p["mean"] == 50.5 and p["max"] == 100.0
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([])["p50"] is None


def test_slo_attainment() -> None:
    rs = [record(1.0, 0.1, 10.0), record(3.0, 0.1, 20.0), record(1.0, 0.5, 30.0), record(1.0, 0.1, 5.0, finished=False),
          record(1.0, math.nan, 2.0)]
    got = slo_attainment(rs, {"ttft": 2.0, "tpot": 0.2})
    assert got == {"ttft": 3 / 5, "tpot": 3 / 5, "all": 2 / 5}
    assert slo_attainment(rs, {}) == {}
    with pytest.raises(ValueError):
        slo_attainment(rs, {"latency": 1.0})
