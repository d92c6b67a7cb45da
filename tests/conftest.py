"""Test-wide JAX settings: 8 simulated CPU devices and strict numerics."""

import os

# Must happen before JAX initialises its backends.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

# Strict dtype promotion is not set globally: optax's own schedules and
# optax.MultiSteps mix Python floats with int32 counts. Our code is pinned to it
# by `test_multi_steps.py::test_update_needs_no_implicit_promotion`.
jax.config.update("jax_numpy_rank_promotion", "raise")
