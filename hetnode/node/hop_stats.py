"""What one session did on one hop, for its request's trace: steps and their time, waits, KV in and out.

Kept on the hop's own clock and reported as durations (HopReport, with the next heartbeat after the session ends
here), so the coordinator needs no synchronised clocks to lay a request's hops side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetnode.protocol.messages import HopReport, KVSent


@dataclass
class HopStats:
    installed_at: float
    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0
    first_step_at: float | None = None
    last_step_at: float | None = None
    kv_done_at: float | None = None
    kv_received_bytes: int = 0
    kv_sent: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (peer, codec) -> [bytes, frames]

    def step(self, tokens: int, seconds: float, now: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.step_s += seconds
        if self.first_step_at is None:
            self.first_step_at = now - seconds
        self.last_step_at = now

    def sent(self, peer: str, codec: str, nbytes: int) -> None:
        entry = self.kv_sent.setdefault((peer, codec), [0, 0])
        entry[0] += nbytes
        entry[1] += 1

    def received(self, nbytes: int, whole: bool, now: float) -> None:
        self.kv_received_bytes += nbytes
        if whole and self.kv_done_at is None:
            self.kv_done_at = now

    def report(self, session: str, trace: str, phase: int, hop: int, end: str) -> HopReport:
        def since_install(t: float | None) -> float:
            return 0.0 if t is None else max(0.0, t - self.installed_at)

        return HopReport(session=session, trace=trace, phase=phase, hop=hop, steps=self.steps, tokens=self.tokens,
                         step_s=self.step_s, wait_s=since_install(self.first_step_at),
                         active_s=since_install(self.last_step_at), kv_wait_s=since_install(self.kv_done_at),
                         kv_received_bytes=self.kv_received_bytes,
                         kv_sent=[KVSent(p, c, b, f) for (p, c), (b, f) in sorted(self.kv_sent.items())],
                         end=end)  # type: ignore[arg-type]
