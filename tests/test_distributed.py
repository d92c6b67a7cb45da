"""Data parallel on 8 simulated devices: token counts are global (F2).

Replicas hold very different numbers of valid tokens: the batch is sorted by
sequence length, so the last replicas see almost nothing but padding.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

AUTO = jax.sharding.AxisType.Auto


def _uneven_batch(seed, batch=32):
  """A variable-length batch, longest sequences first."""
  data = toy_lm.make_batch(seed=seed, batch=batch)
  order = np.argsort(-data["mask"].sum(axis=1), kind="stable")
  return {name: value[order] for name, value in data.items()}


def _replica_tokens(batch, replicas=8):
  return batch["mask"].reshape(replicas, -1).sum(axis=1)


def _adamw():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, 10, 1e-3)
  return optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax_accum.progress_schedule(schedule), weight_decay=0.1
  )


def _identity_window(opt, params, micro_batches, state=None):
  """The window gradient that `opt` (around `optax.identity()`) emits."""
  state = opt.init(params) if state is None else state
  for micro_batch in micro_batches:
    grads, weight = jax.grad(toy_lm.mean_loss, has_aux=True)(params, micro_batch)
    emitted, state = opt.update(grads, state, params, weight=weight)
  return emitted


# --- jit with NamedSharding: nothing to do ------------------------------------


def test_sharded_batch_under_jit_matches_one_device():
  k, updates = 2, 10
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  batches = [_uneven_batch(seed=i) for i in range(updates)]
  tokens, capacity = _replica_tokens(batches[0]), batches[0]["mask"].size // 8
  assert tokens.min() <= 0.1 * capacity < 0.8 * capacity <= tokens.max()

  params0 = toy_lm.init_params(seed=0)
  whole, _, _ = toy_lm.whole_batch_run(params0, batches, _adamw())

  # The gradient of one window, batch sharded over 8 devices.
  micro = [jax.device_put(mb, data) for mb in toy_lm.split(batches[0], k)]
  identity = optax_accum.MultiSteps(optax.identity(), k)
  sharded_grad = jax.jit(functools.partial(_identity_window, identity))(
    jax.device_put(params0, replicated), micro
  )
  whole_grad, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params0, batches[0])
  assert toy_lm.rel_error(sharded_grad, whole_grad) <= 1e-5

  opt = optax_accum.MultiSteps(_adamw(), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt)
  params = jax.device_put(params0, replicated)
  state = opt.init(params)
  for batch in batches:
    for micro_batch in toy_lm.split(batch, k):
      micro_batch = jax.device_put(micro_batch, data)
      assert len(micro_batch["mask"].sharding.device_set) == 8
      params, state, metrics = step(params, state, micro_batch)
  assert int(metrics["update_count"]) == updates
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5


def _linear_loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"][None, None, :]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  mask = batch["mask"].astype(nll.dtype)
  return (nll * mask).sum() / mask.sum(), mask.sum()


def test_state_keeps_the_params_sharding_on_a_2d_mesh():
  """params sharded on `model`, batch on `data`: no accumulator all-gather."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
  specs = {"w": P(None, "model"), "b": P("model")}
  params = {
    "w": jax.device_put(
      jnp.full((8, 16), 0.1, jnp.float32), NamedSharding(mesh, specs["w"])
    ),
    "b": jax.device_put(jnp.zeros(16, jnp.float32), NamedSharding(mesh, specs["b"])),
  }
  rng = np.random.default_rng(0)
  batch = jax.device_put(
    {
      "x": rng.normal(size=(8, 6, 8)).astype(np.float32),
      "y": rng.integers(0, 16, (8, 6)),
      "mask": np.arange(6)[None] < rng.integers(1, 7, (8, 1)),
    },
    NamedSharding(mesh, P("data")),
  )
  opt = optax_accum.MultiSteps(optax.adamw(1e-2), 2)
  step = optax_accum.make_train_step(_linear_loss, opt)
  state = opt.init(params)

  def check(state, params):
    arrays = [state.acc_grads, state.inner_opt_state[0].mu, state.inner_opt_state[0].nu]
    for tree in [params, *arrays]:
      for name, spec in specs.items():
        assert tree[name].sharding.spec == spec, (name, tree[name].sharding)

  check(state, params)
  for program in ("accumulate", "update"):
    hlo = step.lower(params, state, batch, program=program).compile().as_text()
    assert not re.findall(r"all-gather", hlo), "a step gathers a sharded array"
  for _ in range(4):
    params, state, _ = step(params, state, batch)
  check(state, params)


