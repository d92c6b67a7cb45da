"""One gradient reduction per window, read from the compiled programs' HLO.

On 8 simulated devices: which collectives each program runs, how many bytes,
and whether inside the scan's loop; with the numbers still those of one
device on the whole batch, replicas holding very different token counts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_distributed import _adamw, _uneven_batch

import optax_accum
from benchmarks.hlo import collectives

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

AUTO = jax.sharding.AxisType.Auto
K = 4
#: Collectives of at most this many bytes carry counters and window totals.
SCALARS = 64


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AUTO,))


def _param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def _gradient_sized(step, *args, **kwargs) -> list:
  """The collectives of more than SCALARS bytes in ``step``'s compiled program."""
  text = step.lower(*args, **kwargs).compile().as_text()
  return [c for c in collectives(text) if c.bytes > SCALARS]


def _placed(tree, mesh, spec):
  return jax.device_put(jax.tree.map(np.asarray, tree), NamedSharding(mesh, spec))


def _step_input(batch, mode, mesh):
  """``batch`` as one call of a ``mode`` step takes it, rows split over `data`:
  its k micro-batches stacked for scan, as it is for stream."""
  if mode == "scan":
    return _placed(optax_accum.split_micro_batches(batch, K), mesh, P(None, "data"))
  return _placed(batch, mesh, P("data"))


@functools.cache
def _windows_and_whole(n):
  """``n`` uneven batches (one window each), the starting params, and the
  params of whole-batch AdamW after them: the oracle every recipe must match.
  Computed once per ``n`` (nothing here is changed by the tests)."""
  batches = tuple(_uneven_batch(seed=i) for i in range(n))
  params0 = toy_lm.init_params(seed=0)
  whole, _, _ = toy_lm.whole_batch_run(params0, batches, _adamw())
  return batches, params0, whole


@functools.cache
def _adamw_opt():
  return optax_accum.MultiSteps(_adamw(), K)


@functools.cache
def _adamw_step(mode="stream", axis_name=None):
  """The AdamW train step of ``mode`` that several tests use, built once: a
  script builds its step once too. Its programs compile once per layout."""
  return optax_accum.make_train_step(
    toy_lm.mean_loss, _adamw_opt(), mode=mode, axis_name=axis_name
  )


def _run(step, mode, params, state, batches, mesh):
  for batch in batches:
    for call in [batch] if mode == "scan" else toy_lm.split(batch, K):
      params, state, metrics = step(params, state, _step_input(call, mode, mesh))
  return params, state, metrics


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_plain_jit_with_axis_name_reduces_once_per_window(mode):
  mesh = _mesh()
  batches, params0, whole = _windows_and_whole(3)
  opt, step = _adamw_opt(), _adamw_step(mode, axis_name="data")
  params = _placed(params0, mesh, P())
  params, state, metrics = _run(step, mode, params, opt.init(params), batches, mesh)
  assert int(metrics["update_count"]) == 3
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  # Between calls each replica keeps its own partial sum: a leading replica
  # axis split over `data`, one params-sized sum per device.
  leaves = zip(jax.tree.leaves(state.acc_grads), jax.tree.leaves(params), strict=True)
  for acc, p in leaves:
    assert acc.shape == (8, *p.shape)
    assert acc.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), acc.ndim)
    assert {s.data.shape for s in acc.addressable_shards} == {(1, *p.shape)}

  batch = batches[0] if mode == "scan" else toy_lm.split(batches[0], K)[0]
  batch = _step_input(batch, mode, mesh)
  update = _gradient_sized(step, params, state, batch, program="update")
  assert [(c.kind, c.in_loop) for c in update] == [("all-reduce", False)], update
  assert update[0].bytes - _param_bytes(params) <= SCALARS
  if mode == "stream":
    assert _gradient_sized(step, params, state, batch, program="accumulate") == []


def test_without_axis_name_jit_reduces_every_micro_batch():
  """What the plain jit recipe costs without `axis_name`: XLA reduces each
  micro-batch's gradient (k reductions per window), inside the scan too."""
  mesh = _mesh()
  params = _placed(toy_lm.init_params(seed=0), mesh, P())
  opt = _adamw_opt()
  for mode in ("stream", "scan"):
    step = _adamw_step(mode)
    batch = _step_input(_uneven_batch(seed=0), mode, mesh)
    programs = ["update", "accumulate"] if mode == "stream" else ["update"]
    for program in programs:
      found = _gradient_sized(step, params, opt.init(params), batch, program=program)
      assert len(found) == 1 and found[0].kind == "all-reduce", found
      assert found[0].in_loop == (mode == "scan")


