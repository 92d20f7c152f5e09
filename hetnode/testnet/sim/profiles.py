"""Profile tables made to match something else's clock, for comparing the simulator with the testnet.

The testnet paces an emulated device's step to `dilation` times its roofline step time
(`hetnode.node.emulation`); `dilated(roofline_profile_table(cluster, model), 100)` is the table whose step times
the simulator should then see.
"""

from __future__ import annotations

from dataclasses import replace

from hetnode.planner.profile import Curve, DeviceProfile, ProfileTable


def _scaled(curve: Curve, factor: float) -> Curve:
    return tuple((x, y * factor) for x, y in curve)


def dilated_profile(profile: DeviceProfile, factor: float) -> DeviceProfile:
    """Every step `factor` times as long (and every throughput T_j `factor` times lower)."""
    if not factor > 0:
        raise ValueError(f"the factor must be > 0, not {factor}")
    return replace(profile, prompt_curve=_scaled(profile.prompt_curve, factor),
                   decode_curve=_scaled(profile.decode_curve, factor),
                   decode_context_s=profile.decode_context_s * factor,
                   throughput=tuple(t / factor for t in profile.throughput),
                   source=f"{profile.source}, x{factor:g} slower")


def dilated(table: ProfileTable, factor: float) -> ProfileTable:
    return ProfileTable(model=table.model, profiles={k: dilated_profile(p, factor) for k, p in table.profiles.items()},
                        source=f"{table.source}, dilated x{factor:g}")
