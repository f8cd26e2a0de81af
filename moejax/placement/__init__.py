"""How experts and tokens meet: `fsdp` (experts gathered like any weight), `ep` (each device owns
whole experts; tokens travel) or `fssdp` (owners plus this step's replicas of hot experts)."""

PLACEMENTS = ("fsdp", "ep", "fssdp")

from moejax.placement.placement import FssdpState, Placement  # noqa: E402

__all__ = ["PLACEMENTS", "FssdpState", "Placement"]
