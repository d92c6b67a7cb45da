"""Flax integrations (Linen ``TrainState``, NNX ``Optimizer``)."""
