"""Property: any k, weights (zeros too), tree shapes and dtypes give the window mean.

The reference is the whole-window computation in float64 NumPy:
``sum_i w_i g_i / sum_i w_i`` (``"mean"``) or ``sum_i g_i / sum_i w_i`` (``"sum"``),
where a micro-batch of weight 0 adds nothing.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

leaf_specs = st.lists(
  st.tuples(
    st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    st.sampled_from(sorted(DTYPES)),
  ),
  min_size=1,
  max_size=4,
)


@pytest.mark.slow
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
  k=st.integers(1, 16),
  leaves=leaf_specs,
  data=st.data(),
  reduction=st.sampled_from(["mean", "sum"]),
  policy=st.sampled_from(["skip_window", "skip_micro_batch"]),
  seed=st.integers(0, 2**16),
)
def test_emitted_update_is_the_whole_window_computation(
  k, leaves, data, reduction, policy, seed
):
  weights = data.draw(
    st.lists(st.one_of(st.just(0), st.integers(1, 2000)), min_size=k, max_size=k).map(
      np.asarray
    ),
    label="weights",
  )
  rng = np.random.default_rng(seed)
  params = {f"p{i}": jnp.zeros(shape, DTYPES[d]) for i, (shape, d) in enumerate(leaves)}
  grads = [
    {
      name: jnp.asarray(rng.normal(size=p.shape) * (1 + 9 * rng.random()), p.dtype)
      for name, p in params.items()
    }
    for _ in range(k)
  ]
  opt = optax_accum.MultiSteps(
    optax.identity(), k, grad_reduction=reduction, on_nonfinite=policy
  )
  # One compile per example (its tree and k); eagerly, every call compiles
  # the update's `lax.cond` again (about 3x the CPU time over the examples).
  step = jax.jit(opt.update)
  state = opt.init(params)
  for g, w in zip(grads, weights, strict=True):
    emitted, state = step(g, state, weight=jnp.float32(w))

  total = float(weights.sum())
  assert int(state.mini_step) == 0
  assert int(state.gradient_step) == int(total > 0) == int(state.updated)
  for name, p in params.items():
    out = np.asarray(emitted[name], np.float64)
    assert emitted[name].dtype == p.dtype
    if total == 0:  # No update: exact zeros, never 0/0.
      np.testing.assert_array_equal(out, 0.0)
      continue
    terms = [
      np.asarray(g[name], np.float64) * (w if reduction == "mean" else w > 0)
      for g, w in zip(grads, weights, strict=True)
    ]
    want = sum(terms) / total
    # Float32 accumulation (relative to the terms' magnitudes), then one
    # rounding to the leaf's dtype.
    spread = sum(np.abs(t) for t in terms) / total
    eps = float(jnp.finfo(p.dtype).eps)
    np.testing.assert_allclose(out, want, rtol=eps, atol=2e-6 * spread.max() + 1e-7)