# --- shard_map and pmap: axis_name --------------------------------------------


def _shard_map(fn, mesh, check_vma=True):
  return jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(), check_vma=check_vma
    )
  )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_shard_map_with_axis_name_sums_over_replicas(reduction, check_vma):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  k = 2
  batch = _uneven_batch(seed=0)
  params = toy_lm.init_params(seed=0)
  loss_fn = toy_lm.mean_loss if reduction == "mean" else toy_lm.sum_loss
  whole, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)

  def window(params, state, micro_batches, opt):
    for micro_batch in micro_batches:
      if check_vma and reduction == "mean":  # Keep the gradient per replica.
        local = jax.lax.pcast(params, "data", to="varying")
      else:
        local = params
      grads, weight = jax.grad(loss_fn, has_aux=True)(local, micro_batch)
      emitted, state = opt.update(grads, state, params, weight=weight)
    return emitted

  results = {}
  for axis_name in ("data", ()):
    opt = optax_accum.MultiSteps(
      optax.identity(), k, grad_reduction=reduction, axis_name=axis_name
    )
    fn = _shard_map(functools.partial(window, opt=opt), mesh, check_vma)
    if axis_name == () and check_vma:
      continue  # Per-replica outputs cannot leave through out_specs=P().
    results[axis_name] = fn(params, opt.init(params), toy_lm.split(batch, k))
  assert toy_lm.rel_error(results["data"], whole) <= 1e-5
  if () in results:  # Independent replicas: each has its own window.
    assert toy_lm.rel_error(results[()], whole) > 1e-2


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("weight", [None, 2.0], ids=["default", "constant"])
def test_a_constant_weight_is_each_replicas_own(weight, check_vma):
  """Found by tests/test_reference.py: with `check_vma=True` a weight that is
  the same on every replica (the default 1, or a Python constant) was taken as
  already global, so the window's weight was one replica's and the gradient
  `replicas` times too large. It is each replica's, as under check_vma=False."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  opt = optax_accum.MultiSteps(optax.identity(), 1, axis_name="data")
  kwargs = {} if weight is None else {"weight": weight}

  def window(grads):
    updates, state = opt.update(
      {"w": grads[0]}, opt.init({"w": jnp.zeros(3)}), **kwargs
    )
    return updates["w"][None], state.gradient_step[None]

  grads = np.arange(24, dtype=np.float32).reshape(8, 3)
  run = jax.jit(
    jax.shard_map(
      window, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma
    )
  )
  updates, updated = run(grads)
  np.testing.assert_array_equal(updated, 1)
  for replica in range(8):
    np.testing.assert_allclose(updates[replica], grads.mean(axis=0), rtol=1e-6)


def test_replicated_params_with_mean_loss_explain_the_fix():
  """check_vma: autodiff already summed per-replica means; weights can't apply."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  params = toy_lm.init_params(seed=0)
  opt = optax_accum.MultiSteps(optax.identity(), 1, axis_name="data")

  def window(params, state, batch):
    grads, weight = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
    return opt.update(grads, state, params, weight=weight)[0]

  with pytest.raises(ValueError, match=r"already summed over mesh axis 'data'.*pcast"):
    _shard_map(window, mesh)(params, opt.init(params), _uneven_batch(seed=0))


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_make_train_step_in_shard_map_matches_one_device(mode):
  k, updates = 2, 6
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  batches = [_uneven_batch(seed=i) for i in range(updates)]
  params0 = toy_lm.init_params(seed=0)
  whole, _, _ = toy_lm.whole_batch_run(params0, batches, _adamw())

  opt = optax_accum.MultiSteps(_adamw(), k)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode=mode, axis_name="data")
  spec = P(None, "data") if mode == "scan" else P("data")
  sharded = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), spec), out_specs=(P(), P(), P()))
  )
  params, state = params0, opt.init(params0)
  for batch in batches:
    params, state, metrics = toy_lm.feed_window(sharded, params, state, batch, k, mode)
    np.testing.assert_allclose(metrics["weight"], batch["mask"].sum())
  assert int(metrics["update_count"]) == updates
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_make_train_step_without_axis_name_is_refused_under_manual_axes(mode):
  """Issue 60: the step in shard_map or pmap without axis_name let each replica
  divide by its own weight (8 replicas ended 4.4 apart); now F11's error."""
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode=mode, donate=False)
  params = toy_lm.init_params(seed=0)
  batch = _uneven_batch(seed=0, batch=16)
  window = toy_lm.split(batch, 2)
  mb = jax.tree.map(lambda *x: jnp.stack(x), *window) if mode == "scan" else window[0]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  spec = P(None, "data") if mode == "scan" else P("data")
  mapped = jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P(), spec), out_specs=(P(), P(), P())
  )
  with pytest.raises(ValueError, match=r"train step runs under.*axis_name='data'"):
    jax.jit(mapped)(params, opt.init(params), mb)

  def per_device(x):  # Rows split 8 ways, the device axis first.
    if mode == "stream":
      return x.reshape(8, -1, *x.shape[1:])
    return x.reshape(2, 8, -1, *x.shape[2:]).swapaxes(0, 1)

  rows = jax.tree.map(per_device, mb)
  pmapped = jax.pmap(step, axis_name="batch", in_axes=(None, None, 0))
  with pytest.raises(ValueError, match=r"train step runs under.*axis_name='batch'"):
    pmapped(params, opt.init(params), rows)


