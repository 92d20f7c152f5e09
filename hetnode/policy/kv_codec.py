"""How a KV hand-off moves: which wire codec, or no transfer at all and a re-prefill on the decode side.

ThunderServe (§3.3, §4) prices a KV transfer with the alpha-beta model, latency + bytes / bandwidth, and
quantizes to shrink the bytes; quantizing costs CPU time on both ends, so on a fast link the cast to fp16
is the cheapest, on a slow one int4. An option costs

    pack (fp16 bytes / sender's pack rate) + latency + wire bytes / bandwidth + unpack (fp16 bytes / receiver's rate)

and re-prefilling, when the caller can estimate it, costs what the decode side needs to recompute the
prompt. The cheapest wins; ties go to the more precise codec. This ranks the options by their serialized
time: streaming layer by layer hides part of a transfer behind the prefill, which this estimate does not
credit (the streaming decision, and what it hides, belong to the transfer path).

The caller brings each codec's exact wire size (`hetnode.kv.codecs.CODECS[name].packed_size`) and the
pack and unpack rates measured on the two nodes, so this module stays free of torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

REPREFILL = "reprefill"
AUTO = "auto"
# `--kv-codec`: what an operator may ask for. `auto` picks among fp16, int8 and int4: bf16 is as large as fp16
# and less precise for KV, int2 loses too much quality on small models (see scripts/bench_kv.py) to be chosen
# without being asked for by name, and fp32 (exact on nodes that compute in fp32) doubles fp16's bytes.
OPERATOR_CHOICES = (AUTO, "fp16", "fp32", "int8", "int4")
AUTO_CODECS = ("fp16", "int8", "int4")
# Most precise first: the order in which ties are broken.
PRECISION = ("fp32", "fp16", "bf16", "int8", "int4", "int2")


@dataclass(frozen=True, slots=True)
class CodecOption:
    """One codec for this hand-off's KV: its exact packed size and the measured rates of the two nodes."""

    name: str
    wire_bytes: int
    pack_rate: float  # bytes of fp16 KV per second on the sender (math.inf: free)
    unpack_rate: float  # bytes of fp16 KV per second on the receiver

    def __post_init__(self) -> None:
        if self.wire_bytes <= 0:
            raise ValueError(f"{self.name}: wire_bytes must be positive, not {self.wire_bytes}")
        if not (self.pack_rate > 0 and self.unpack_rate > 0):  # also refuses NaN
            raise ValueError(
                f"{self.name}: pack and unpack rates must be positive, not {self.pack_rate}, {self.unpack_rate}"
            )


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    bandwidth: float  # bytes per second
    latency: float  # seconds, one way

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth < math.inf):
            raise ValueError(f"link bandwidth must be positive and finite, not {self.bandwidth}")
        if not (0 <= self.latency < math.inf):
            raise ValueError(f"link latency must be >= 0 and finite, not {self.latency}")


@dataclass(frozen=True, slots=True)
class KVCodecChoice:
    codec: str  # a codec name, or REPREFILL
    wire_bytes: int  # bytes the hand-off moves (0 for a re-prefill: only the prompt's token ids travel)
    seconds: float  # the estimated time of the whole hand-off


@dataclass(frozen=True, slots=True)
class KVCodecPolicy:
    allowed: str = AUTO  # the operator's --kv-codec

    def __post_init__(self) -> None:
        if self.allowed not in OPERATOR_CHOICES:
            raise ValueError(f"kv codec must be one of {', '.join(OPERATOR_CHOICES)}, not {self.allowed!r}")

    def choose(
        self, fp16_bytes: int, options: Sequence[CodecOption], link: LinkEstimate, reprefill_s: float | None = None
    ) -> KVCodecChoice:
        """The cheapest allowed way to hand over KV of `fp16_bytes` bytes at fp16, over `link`.

        `options` must offer every codec the operator allows (others are ignored); `reprefill_s` is the
        estimated time for the decode side to recompute the prompt, None when it cannot (no prompt there).
        """
        if fp16_bytes <= 0:
            raise ValueError(f"fp16_bytes must be positive, not {fp16_bytes}")
        if reprefill_s is not None and not (0 <= reprefill_s < math.inf):
            raise ValueError(f"reprefill_s must be >= 0 and finite, not {reprefill_s}")
        names = AUTO_CODECS if self.allowed == AUTO else (self.allowed,)
        offered = {option.name: option for option in options}
        missing = [name for name in names if name not in offered]
        if missing:
            raise ValueError(f"no measured rates for allowed codec(s) {', '.join(missing)}")

        def cost(option: CodecOption) -> float:
            return (
                fp16_bytes / option.pack_rate
                + link.latency
                + option.wire_bytes / link.bandwidth
                + fp16_bytes / option.unpack_rate
            )

        best = min((offered[name] for name in names), key=lambda o: (cost(o), PRECISION.index(o.name)))
        seconds = cost(best)
        if reprefill_s is not None and reprefill_s < seconds:
            return KVCodecChoice(REPREFILL, 0, reprefill_s)
        return KVCodecChoice(best.name, best.wire_bytes, seconds)


@dataclass(frozen=True, slots=True)
class HandoffLink:
    """What one link of a hand-off is chosen from: each codec's exact wire size (fp16's included), the sender's
    pack and the receiver's unpack rates as measured (a codec missing from them: not measured), and the link as
    probed (None: not probed yet)."""

    sizes: Mapping[str, int]
    pack: Mapping[str, float]
    unpack: Mapping[str, float]
    link: LinkEstimate | None


def reprefill_seconds(tokens: int, prefill_rates: Sequence[float]) -> float | None:
    """How long a pipeline takes to prefill `tokens`: each hop's measured prefill rate (tokens per second of its
    steps that prefill), hop after hop; None while a hop has measured none."""
    if not prefill_rates or any(not rate > 0 for rate in prefill_rates):
        return None
    return sum(tokens / rate for rate in prefill_rates)


def choose_handoff(policy: KVCodecPolicy, links: Sequence[HandoffLink],
                   reprefill_s: float | None = None) -> tuple[list[str], bool]:
    """Each link's codec, and whether the decode side should re-prefill the context instead of receiving it.

    A link whose rates or bandwidth are not measured yet sends fp16 (or the operator's codec). The decode side
    re-prefills only under `auto`, when the caller can estimate it (`reprefill_s`), and when every link would
    take longer than that: a hand-off either moves all of its KV or none. The runtime's coordinator and the
    simulator both decide with this."""
    names = AUTO_CODECS if policy.allowed == AUTO else (policy.allowed,)
    fallback = "fp16" if policy.allowed == AUTO else names[0]
    offer = reprefill_s if policy.allowed == AUTO else None
    codecs: list[str] = []
    everywhere = offer is not None and bool(links)
    for h in links:
        if h.link is None or not all(n in h.pack and n in h.unpack for n in names):
            codecs.append(fallback)
            everywhere = False
            continue
        options = [CodecOption(n, h.sizes[n], h.pack[n], h.unpack[n]) for n in names]
        best = policy.choose(h.sizes["fp16"], options, h.link)
        codecs.append(best.codec)
        everywhere = everywhere and offer is not None and offer < best.seconds
    return codecs, everywhere
