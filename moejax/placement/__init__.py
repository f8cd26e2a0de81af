"""How experts and tokens meet: `fsdp` (experts gathered like any weight), `ep` (each device owns
whole experts; tokens travel) or `fssdp` (owners plus this step's replicas of hot experts)."""

PLACEMENTS = ("fsdp", "ep", "fssdp")
