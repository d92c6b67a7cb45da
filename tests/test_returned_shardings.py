"""The step returns what it was given (issue 70): params and optimizer state
come back with the shardings they came in with, leaf by leaf, counters
included, so they go back into the user's own ``jit`` with fixed in and out
shardings (pjit style), streamed and in scan mode.

The mesh is EasyLM's (``dp``, ``fsdp``, ``mp``; here 1 x 4 x 2, ``Auto`` axes as
pjit's) and the partition rules are its LLaMA's: young-geng/EasyLM,
``EasyLM/models/llama/llama_model.py``, ``LLaMAConfig.get_partition_rules``
(commit 134105f0f9740c08c3a9e1880bfbf2635409b4d5): ``transformer/wte/embedding``
``P("mp", "fsdp")``; ``attention/(wq|wk|wv)/kernel`` ``P("fsdp", "mp")``;
``attention/wo/kernel`` ``P("mp", "fsdp")``; ``feed_forward/w1|w3`` ``P("fsdp",
"mp")``, ``w2`` ``P("mp", "fsdp")``; the RMSNorm scales ``attention_norm``,
``ffn_norm`` and ``transformer/ln_f`` ``P(None)``; ``lm_head/kernel`` ``P("fsdp",
"mp")``. The model is a one-block LLaMA written here, small. Before the fix
the norm scales, their sums and their Adam moments came back split over
``fsdp`` and ``step.init``'s counters on one device came back on the mesh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, VOCAB, WIDTH, FFN, HEADS, LENGTH, ROWS = 2, 32, 16, 32, 2, 8, 8

#: EasyLM's LLaMA partition rules (see above), by this model's param names.
SPECS = {
  "wte": P("mp", "fsdp"),
  "attention_norm": P(None),
  "wq": P("fsdp", "mp"),
  "wk": P("fsdp", "mp"),
  "wv": P("fsdp", "mp"),
  "wo": P("mp", "fsdp"),
  "ffn_norm": P(None),
  "w1": P("fsdp", "mp"),
  "w2": P("mp", "fsdp"),
  "w3": P("fsdp", "mp"),
  "ln_f": P(None),
  "lm_head": P("fsdp", "mp"),
}
SHAPES = {
  "wte": (VOCAB, WIDTH),
  "attention_norm": (WIDTH,),
  "wq": (WIDTH, WIDTH),
  "wk": (WIDTH, WIDTH),
  "wv": (WIDTH, WIDTH),
  "wo": (WIDTH, WIDTH),
  "ffn_norm": (WIDTH,),
  "w1": (WIDTH, FFN),
  "w2": (FFN, WIDTH),
  "w3": (WIDTH, FFN),
  "ln_f": (WIDTH,),
  "lm_head": (WIDTH, VOCAB),
}


@functools.cache
def _mesh():
  auto = (AxisType.Auto,) * 3
  return jax.make_mesh((1, 4, 2), ("dp", "fsdp", "mp"), axis_types=auto)


def _params():
  rng = np.random.default_rng(0)
  params = {
    name: np.ones(shape, np.float32)
    if len(shape) == 1
    else (rng.normal(size=shape) * 0.1).astype(np.float32)
    for name, shape in SHAPES.items()
  }
  shardings = {name: NamedSharding(_mesh(), spec) for name, spec in SPECS.items()}
  return jax.device_put(params, shardings)


def _rms_norm(x, scale):
  normed = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
  return normed * scale[None, None]


def _loss(params, batch):
  """A one-block LLaMA: RMSNorm, causal attention, SwiGLU; the token mean."""
  x = jax.nn.one_hot(batch["tokens"], VOCAB) @ params["wte"]
  h = _rms_norm(x, params["attention_norm"])
  split = lambda y: y.reshape(*y.shape[:2], HEADS, -1)  # noqa: E731
  q, k, v = (split(h @ params[w]) for w in ("wq", "wk", "wv"))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(WIDTH // HEADS)
  causal = np.tril(np.ones((1, 1, LENGTH, LENGTH), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
  x = x + attended @ params["wo"]
  h = _rms_norm(x, params["ffn_norm"])
  x = x + (jax.nn.silu(h @ params["w1"]) * (h @ params["w3"])) @ params["w2"]
  logits = _rms_norm(x, params["ln_f"]) @ params["lm_head"]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  n = batch["mask"].sum()
  return (nll * batch["mask"]).sum() / n, n


def _batches(count, scan):
  rng = np.random.default_rng(1)
  rows = NamedSharding(_mesh(), P(None, ("dp", "fsdp")) if scan else P(("dp", "fsdp")))
  shape = (K, ROWS, LENGTH) if scan else (ROWS, LENGTH)
  return [
    jax.device_put(
      {
        "tokens": rng.integers(0, VOCAB, shape),
        "targets": rng.integers(0, VOCAB, shape),
        "mask": (rng.random(shape) < 0.8).astype(np.float32),
      },
      rows,
    )
    for _ in range(count)
  ]


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def _users_jit(shardings):
  """The user's own step between the train step's calls, pjit style: fixed
  in and out shardings, which refuse an argument placed otherwise."""

  def touch(params, state):
    return jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), (params, state))

  return jax.jit(touch, in_shardings=shardings, out_shardings=shardings)


def _assert_same(given, got):
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(got), strict=True
  )
  for (path, want), have in pairs:
    assert have == want, (jax.tree_util.keystr(path), want, have)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_params_and_state_come_back_as_given_and_into_the_users_pjit(mode):
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), K)
  step = optax_accum.make_train_step(_loss, opt, mode=mode)
  params = _params()
  state = step.init(params)
  given = _shardings((params, state))
  for name, spec in SPECS.items():  # step.init: the state as the params.
    assert state.acc_grads[name].sharding.spec == spec
    assert state.inner_opt_state[0].mu[name].sharding.spec == spec
  users = _users_jit(given)
  scan = mode == "scan"
  for batch in _batches(3 if scan else 3 * K, scan):
    params, state, _ = step(params, state, batch)
    _assert_same(given, _shardings((params, state)))
    params, state = users(params, state)
  assert int(state.gradient_step) == 3


def test_the_inner_optimizers_own_state_comes_back_as_given_in_scan_mode():
  tx = optax.adamw(1e-2)
  step = optax_accum.make_train_step(_loss, tx, mode="scan")
  params = _params()
  inner = jax.jit(tx.init)(params)
  inner = jax.device_put(inner, jax.tree_util.tree_map_with_path(_as_params, inner))
  given = _shardings((params, inner))
  users = _users_jit(given)
  for batch in _batches(2, scan=True):
    params, inner, _ = step(params, inner, batch)
    _assert_same(given, _shardings((params, inner)))
    params, inner = users(params, inner)


def _as_params(path, x):
  """The user's placement of an inner state: moments as their params, counters
  replicated on the mesh."""
  name = getattr(path[-1], "key", None)
  return NamedSharding(_mesh(), SPECS[name] if x.ndim else P())