def test_pmap_with_axis_name():
  k = 2
  batch = _uneven_batch(seed=0)
  params = toy_lm.init_params(seed=0)
  whole, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params, batch)
  opt = optax_accum.MultiSteps(optax.identity(), k, axis_name="data")

  def window(params, state, micro_batches):
    return _identity_window(opt, params, micro_batches, state)

  per_device = [
    jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), mb)
    for mb in toy_lm.split(batch, k)
  ]
  emitted = jax.pmap(window, axis_name="data", in_axes=(None, None, 0))(
    params, opt.init(params), per_device
  )
  assert toy_lm.rel_error(jax.tree.map(lambda x: x[0], emitted), whole) <= 1e-5


def _lm1b_train_step(opt):
  """google/flax examples/lm1b's pmapped `train_step`, ported as its users
  did: the gradients' `pmean` kept, each device's token count as `weight`."""

  def train_step(state, batch):
    grads, weight = jax.grad(toy_lm.mean_loss, has_aux=True)(state.params, batch)
    if opt.axis_name is None:  # The original's line, kept by the port.
      grads = jax.lax.pmean(grads, "batch")
    return state.apply_gradients(grads=grads, weight=weight)

  return jax.pmap(train_step, axis_name="batch")


def _lm1b_run(opt, batches, k):
  """Replicated params after `batches`, each fed as `k` per-device micro-batches."""
  from optax_accum.flax import TrainState

  params = toy_lm.init_params(seed=0)
  state = TrainState.create(apply_fn=None, params=params, tx=opt)
  state = jax.tree.map(lambda x: jnp.stack([x] * 8), state)  # One per device.
  train_step = _lm1b_train_step(opt)
  for batch in batches:
    for micro_batch in toy_lm.split(batch, k):
      rows = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), micro_batch)
      state = train_step(state, rows)
  return state.params


def test_pmap_without_axis_name_is_refused_before_replicas_drift():
  """Issue 49: lm1b's step without `axis_name` divided each device's window by
  its own weight; after 6 updates the replicas differed by 1.8e-2."""
  pytest.importorskip("flax")
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match=r"\('batch',\).*axis_name='batch'.*pmean"):
    _lm1b_run(opt, [_uneven_batch(seed=0)], k=2)