@pytest.mark.parametrize("check_vma", [True, False])
def test_scan_in_shard_map_reduces_after_the_loop(check_vma):
  mesh = _mesh()
  batches, params0, whole = _windows_and_whole(3)
  opt = optax_accum.MultiSteps(_adamw(), K)
  step = optax_accum.make_train_step(
    toy_lm.mean_loss, opt, mode="scan", axis_name="data"
  )
  sharded = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P(None, "data")),
      out_specs=(P(), P(), P()),
      check_vma=check_vma,
    )
  )
  params, state = params0, opt.init(params0)
  stacked = [optax_accum.split_micro_batches(b, K) for b in batches]
  for batch in stacked:
    params, state, _ = sharded(params, state, batch)
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5
  found = _gradient_sized(sharded, params, state, stacked[0])
  assert [(c.kind, c.in_loop) for c in found] == [("all-reduce", False)], found


def test_accumulator_memory_per_device_does_not_grow():
  """The per-replica partial sums take one params-sized buffer per device, as
  the replicated accumulator does (XLA's memory analysis, per device)."""
  mesh = _mesh()
  params = _placed(toy_lm.init_params(seed=0), mesh, P())
  batch = _step_input(toy_lm.split(_uneven_batch(seed=0), K)[0], "stream", mesh)
  opt = _adamw_opt()
  sizes = {}
  for axis_name in (None, "data"):
    step = _adamw_step(axis_name=axis_name)
    lowered = step.lower(params, opt.init(params), batch, program="accumulate")
    memory = lowered.compile().memory_analysis()
    sizes[axis_name] = memory.argument_size_in_bytes, memory.temp_size_in_bytes
  # The same argument bytes; temporaries differ by a few scalars, well below
  # the params' 748 bytes that one more accumulator copy would add.
  assert sizes["data"][0] == sizes[None][0], sizes
  assert _param_bytes(params) > 4 * SCALARS
  assert sizes["data"][1] <= sizes[None][1] + 4 * SCALARS, sizes


def _sharded_params(mesh):
  params = toy_lm.init_params(seed=0)
  return {
    "embed": _placed(params["embed"], mesh, P(None, "data")),
    "head": _placed(params["head"], mesh, P()),
  }


def test_params_split_over_the_data_axis_are_a_clear_error():
  """Issue 15, item 4: params sharded over the data axis (FSDP) inside
  shard_map came out wrong without an error."""
  mesh = _mesh()
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, axis_name="data")
  params = toy_lm.init_params(seed=0)
  params = {**params, "embed": jnp.tile(params["embed"], (8, 1))}
  specs = {"embed": P("data"), "head": P()}
  sharded = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, P(), P("data")),
      out_specs=(specs, P(), P()),
    )
  )
  with pytest.raises(ValueError, match=r"params\['embed'\] differs per replica.*FSDP"):
    sharded(params, opt.init(params), _uneven_batch(seed=0))
  # Under plain jit the same split is refused with axis_name, and works without.
  params = _sharded_params(mesh)
  batch = _placed(_uneven_batch(seed=0), mesh, P("data"))
  with pytest.raises(ValueError, match=r"params\['embed'\] is split over the data"):
    step(params, opt.init(params), batch)
  plain = optax_accum.make_train_step(toy_lm.mean_loss, opt)
  _, state, _ = plain(params, opt.init(params), batch)
  assert int(state.mini_step) == 1


def test_batch_not_split_over_the_axis_is_a_clear_error():
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 2)
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, axis_name="data")
  params = toy_lm.init_params(seed=0)
  with pytest.raises(ValueError, match=r"must be a jax.Array split over 'data'"):
    step(params, opt.init(params), _uneven_batch(seed=0))


