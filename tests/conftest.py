"""Shared test set-up: 8 fake CPU devices, strict numerics."""
import os

# Must be set before jax is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# No persistent compilation cache: on XLA:CPU (jax 0.11) an executable with collectives loaded
# back from the cache can deadlock its devices (seen: one device in an all-reduce while the
# others wait in an all-gather). Every test session compiles afresh.