def test_pmap_with_axis_name_keeps_replicas_equal_to_the_whole_batch():
  pytest.importorskip("flax")
  k, batches = 2, [_uneven_batch(seed=i) for i in range(3)]
  opt = optax_accum.MultiSteps(_adamw(), k, axis_name="batch")
  params = _lm1b_run(opt, batches, k)
  whole, _, _ = toy_lm.whole_batch_run(toy_lm.init_params(seed=0), batches, _adamw())
  for replica in range(8):
    mine = jax.tree.map(lambda x, r=replica: x[r], params)
    assert toy_lm.max_rel_diff(mine, whole) <= 1e-5


def test_pmap_with_independent_replicas_on_purpose():
  """`axis_name=()`: each replica its own window, as asked."""
  pytest.importorskip("flax")
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2, axis_name=())
  params = jax.tree.leaves(_lm1b_run(opt, [_uneven_batch(seed=0)], k=2))[0]
  assert not np.allclose(params[0], params[-1])


def test_axis_name_outside_a_mesh_is_a_clear_error():
  opt = optax_accum.MultiSteps(optax.identity(), 1, axis_name="data")
  params = toy_lm.init_params(seed=0)
  with pytest.raises(ValueError, match=r"`axis_name` 'data' is not a mesh axis here"):
    jax.jit(opt.update)(params, opt.init(params), params, weight=1.0)


def test_train_step_axis_name_must_agree_with_the_optimizer():
  opt = optax_accum.MultiSteps(optax.identity(), 1, axis_name="data")
  with pytest.raises(
    ValueError, match=r"`axis_name` 'batch' differs from the optimizer's 'data'"
  ):
    optax_accum.make_train_step(toy_lm.mean_loss, opt, axis_name="batch")


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize(
  "change, message",
  [
    ("renamed", r"`params` is missing leaf \['head'\]\['bias'\] present in"),
    ("removed", r"`params` has leaf \['head'\]\['b'\] that"),
  ],
  ids=["renamed", "removed"],
)
def test_a_per_replica_state_of_other_params_names_the_leaf(mode, change, message):
  """A PerReplica state of other params (a leaf renamed or removed) on a mesh
  raised JAX's pytree-structure error; now the leaf and the fix, as on one
  device."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, mode=mode, axis_name="data")
  params = jax.device_put(toy_lm.init_params(seed=0), NamedSharding(mesh, P()))
  head = dict(params["head"])
  bias = head.pop("b")
  if change == "renamed":
    head["bias"] = bias
  state = step.init({**params, "head": head})
  assert isinstance(state.acc_grads, optax_accum.PerReplica)
  window = toy_lm.split(_uneven_batch(seed=0, batch=16), 2)
  mb = jax.tree.map(lambda *x: np.stack(x), *window) if mode == "scan" else window[0]
  spec = P(None, "data") if mode == "scan" else P("data")
  batch = jax.device_put(mb, NamedSharding(mesh, spec))
  with pytest.raises(ValueError, match=message + r".*starts from step\.init\(params\)"):
    step(params, state, batch)


def test_split_micro_batches_keeps_rows_on_their_devices():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  batch = jax.device_put(_uneven_batch(seed=0), NamedSharding(mesh, P("data")))
  split = optax_accum.split_micro_batches(batch, 2)
  assert split["mask"].sharding.spec == P(None, "data")
  hlo = jax.jit(functools.partial(optax_accum.split_micro_batches, k=2)).lower(batch)
  assert "all-gather" not in hlo.compile().as_text()


@pytest.mark.parametrize(("rows", "k"), [(16, 2), (16, 8)])
def test_split_micro_batches_stays_sharded_only_when_rows_divide(rows, k):
  """Issue 16, item 4: each micro-batch keeps its rows on their devices when
  it has a multiple of the device count (16 // 2 = 8 rows on 8 devices); with
  16 // 8 = 2 rows for 8 devices it cannot, and JAX gathers (as documented).
  The values are those of the rows i, i + k, ... either way."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
  x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
  split = optax_accum.split_micro_batches(
    {"x": jax.device_put(x, NamedSharding(mesh, P("data")))}, k
  )["x"]
  np.testing.assert_array_equal(
    split, optax_accum.split_micro_batches({"x": x}, k)["x"]
  )
  in_place = (rows // k) % 8 == 0
  assert (split.sharding.spec == P(None, "data")) == in_place, split.sharding