def test_partial_sums_resume_on_another_layout():
  """A state saved mid-window with per-replica partial sums carries on exactly
  on 4 replicas, and on one device without axis_name."""
  mesh8 = _mesh()
  mesh4 = jax.make_mesh((4,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:4])
  batches, params0, whole = _windows_and_whole(2)
  micro_batches = [mb for b in batches for mb in toy_lm.split(b, K)]
  opt = _adamw_opt()
  sharded, single = _adamw_step(axis_name="data"), _adamw_step()
  params = _placed(params0, mesh8, P())
  state = opt.init(params)
  for i, micro_batch in enumerate(micro_batches):
    if i < 3:  # Mid-window on 8 replicas...
      params, state, _ = sharded(params, state, _placed(micro_batch, mesh8, P("data")))
    elif i < 6:  # ... then on 4 (restored copies, as from a checkpoint)...
      if i == 3:
        params, state = _placed(params, mesh4, P()), jax.device_get(state)
      params, state, _ = sharded(params, state, _placed(micro_batch, mesh4, P("data")))
    else:  # ... then on one device.
      if i == 6:
        params, state = jax.device_get(params), jax.device_get(state)
        params = jax.tree.map(jnp.asarray, params)
        state = jax.tree.map(jnp.asarray, state)
      params, state, _ = single(params, state, micro_batch)
  assert int(state.gradient_step) == 2
  assert toy_lm.max_rel_diff(params, whole) <= 1e-5


@functools.cache
def _skip_step(check_vma):
  mesh = _mesh()
  opt = optax_accum.MultiSteps(
    optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite
  )
  step = optax_accum.make_train_step(toy_lm.mean_loss, opt, axis_name="data")

  def call(params, state, batch):
    params, state, _ = step(params, state, batch)
    skip_state = state.skip_state
    if not check_vma:  # Every replica's own, to compare them.
      skip_state = jax.tree.map(lambda x: x[None], skip_state)
    return params, state, skip_state

  out_specs = (P(), P(), P()) if check_vma else (P(), P(), P("data"))
  return opt, jax.jit(
    jax.shard_map(
      call,
      mesh=mesh,
      in_specs=(P(), P(), P("data")),
      out_specs=out_specs,
      check_vma=check_vma,
    )
  )


@pytest.mark.parametrize("check_vma", [True, False])
def test_should_skip_update_fn_with_axis_name(check_vma):
  """Issue 15, item 2: the README recipe (`out_specs` P() for the state) did
  not compile with check_vma=True, and each replica kept its own skip_state
  with check_vma=False. One replica's NaN skips the micro-batch everywhere and
  every replica keeps the same skip_state."""
  opt, run = _skip_step(check_vma)
  params = toy_lm.init_params(seed=0)
  state = opt.init(params)
  batch = _uneven_batch(seed=0)
  params, state, skip_state = run(params, state, batch)
  assert int(state.mini_step) == 1
  bad = {**batch, "mask": batch["mask"].astype(np.float32)}
  bad["mask"][-1] = np.nan  # The last replica's last row: a NaN gradient.
  _, state, skip_state = run(params, state, bad)
  assert int(state.mini_step) == 1, "the NaN micro-batch was not skipped"
  counts = np.asarray(skip_state["num_not_finite"]).reshape(-1)
  assert np.all(counts == counts[0]) and counts[0] > 0, counts
  assert np.all(np.asarray(skip_state["should_skip"]))


def _nan_row_batch():
  batch = _uneven_batch(seed=1)
  mask = batch["mask"].astype(np.float32)
  mask[-1, 0] = np.nan  # One row of the last replica: its weight is NaN.
  return {**batch, "mask": mask}


def test_one_replicas_bad_weight_drops_the_micro_batch_in_every_recipe():
  """Issue 15, item 3: plain jit dropped the whole micro-batch while
  shard_map still added the other replicas' rows. Every recipe now drops it,
  counts it once, and adds nothing."""
  mesh = _mesh()
  good, bad = _uneven_batch(seed=0), _nan_row_batch()
  params0 = toy_lm.init_params(seed=0)
  expected, _ = jax.grad(toy_lm.mean_loss, has_aux=True)(params0, good)
  opt = optax_accum.MultiSteps(optax.identity(), 2, axis_name="data")
  results = {}
  for recipe in ("jit", "jit_axis_name", "shard_map"):
    if recipe == "shard_map":
      step = optax_accum.make_train_step(toy_lm.mean_loss, opt, axis_name="data")
      run = jax.jit(
        jax.shard_map(
          step,
          mesh=mesh,
          in_specs=(P(), P(), P("data")),
          out_specs=(P(), P(), P()),
        )
      )
      place = lambda tree, spec: tree  # noqa: E731
    else:
      axis_name = "data" if recipe == "jit_axis_name" else None
      plain = optax_accum.MultiSteps(optax.identity(), 2)
      run = optax_accum.make_train_step(
        toy_lm.mean_loss, opt if axis_name else plain, axis_name=axis_name
      )
      place = lambda tree, spec: _placed(tree, mesh, spec)  # noqa: E731
    params = place(params0, P())
    state = (opt if recipe != "jit" else plain).init(params)
    for batch in (good, bad):
      params, state, metrics = run(params, state, place(batch, P("data")))
    results[recipe] = params
    assert int(metrics["skipped_micro_batches"]) == 1, recipe
    assert bool(metrics["updated"]), recipe
    np.testing.assert_allclose(metrics["weight"], good["mask"].sum(), err_msg=recipe)
  for recipe, params in results.items():
    update = jax.tree.map(lambda new, old: new - old, params, params0)
    assert toy_lm.rel_error(update, expected) <= 1e-5, recipe


