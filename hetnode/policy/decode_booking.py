"""When a phase-split deployment books a decode replica's KV for a request (one word for the schedulers, the
planner that prices it, the simulator and the command line):

- "admission" (Splitwise's rule, the runtime's default): when the request is admitted; the KV is held through
  its prefill and hand-off too, and the decode hops reserve it before the prefill starts.
- "handoff" (ThunderServe's KV queues on the prefill replicas, Appendix E): when its hand-off may start; the
  prefill hops keep the prompt's KV until the decode replica has room.
"""

from __future__ import annotations

from typing import Literal

DecodeBooking = Literal["admission", "handoff"]
ADMISSION: DecodeBooking = "admission"
HANDOFF: DecodeBooking = "handoff"
DECODE_BOOKINGS: tuple[DecodeBooking, ...] = (ADMISSION, HANDOFF)
