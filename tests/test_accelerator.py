"""Float32 matmul precision: accumulated vs whole batch on CPU and accelerators.

XLA:CPU computes float32 dots in float32 at any precision. On recent NVIDIA
GPUs JAX's default precision runs them in TF32 (10-bit mantissa), and TPUs in
bfloat16 passes: the window's gradient and the whole batch's, rounded
differently, then differ by about 3e-4 (relative; 2-3e-4 measured on an NVIDIA
H200) instead of 1e-7. The maths is
the same: at ``jax.default_matmul_precision("highest")`` they agree as on CPU.
``make test-accelerator`` runs the suite at "highest" (``tests/conftest.py``);
here both precisions are measured (docs/accelerators.md).
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm

import optax_accum

K = 4
ON_ACCELERATOR = jax.default_backend() != "cpu"
#: The backend each platform name in JAX_PLATFORMS gives.
BACKENDS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def test_the_requested_platform_runs_the_tests():
  """``JAX_PLATFORMS=cuda,cpu`` without a CUDA jax falls back to the CPU
  silently: the run would pass on CPU and say nothing."""
  requested = os.environ["JAX_PLATFORMS"].split(",")[0].strip()  # tests/conftest.py
  if not requested:
    pytest.skip("JAX_PLATFORMS is empty: JAX picks the platform")
  assert jax.default_backend() == BACKENDS.get(requested, requested), (
    f"OPTAX_ACCUM_TEST_PLATFORM / JAX_PLATFORMS asks for {requested!r}, but JAX "
    f"runs on {jax.devices()}: install a jax for that platform"
  )


def _mlp_loss(params, batch):
  """Token-mean cross-entropy of a 2-layer MLP over padded sequences, and the
  number of valid tokens: ``(loss, weight)``."""
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
  logits = hidden @ params["w2"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  tokens = batch["mask"].sum()
  return (nll * batch["mask"]).sum() / tokens, tokens


def _problem(rows=32, length=16, width=64, hidden=256, classes=32):
  """Params and a batch whose sequences hold 1 to ``length`` valid tokens."""
  rng = np.random.default_rng(0)
  f32 = lambda x: x.astype(np.float32)  # noqa: E731
  params = {
    "w1": f32(rng.normal(size=(width, hidden)) / width**0.5),
    "b1": np.zeros(hidden, np.float32),
    "w2": f32(rng.normal(size=(hidden, classes)) / hidden**0.5),
  }
  batch = {
    "x": f32(rng.normal(size=(rows, length, width))),
    "y": rng.integers(0, classes, size=(rows, length)),
    "mask": f32(np.arange(length) < rng.integers(1, length + 1, size=(rows, 1))),
  }
  return params, batch


def _gradients(precision: str):
  """The whole batch's gradient and the window's over ``K`` micro-batches
  (``MultiSteps`` with token weights), both at ``precision``."""
  params, batch = _problem()
  opt = optax_accum.MultiSteps(optax.identity(), K)
  grad = jax.jit(jax.grad(_mlp_loss, has_aux=True))

  @jax.jit
  def micro_step(state, micro_batch):
    grads, tokens = grad(params, micro_batch)
    return opt.update(grads, state, params, weight=tokens)

  with jax.default_matmul_precision(precision):
    whole, _ = grad(params, batch)
    state = opt.init(params)
    for micro_batch in toy_lm.split(batch, K):
      window, state = micro_step(state, micro_batch)
  assert bool(state.updated)
  return window, whole


@pytest.mark.skipif(
  not ON_ACCELERATOR,
  reason="measures an accelerator's default (TF32, bf16) matmul precision; "
  "OPTAX_ACCUM_TEST_PLATFORM=cuda,cpu runs it on a GPU",
)
def test_highest_precision_matches_the_whole_batch_on_the_accelerator(record_property):
  errors = {p: toy_lm.rel_error(*_gradients(p)) for p in ("default", "highest")}
  for precision, error in errors.items():
    record_property(f"rel_error_{precision}_precision", f"{error:.2e}")
  msg = (
    f"window vs whole batch on {jax.devices()[0].device_kind}: "
    f"{errors['highest']:.2e} at 'highest', {errors['default']:.2e} at the default"
  )
  assert errors["highest"] <= 1e-5, msg
  assert np.isfinite(errors["default"]), msg


def test_precision_changes_nothing_on_cpu():
  """On XLA:CPU "default" and "highest" give the same bits (the accelerator
  runs beside the CPU devices: this runs on them there too)."""
  with jax.default_device(jax.devices("cpu")[0]):
    default = _gradients("default")
    highest = _gradients("highest")
  chex.assert_trees_all_equal(default, highest)
  assert toy_lm.rel_error(*highest) <= 1e-5