def _dropout_loss(params, batch, key):
  """Token-mean loss with dropout on the hidden units, drawn per row from the
  step's key and the row's id in the dataset: the recipe that gives the same
  numbers on one device, under jit and under shard_map."""
  hidden = jnp.tanh(params["embed"][batch["inputs"]])
  keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(batch["row_id"])
  keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, hidden.shape[1:]))(keys)
  hidden = jnp.where(keep, hidden / 0.8, 0.0)
  logits = hidden @ params["head"]["w"] + params["head"]["b"][None, None, :]
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = jnp.asarray(batch["mask"]).astype(nll.dtype)
  return (nll * mask).sum() / mask.sum(), (mask.sum(), jax.random.key_data(key))


def test_each_replica_draws_its_own_dropout_keys():
  """Issue 15, item 5: every shard_map replica got the same key, so all data
  replicas drew the same dropout masks. Each replica now gets
  ``fold_in(key, replica)``; a loss that draws per row from a key that does
  not depend on the replica gives the same numbers in every recipe (see the
  README)."""
  mesh = _mesh()
  batch = _uneven_batch(seed=0)
  batch["row_id"] = np.arange(len(batch["mask"]))
  opt = optax_accum.MultiSteps(optax.sgd(0.1), 1)
  step = optax_accum.make_train_step(_dropout_loss, opt, has_aux=True, axis_name="data")
  run = jax.jit(
    jax.shard_map(
      lambda p, s, b, k: step(p, s, b, k)[2]["aux"][None],
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P()),
      out_specs=P("data"),
    )
  )
  params = toy_lm.init_params(seed=0)
  keys = np.asarray(run(params, opt.init(params), batch, jax.random.key(0)))
  assert len({tuple(k) for k in keys.reshape(8, -1)}) == 8, "replicas share keys"


def _row_keyed_loss(base):
  def loss_fn(params, batch, key):
    del key  # Per-row keys from a fixed base: the same in every recipe.
    loss, (weight, _) = _dropout_loss(params, batch, base)
    return loss, weight

  return loss_fn


def test_row_keyed_dropout_matches_across_recipes():
  mesh = _mesh()
  batches = []
  for i in range(2):
    batch = _uneven_batch(seed=i)
    batch["row_id"] = np.arange(len(batch["mask"])) + 1000 * i
    batches.append(batch)
  loss_fn = _row_keyed_loss(jax.random.key(7))
  key = jax.random.key(0)
  results = {}
  for recipe in ("one_device", "jit", "jit_axis_name", "shard_map"):
    axis_name = None if recipe in ("one_device", "jit") else "data"
    opt = optax_accum.MultiSteps(_adamw(), K)
    step = optax_accum.make_train_step(loss_fn, opt, axis_name=axis_name)
    if recipe == "shard_map":
      run = jax.jit(
        jax.shard_map(
          step,
          mesh=mesh,
          in_specs=(P(), P(), P("data"), P()),
          out_specs=(P(), P(), P()),
        )
      )
      place = lambda tree, spec: tree  # noqa: E731
    else:
      run = step
      place = (
        (lambda tree, spec: tree)
        if recipe == "one_device"
        else (lambda tree, spec: _placed(tree, mesh, spec))
      )
    params = place(toy_lm.init_params(seed=0), P())
    state = opt.init(params)
    for batch in batches:
      for micro_batch in toy_lm.split(batch, K):
        params, state, _ = run(params, state, place(micro_batch, P("data")), key)
    results[recipe] = params
  for recipe, params in results.items():
    assert toy_lm.max_rel_diff(params, results["one_device"]) <= 1e-5, recipe
