"""The core: window arithmetic, reduction policy, state and the optax adapters."""
