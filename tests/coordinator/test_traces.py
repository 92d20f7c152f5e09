"""Request ids from headers, the re-plan reasons' labels, and the trace store's bounds and checks."""

from __future__ import annotations

import pytest

from hetnode.coordinator.deployment import replan_kind
from hetnode.coordinator.request_ids import request_id_from
from hetnode.coordinator.traces import MAX_SESSIONS_PER_TRACE, TraceStore, route_json
from hetnode.protocol.messages import Hop, HopReport, KVSent, Phase, Route

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(("headers", "want"), [
    ({b"x-request-id": b"abc-1.2:3_4"}, "abc-1.2:3_4"),
    ({b"x-request-id": b"  padded  "}, "padded"),
    ({b"traceparent": PARENT.encode()}, "4bf92f3577b34da6a3ce929d0e0e4736"),
    ({b"x-request-id": b"mine", b"traceparent": PARENT.encode()}, "mine"),  # the explicit id wins
])
def test_a_well_formed_client_id_is_kept(headers: dict[bytes, bytes], want: str) -> None:
    assert request_id_from(headers) == want


@pytest.mark.parametrize("headers", [
    {}, {b"x-request-id": b""}, {b"x-request-id": b"a" * 129}, {b"x-request-id": b"has space"},
    {b"x-request-id": b"new\nline"}, {b"x-request-id": "caf\u00e9".encode()},
    {b"traceparent": b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01"},  # all-zero trace id: invalid by the spec
    {b"traceparent": b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},  # a version we do not read
    {b"traceparent": b"garbage"},
])
def test_anything_else_gets_a_fresh_id(headers: dict[bytes, bytes]) -> None:
    rid = request_id_from(headers)
    assert len(rid) == 32 and int(rid, 16) >= 0 and rid != request_id_from(headers)


@pytest.mark.parametrize(("reason", "kind"), [
    ("initial", "initial"), ("n3 joined", "node_joined"), ("gpu-7 leaving", "node_leaving"),
    ("gpu-7 (12D3) left", "node_left"), ("n1 (x) lost its control stream", "node_lost"),
    ("n1 (x) missed the heartbeat deadline", "node_lost"), ("workload shift: prompts 2x longer", "workload_shift"),
    ("something new", "other"),
])
def test_replan_reasons_map_to_a_bounded_set_of_labels(reason: str, kind: str) -> None:
    assert replan_kind(reason) == kind


ROUTE = Route(phases=[Phase(kind="prefill", hops=[Hop(peer="A", first_layer=0, last_layer=4)]),
                      Phase(kind="decode", hops=[Hop(peer="B", first_layer=0, last_layer=4)])])


def test_the_store_forgets_the_oldest_and_their_sessions() -> None:
    store = TraceStore(capacity=2)
    for i in range(3):
        trace = store.open(f"r{i}", 5, 4, now=float(i))
        store.session(trace, f"s{i}", route_json(ROUTE, {}), now=float(i) + 0.5)
    assert len(store) == 2 and store.get("r0") is None and store.get("r2") is not None
    # A report of the forgotten request's session finds nothing; one of a remembered one lands.
    assert not store.hop_report(HopReport(session="s0", phase=0, hop=0), "A", {})
    assert store.hop_report(HopReport(session="s2", phase=1, hop=0, kv_received_bytes=9), "B", {"B": "node-b"})
    trace = store.get("r2")
    assert trace is not None and trace.sessions[0].hops[0]["node"] == "node-b"
    assert trace.routed_s == 0.5
    with pytest.raises(ValueError, match="at least one"):
        TraceStore(capacity=0)


def test_a_hop_report_counts_only_from_that_hop_and_once() -> None:
    store = TraceStore()
    trace = store.open("r", 5, 4, now=0.0)
    store.session(trace, "s", route_json(ROUTE, {"A": "a", "B": "b"}), now=0.0)
    sent = [KVSent("B", "int8", 100, 1)]
    assert not store.hop_report(HopReport(session="s", phase=0, hop=0, kv_sent=sent), "B", {})  # B is not hop 0
    assert not store.hop_report(HopReport(session="s", phase=5, hop=0), "A", {})  # no such place on the route
    assert store.hop_report(HopReport(session="s", phase=0, hop=0, kv_sent=sent), "A", {"B": "b"})
    assert not store.hop_report(HopReport(session="s", phase=0, hop=0, kv_sent=sent), "A", {})  # once
    assert trace.sessions[0].hops[0]["kv_sent"] == [{"to": "b", "codec": "int8", "bytes": 100, "frames": 1}]


def test_a_reused_id_replaces_the_older_request_and_moves_are_bounded() -> None:
    store = TraceStore()
    old = store.open("same", 5, 4, now=0.0)
    store.session(old, "s-old", route_json(ROUTE, {}), now=0.0)
    new = store.open("same", 7, 4, now=1.0)
    assert store.get("same") is new and not store.hop_report(HopReport(session="s-old"), "A", {})
    for i in range(MAX_SESSIONS_PER_TRACE + 5):
        store.session(new, f"s{i}", route_json(ROUTE, {}), now=2.0)
        store.moved(new, "reprefill", "a node went down", f"s{i}", f"s{i + 1}", 7, now=2.0)
    assert len(new.sessions) == len(new.moves) == MAX_SESSIONS_PER_TRACE
    store.finished(new, "failed", 0, "gave up", now=3.0)
    body = new.to_json()
    assert body["status"] == "failed" and body["error"] == "gave up" and body["duration_s"] == 2.0
