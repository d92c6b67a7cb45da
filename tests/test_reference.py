"""Every call path against one float64 reference of the documented semantics.

Each example draws a configuration (leaf dtypes and shapes, ``every_k_schedule``
int or callable, ``use_grad_mean``, ``grad_reduction``, ``on_nonfinite``,
``should_skip_update_fn``, ``accumulator_dtype``, ``progress_schedule`` unit,
weights passed or not or returned as a Python constant, rng keys typed or raw,
loss terms in a share of the examples: 2 or 3, each with its own weights) and a
stream of micro-batches (weights that are 0, constant, fractional, negative,
NaN, inf or huge, per term; gradients and losses with NaN or inf; early
``end_window``; rejections), runs it through one call path (``PATHS``), and
compares every call's update or params, state counters, window sums (each
term's), metrics (each term's mean and weight) and keys with
:mod:`reference_model`.

CI runs ``DEFAULT_EXAMPLES`` examples in all, spread evenly over the paths;
``OPTAX_ACCUM_REFERENCE_EXAMPLES`` sets another total for a long run::

  OPTAX_ACCUM_REFERENCE_EXAMPLES=2000 python -m pytest tests/test_reference.py -n 2

Seeds are fixed: example ``seed`` of a path is the same on every run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_model as ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _layouts

#: Examples in CI, spread over the paths (about 1 s of CPU each); the long run
#: takes 2,000 (``make test-long``).
DEFAULT_EXAMPLES = 45  # 3 for each of the 15 paths.
EXAMPLES = int(os.environ.get("OPTAX_ACCUM_REFERENCE_EXAMPLES", DEFAULT_EXAMPLES))
AUTO = jax.sharding.AxisType.Auto
# Path name -> (replicas, uses make_train_step).
PATHS = {
  "update_eager": (1, False),
  "update_jit": (1, False),
  "update_shard_map": (None, False),
  "stream": (1, True),
  "stream_in_jit": (1, True),
  "stream_in_scan": (1, True),
  "scan": (1, True),
  "scan_joined": (1, True),
  "shard_map_vma": (None, True),
  "shard_map_no_vma": (None, True),
  "shard_map_scan": (None, True),
  "pmap": (None, True),
  "jit_sharded": (1, True),
  "jit_explicit": (1, True),
  "jit_axis_name": (None, True),
}


# -- what every path builds ---------------------------------------------------------


def _recorder() -> optax.GradientTransformationExtraArgs:
  """Identity that counts its calls and keeps the window totals it was given."""

  def init(params):
    del params
    return {
      "calls": jnp.zeros([], jnp.int32),
      "weight": jnp.zeros([], jnp.float32),
      "micro": jnp.zeros([], jnp.int32),
    }

  def update(updates, state, params=None, **extra_args):
    del params
    return updates, {
      "calls": state["calls"] + 1,
      "weight": jnp.asarray(extra_args["window_weight"]).astype(jnp.float32),
      "micro": jnp.asarray(extra_args["window_micro_steps"]).astype(jnp.int32),
    }

  return optax.GradientTransformationExtraArgs(init, update)


def _skip_fn(updates, gradient_step, params):
  del params
  first = jax.tree.leaves(updates)[0].reshape(-1)[0]
  return first == ref.SENTINEL, {"step": gradient_step}


def _optimizer(config: ref.Config) -> optax_accum.MultiSteps:
  lr = optax_accum.progress_schedule(
    ref.schedule, unit=config.unit, per_update=config.per_update
  )
  inner = optax.chain(
    optax.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.float32)(learning_rate=lr),
    _recorder(),
  )
  every_k = config.every_k
  if not isinstance(every_k, int):
    ks = every_k
    every_k = lambda step: jnp.where(step % 2 == 0, ks[0], ks[1])  # noqa: E731
  return optax_accum.MultiSteps(
    inner,
    every_k,
    use_grad_mean=config.use_grad_mean,
    should_skip_update_fn=_skip_fn if config.skip_fn else None,
    accumulator_dtype=config.accumulator_dtype,
    grad_reduction=config.grad_reduction,
    on_nonfinite=config.on_nonfinite,
    terms=config.terms,
  )


def _loss_fn_for(config: ref.Config, contract: bool = False):
  """Loss ``sum(batch["l"])`` whose gradient is exactly ``sum(batch["g"])``.

  Rows are micro-batch parts (one per replica or device); the weight is the
  rows' sum, or a Python constant (``config.literal_weight``); with a key, its
  data is the aux output. ``contract``: each row's ``g`` meets the params in
  a contraction (as a matmul weight does), which JAX types for params cast
  to ``reduced`` on an Explicit mesh; otherwise in an elementwise product.
  With loss terms, a dict ``{name: (value, weight)}`` of such losses (in
  sorted order, not the declared one), each from its own ``g``, ``l`` and
  ``w``.
  """

  def value(params, grads, losses):
    zero = jnp.zeros([], jnp.float32)  # NaN where a gradient is not: inf * 0.
    for name, p in params.items():
      p = p.astype(jnp.promote_types(p.dtype, jnp.float32))
      g = grads[name].astype(p.dtype)
      d = p - jax.lax.stop_gradient(p)
      if contract:
        zero = zero + jnp.sum(jnp.tensordot(g, d, axes=d.ndim))
      else:
        zero = zero + jnp.sum(d[None] * g)
    loss = jnp.sum(losses)
    return loss + zero.astype(loss.dtype)

  def weight(rows, constant):
    return constant if config.literal_weight and constant is not None else jnp.sum(rows)

  def loss_fn(params, batch, key=None):
    if config.terms is None:
      out = value(params, batch["g"], batch["l"])
      rest = weight(batch["w"], config.constant_weights[0])
    else:
      constants = dict(zip(config.terms, config.constant_weights, strict=True))
      out = {
        name: (
          value(params, batch["g"][name], batch["l"][name]),
          weight(batch["w"][name], constants[name]),
        )
        for name in sorted(config.terms)
      }
      rest = None
    if key is None:
      return out if rest is None else (out, rest)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.key_data(key)
    return (out, key) if rest is None else (out, (rest, key))

  return loss_fn


def _params(config: ref.Config, rng: np.random.Generator) -> dict:
  return {
    name: jnp.asarray(np.asarray(rng.normal(size=shape), ref.DTYPES[dtype]))
    for name, shape, dtype in config.leaves
  }


def _key(config: ref.Config, seed: int):
  if config.rng == "typed":
    return jax.random.key(seed)
  if config.rng == "raw":
    return jax.random.PRNGKey(seed)
  return None


def _key_data(key, n: int, replica: int | None = None) -> np.ndarray:
  """The key of the run's ``n``-th micro-batch (on one replica, under
  ``axis_name``)."""
  key = jax.random.fold_in(key, n)
  if replica is not None:
    key = jax.random.fold_in(key, replica)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key)


def _rows(config: ref.Config, mb: ref.MicroBatch, term: int) -> dict:
  """One term of a micro-batch (the whole loss without terms) as the loss
  reads it: one row per replica."""
  return {
    "g": {
      name: np.stack([r.terms[term].grads[name] for r in mb.replicas]).astype(
        ref.DTYPES[dtype]
      )
      for name, _, dtype in config.leaves
    },
    "l": np.asarray([r.terms[term].loss for r in mb.replicas], np.float32),
    "w": np.asarray([r.terms[term].weight for r in mb.replicas], np.float32),
  }


def _by_term(config: ref.Config, parts: list[dict]) -> dict:
  """Each term's rows as one batch: ``batch[key][term]``, or the one term's."""
  if config.terms is None:
    (part,) = parts
    return part
  return {
    key: {name: part[key] for name, part in zip(config.terms, parts, strict=True)}
    for key in ("g", "l", "w")
  }


def _batch(config: ref.Config, mb: ref.MicroBatch) -> dict:
  """A micro-batch as the loss reads it: one row per replica."""
  return _by_term(config, [_rows(config, mb, i) for i in range(config.term_count)])


def _stack(batches: list[dict]) -> dict:
  return jax.tree.map(lambda *x: np.stack(x), *batches)


def _bool(flag: bool, rng: np.random.Generator):
  """A concrete flag as a loader might give it: Python, NumPy or JAX bool."""
  return [flag, np.bool_(flag), jnp.asarray(flag)][rng.integers(3)]


def _seen(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


# -- observing ------------------------------------------------------------------------


def _observe(state, updates=None, params=None, metrics=None) -> dict:
  """Everything the reference predicts, read from one call's outputs."""
  state, updates, params, metrics = jax.tree.map(
    _seen, (state, updates, params, metrics)
  )
  injected, recorded = state.inner_opt_state
  obs = {
    "mini_step": int(state.mini_step),
    "gradient_step": int(state.gradient_step),
    "updated": int(state.updated),
    "skipped_micro_batches": int(state.skipped_micro_batches),
    "skipped_windows": int(state.skipped_windows),
    "micro_batches_seen": int(state.micro_batches_seen),
    "inner_calls": int(recorded["calls"]),
    "window_micro_steps": int(recorded["micro"]),
    "progress_updates": int(injected.hyperparams_states["learning_rate"].updates),
    "learning_rate": float(injected.hyperparams["learning_rate"]),
    "window_weight": float(recorded["weight"]),
    # One entry per term (tuples in the state), or the one window's.
    "acc_weight": [float(w) for w in _per_term(state.acc_weight)],
    "acc_loss": [float(loss) for loss in _per_term(state.acc_loss)],
    "acc_grads": _per_term(state.acc_grads),
  }
  if state.skip_state != ():
    obs["skip_step"] = int(state.skip_state["step"])
  if updates is not None:
    obs["updates"] = updates
  if params is not None:
    obs["params"] = params
  if metrics is not None:
    for name in ("micro_steps", "updated", "skipped_micro_batches", "skipped_windows"):
      obs[f"m_{name}"] = int(metrics[name])
    obs["m_update_count"] = int(metrics["update_count"])
    for name in ("loss", "weight", "grad_norm", "learning_rate"):
      obs[f"m_{name}"] = float(metrics[name])
    if "aux" in metrics:
      obs["aux"] = np.asarray(metrics["aux"])
    if "terms" in metrics:
      obs["m_terms"] = {
        name: {"loss": float(term["loss"]), "weight": float(term["weight"])}
        for name, term in metrics["terms"].items()
      }
  return obs


def _per_term(x) -> list:
  """A state field's entries, one per loss term (tuples), or ``[x]``."""
  return list(x) if isinstance(x, tuple) else [x]


def _index(tree, i):
  return jax.tree.map(lambda x: np.asarray(x)[i], tree)


def _replicas_agree(tree) -> None:
  """Stacked per-replica outputs: every replica holds the same values."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):  # NaN == NaN for bfloat16 too.
      x = x.astype(np.float64)
    for i in range(1, x.shape[0]):
      np.testing.assert_array_equal(
        x[i], x[0], err_msg=f"replica {i} differs at {jax.tree_util.keystr(path)}"
      )


# -- the paths ----------------------------------------------------------------------
# Each takes (config, plan, rng, key) and returns the initial params and one
# observation per call of the plan; a call is (micro-batches, scan mode?).


def _run_update(config, plan, rng, key, *, jit):
  del key  # MultiSteps.update takes no key.
  opt = _optimizer(config)
  params = _params(config, rng)
  params0 = jax.tree.map(_seen, params)
  state = opt.init(params)
  update = jax.jit(opt.update) if jit else opt.update
  observed = []

  def weight_of(term):  # As a loader might pass it.
    if jit:
      return np.float32(term.weight)
    return [term.weight, np.float32(term.weight)][rng.integers(2)]

  for (mb,), _ in plan:
    grads, weight, loss = _update_args(
      config, mb, weight_of if config.pass_weight else None
    )
    kwargs = {}
    if config.pass_weight:
      kwargs["weight"] = weight
    if config.pass_loss:
      kwargs["loss"] = loss
    if jit:
      kwargs["end_window"] = jnp.asarray(mb.end_window)
    elif mb.end_window or rng.random() < 0.5:
      kwargs["end_window"] = _bool(mb.end_window, rng)
    updates, state = update(grads, state, params, **kwargs)
    observed.append(_observe(state, updates=updates))
  return params0, observed


def _update_args(config, mb, weight_of):
  """A one-replica micro-batch as ``MultiSteps.update`` takes it: gradient,
  weight (``weight_of(term)``, or ``None``) and loss; with loss terms, dicts
  by term name."""
  (r,) = mb.replicas
  grads = jax.tree.map(lambda rows: jnp.asarray(rows[0]), _batch(config, mb)["g"])
  if weight_of is None:
    weight_of = lambda term: None  # noqa: E731
  if config.terms is None:
    (term,) = r.terms
    return grads, weight_of(term), np.float32(term.loss)
  by_name = dict(zip(config.terms, r.terms, strict=True))
  weights = {name: weight_of(term) for name, term in by_name.items()}
  losses = {name: np.float32(term.loss) for name, term in by_name.items()}
  return grads, weights, losses


def _mesh(replicas, explicit=False):
  devices = np.asarray(jax.devices()[:replicas])
  kind = jax.sharding.AxisType.Explicit if explicit else AUTO
  return jax.sharding.Mesh(devices, ("data",), axis_types=(kind,))


def _run_update_shard_map(config, plan, rng, key):
  del key  # MultiSteps.update takes no key.
  opt = _optimizer(config).replace(axis_name="data")
  params = _params(config, rng)
  params0 = jax.tree.map(_seen, params)
  check_vma = bool(rng.random() < 0.5)

  def call(grads, state, weight, loss, end):
    kwargs = {"end_window": end}
    if config.pass_weight:
      kwargs["weight"] = jax.tree.map(lambda w: w[0], weight)
    if config.pass_loss:
      kwargs["loss"] = jax.tree.map(lambda v: v[0], loss)
    grads = jax.tree.map(lambda g: g[0], grads)
    updates, state = opt.update(grads, state, params, **kwargs)
    return jax.tree.map(lambda x: jnp.asarray(x)[None], (updates, state))

  run = jax.jit(
    jax.shard_map(
      call,
      mesh=_mesh(config.replicas),
      in_specs=(P("data"), P(), P("data"), P("data"), P()),
      out_specs=P("data"),
      check_vma=check_vma,
    )
  )
  state = opt.init(params)
  observed = []
  for (mb,), _ in plan:
    batch = _batch(config, mb)
    out = run(batch["g"], state, batch["w"], batch["l"], jnp.asarray(mb.end_window))
    _replicas_agree(out)
    updates, state = _index(out, 0)
    observed.append(_observe(state, updates=updates))
  return params0, observed


def _train_step(config, opt, mode="stream", contract=False, **kwargs):
  loss_fn = _loss_fn_for(config, contract)
  return optax_accum.make_train_step(
    loss_fn, opt, mode=mode, has_aux=config.rng is not None, **kwargs
  )


def _run_stream(config, plan, rng, key, *, variant):
  opt = _optimizer(config)
  params = _params(config, rng)
  params0 = jax.tree.map(_seen, params)
  donate = variant == "host" and bool(rng.random() < 0.5)
  step = _train_step(config, opt, donate=donate)
  state = opt.init(params)
  observed = []
  if variant == "in_scan":

    @jax.jit
    def run(params, state, batches, ends, key):
      def body(carry, xs):
        params, state, metrics = step(*carry, xs[0], key, end_window=xs[1])
        return (params, state), (params, state, metrics)

      return jax.lax.scan(body, (params, state), (batches, ends))[1]

    batches = _stack([_batch(config, mbs[0]) for mbs, _ in plan])
    ends = np.asarray([mbs[0].end_window for mbs, _ in plan])
    outs = run(params, state, batches, ends, key)
    for i in range(len(plan)):
      p, s, m = _index(outs, i)
      observed.append(_observe(s, params=p, metrics=m))
    return params0, observed
  if variant == "in_jit":
    run = jax.jit(lambda p, s, b, k, e: step(p, s, b, k, end_window=e))
  else:
    run = lambda p, s, b, k, e: step(p, s, b, k, end_window=_bool(e, rng))  # noqa: E731
  for (mb,), _ in plan:
    end = jnp.asarray(mb.end_window) if variant == "in_jit" else mb.end_window
    params, state, metrics = run(params, state, _batch(config, mb), key, end)
    observed.append(_observe(_one_sum(state), params=params, metrics=metrics))
  return params0, observed


def _run_scan(config, plan, rng, key):
  """Scan mode, with streamed micro-batches between windows where the plan has them."""
  opt = _optimizer(config)
  params = _params(config, rng)
  params0 = jax.tree.map(_seen, params)
  stream = _train_step(config, opt)
  scan = _train_step(config, opt, mode="scan")
  state = opt.init(params)
  observed = []
  for mbs, is_scan in plan:
    if is_scan:
      batch = _stack([_batch(config, mb) for mb in mbs])
      kwargs = {}
      if rng.random() < 0.3:  # A false flag is harmless in scan mode.
        kwargs["end_window"] = _bool(False, rng)
      params, state, metrics = scan(params, state, batch, key, **kwargs)
    else:
      (mb,) = mbs
      params, state, metrics = stream(
        params, state, _batch(config, mb), key, end_window=mb.end_window
      )
    observed.append(_observe(state, params=params, metrics=metrics))
  return params0, observed


def _run_replicated(config, plan, rng, key, *, how):
  """The train step inside shard_map or pmap, with ``axis_name``; streaming, or
  in scan mode (``how="shard_map_scan"``, the micro-batch axis leading)."""
  opt = _optimizer(config)
  params = _params(config, rng)
  params0 = jax.tree.map(_seen, params)
  scan = how == "shard_map_scan"
  step = _train_step(config, opt, mode="scan" if scan else "stream", axis_name="data")
  if how == "pmap":
    run = jax.pmap(
      lambda p, s, b, k, e: step(p, s, b, k, end_window=e),
      axis_name="data",
      in_axes=(None, None, 0, None, None),
      devices=jax.devices()[: config.replicas],
    )
  else:

    def call(p, s, b, k, e):
      out = step(p, s, b, k) if scan else step(p, s, b, k, end_window=e)
      return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

    run = jax.jit(
      jax.shard_map(
        call,
        mesh=_mesh(config.replicas),
        in_specs=(P(), P(), P(None, "data") if scan else P("data"), P(), P()),
        out_specs=P("data"),
        check_vma=how != "shard_map_no_vma" and (not scan or bool(rng.random() < 0.5)),
      )
    )
  state = opt.init(params)
  observed = []
  for mbs, _ in plan:
    batch = (
      _stack([_batch(config, mb) for mb in mbs]) if scan else _batch(config, mbs[0])
    )
    if how == "pmap":  # One row per device.
      batch = jax.tree.map(lambda x: x[:, None], batch)
    out = run(params, state, batch, key, jnp.asarray(mbs[-1].end_window))
    keys = out[2].pop("aux", None)  # Each replica's own keys.
    _replicas_agree(out)
    params, state, metrics = _index(out, 0)
    observed.append(_observe(state, params=params, metrics=metrics))
    if keys is not None:
      observed[-1]["replica_keys"] = np.asarray(keys)
  return params0, observed


def _run_jit_sharded(config, plan, rng, key, explicit=False):
  """Plain jit, the batch's rows sharded over 4 devices; weights split over rows.

  ``explicit``: on an Explicit mesh, where the step leaves the gradients of
  2-D params each device's partial sum until the window ends.
  """
  devices = 4
  mesh = _mesh(devices, explicit)
  opt = _optimizer(config)
  params = jax.device_put(_params(config, rng), NamedSharding(mesh, P()))
  params0 = jax.tree.map(_seen, params)
  step = _train_step(config, opt, contract=explicit)
  state = step.init(params)  # Partial sums on an Explicit mesh (opt.init: one sum).
  observed = []
  for (mb,), _ in plan:
    parts = [
      _split_rows(_rows(config, mb, i), devices, rng) for i in range(config.term_count)
    ]
    rows = jax.device_put(_by_term(config, parts), NamedSharding(mesh, P("data")))
    params, state, metrics = step(params, state, rows, key, end_window=mb.end_window)
    # On an Explicit mesh each device keeps its partial sum: compare their sum.
    observed.append(_observe(_one_sum(state), params=params, metrics=metrics))
  return params0, observed


def _split_rows(rows: dict, devices: int, rng: np.random.Generator) -> dict:
  """One replica's rows as ``devices`` rows: the gradient and loss on the
  first, the weight split over all of them where it is a whole number."""
  out = {
    "g": {
      n: np.concatenate([g, np.zeros((devices - 1, *g.shape[1:]), g.dtype)])
      for n, g in rows["g"].items()
    },
    "l": np.concatenate([rows["l"], np.zeros(devices - 1, np.float32)]),
    "w": np.zeros(devices, np.float32),
  }
  w = float(rows["w"][0])
  if math.isfinite(w) and w == int(w) and 0 <= w <= 2**24:
    cuts = np.sort(rng.integers(0, int(w) + 1, devices - 1))
    out["w"][:] = np.diff(np.concatenate([[0], cuts, [int(w)]]))
  else:
    out["w"][0] = w
  return out


def _one_sum(state):
  """``state`` with its accumulator as one sum: the replicas' partial sums
  added up (in their dtype; inf + -inf: NaN, as wanted)."""
  acc = state.acc_grads
  if isinstance(acc, optax_accum.PerReplica):
    with np.errstate(invalid="ignore", over="ignore"):
      sums = jax.tree.map(lambda a: np.asarray(a).sum(0, dtype=a.dtype), acc.sums)
    return state._replace(acc_grads=sums)
  return state._replace(acc_grads=_layouts.to_sum(acc))


def _run_jit_axis_name(config, plan, rng, key):
  """Plain jit, one row per replica sharded over the data axis, with
  ``axis_name``: the step keeps per-replica partial sums (streaming), or sums
  after its loop (scan mode)."""
  opt = _optimizer(config)
  mesh = _mesh(config.replicas)
  params = jax.device_put(_params(config, rng), NamedSharding(mesh, P()))
  params0 = jax.tree.map(_seen, params)
  step = _train_step(config, opt, axis_name="data")
  scan = _train_step(config, opt, mode="scan", axis_name="data")
  state = opt.init(params)
  observed = []
  for mbs, is_scan in plan:
    if is_scan:
      batch = _stack([_batch(config, mb) for mb in mbs])
      batch = jax.device_put(batch, NamedSharding(mesh, P(None, "data")))
      params, state, metrics = scan(params, state, batch, key)
    else:
      batch = jax.device_put(_batch(config, mbs[0]), NamedSharding(mesh, P("data")))
      end = _bool(mbs[0].end_window, rng)
      params, state, metrics = step(params, state, batch, key, end_window=end)
    keys = metrics.pop("aux", None)
    # The state holds each replica's partial sum: compare the window's sum.
    observed.append(_observe(_one_sum(state), params=params, metrics=metrics))
    if keys is not None:  # Replica axis leading (after the micro-batch axis).
      keys = np.asarray(keys)
      observed[-1]["replica_keys"] = np.moveaxis(keys, 1, 0) if is_scan else keys
  return params0, observed


RUNNERS = {
  "update_eager": functools.partial(_run_update, jit=False),
  "update_jit": functools.partial(_run_update, jit=True),
  "update_shard_map": _run_update_shard_map,
  "stream": functools.partial(_run_stream, variant="host"),
  "stream_in_jit": functools.partial(_run_stream, variant="in_jit"),
  "stream_in_scan": functools.partial(_run_stream, variant="in_scan"),
  "scan": _run_scan,
  "scan_joined": _run_scan,
  "shard_map_vma": functools.partial(_run_replicated, how="shard_map_vma"),
  "shard_map_no_vma": functools.partial(_run_replicated, how="shard_map_no_vma"),
  "shard_map_scan": functools.partial(_run_replicated, how="shard_map_scan"),
  "pmap": functools.partial(_run_replicated, how="pmap"),
  "jit_sharded": _run_jit_sharded,
  "jit_explicit": functools.partial(_run_jit_sharded, explicit=True),
  "jit_axis_name": _run_jit_axis_name,
}


# -- drawing and comparing ---------------------------------------------------------


def _library_view(stream, train_step):
  """What the library receives: a train step's loss is NaN with a non-finite grad."""
  if not train_step:
    return stream
  for mb in stream:
    for r in mb.replicas:
      for t in r.terms:
        if not all(np.isfinite(g).all() for g in t.grads.values()):
          t.loss = math.nan
  return stream


def _plan(path, stream, rng):
  if path in ("scan", "shard_map_scan"):
    chunks = ref.draw_chunks(rng, len(stream))
    plan, start = [], 0
    for size in chunks:
      plan.append((stream[start : start + size], True))
      start += size
    return plan
  if path in ("scan_joined", "jit_axis_name"):  # Streamed, then a scan window...
    plan, start, is_scan = [], 0, False
    while start < len(stream):
      size = min(len(stream) - start, int(rng.integers(1, 4)))
      if is_scan:
        plan.append((stream[start : start + size], True))
      else:
        plan.extend(([mb], False) for mb in stream[start : start + size])
      start, is_scan = start + size, not is_scan
    return plan
  return [([mb], False) for mb in stream]


def draws_terms(seed: int) -> bool:
  """Whether example ``seed`` of a path draws loss terms: 2 in 7 (in CI, the
  third of the 3 examples of each path). Every path takes them."""
  return seed % 7 in (2, 5)


def draw_example(path: str, seed: int):
  """A configuration, a call plan and its expected results (redrawn if ambiguous)."""
  replicas, train_step = PATHS[path]
  for attempt in range(100):
    rng = np.random.default_rng([zlib.crc32(path.encode()), seed, attempt])
    config = ref.draw_config(
      rng,
      replicas=replicas or int(rng.choice([2, 4])),
      train_step=train_step,
      terms=draws_terms(seed),
    )
    stream = ref.draw_stream(rng, config, int(rng.integers(4, 11)), end_window=True)
    stream = _library_view(stream, train_step)
    plan = _plan(path, stream, rng)
    model = ref.Reference(config)
    try:
      expected = [model.call(mbs, is_scan) for mbs, is_scan in plan]
    except ref.Ambiguous:
      continue
    return config, plan, expected, rng
  raise AssertionError("no unambiguous example in 100 draws")


def _close(got, want, tol, what):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  bad = ~np.isfinite(want)
  assert np.all(~np.isfinite(got[bad])), f"{what}: {got} should be non-finite at {bad}"
  with np.errstate(invalid="ignore", over="ignore"):
    ok = np.abs(got - want) <= tol
  assert np.all(ok | bad), f"{what}: got {got}, want {want} +- {tol}"


def check_call(config, expected, obs, previous_params, key, where):
  for name, value in expected.counters.items():
    if name == "skip_step" and "skip_step" not in obs:
      continue
    if name == "micro_steps":
      continue
    assert obs[name] == value, f"{where}: {name} is {obs[name]}, want {value}"
  for name in ("learning_rate", "window_weight"):
    value, tol = expected.floats[name]
    _close(obs[name], value, tol, f"{where}: {name}")
  _check_window(expected, obs, where)
  _check_updates(config, expected, obs, previous_params, where)
  if "m_loss" in obs:
    _check_metrics(config, expected, obs, where)
    if key is not None:
      _check_keys(expected, obs, key, where)


def _check_window(expected, obs, where):
  """Each term's weight, loss and sum in the state after the call."""
  assert len(obs["acc_weight"]) == len(expected.terms), f"{where}: terms in the state"
  for i, term in enumerate(expected.terms):
    for name in ("acc_weight", "acc_loss"):
      value, tol = term[name]
      _close(obs[name][i], value, tol, f"{where}: {name} of term {i}")
  if expected.acc is not None:
    for i, acc in enumerate(expected.acc):
      for name, (value, tol, bad) in acc.items():
        got = np.asarray(obs["acc_grads"][i][name], np.float64)
        want = np.where(bad, np.nan, value)
        _close(got, want, tol, f"{where}: acc_grads[{name}] of term {i}")
  elif "updates" in obs:  # MultiSteps.update empties the accumulator.
    for i, acc in enumerate(obs["acc_grads"]):
      for name, got in acc.items():
        np.testing.assert_array_equal(
          got, 0.0, err_msg=f"{where}: acc_grads[{name}] of term {i}"
        )


def _check_updates(config, expected, obs, previous_params, where):
  """The update, or the params after it."""
  if "updates" in obs:
    for name, got in obs["updates"].items():
      if expected.update is None:
        np.testing.assert_array_equal(got, 0.0, err_msg=f"{where}: updates[{name}]")
      else:
        value, tol = expected.update[name]
        _close(got, value, tol, f"{where}: updates[{name}]")
  if "params" in obs:
    for name, got in obs["params"].items():
      before = np.asarray(previous_params[name], np.float64)
      if expected.update is None:
        np.testing.assert_array_equal(
          np.asarray(got, np.float64), before, err_msg=f"{where}: params[{name}]"
        )
      else:
        value, tol = expected.update[name]
        tol = tol + ref.eps(config.leaf_dtype(name)) * np.abs(before + value)
        _close(got, before + value, tol, f"{where}: params[{name}]")


def _check_metrics(config, expected, obs, where):
  """The train step's metrics, each term's mean and weight among them."""
  c, f = expected.counters, expected.floats
  want = {
    "m_micro_steps": c["micro_steps"],
    "m_updated": c["updated"],
    "m_update_count": c["gradient_step"],
    "m_skipped_micro_batches": c["skipped_micro_batches"],
    "m_skipped_windows": c["skipped_windows"],
  }
  for name, value in want.items():
    assert obs[name] == value, f"{where}: {name} is {obs[name]}, want {value}"
  for name in ("loss", "weight", "grad_norm", "learning_rate"):
    value, tol = f[name]
    _close(obs[f"m_{name}"], value, tol, f"{where}: metrics[{name}]")
  if config.terms is None:
    assert "m_terms" not in obs, f"{where}: metrics['terms'] without terms"
    return
  assert set(obs["m_terms"]) == set(config.terms), f"{where}: metrics['terms']"
  for name, term in zip(config.terms, expected.terms, strict=True):
    for what in ("loss", "weight"):
      value, tol = term[what]
      got = obs["m_terms"][name][what]
      _close(got, value, tol, f"{where}: metrics['terms'][{name!r}][{what!r}]")


def _check_keys(expected, obs, key, where):
  """The keys ``loss_fn`` got: the run's n-th micro-batch's (each replica's)."""
  if "replica_keys" in obs:  # Under axis_name.
    for r, got in enumerate(obs["replica_keys"]):
      want_keys = np.stack([_key_data(key, n, r) for n in expected.keys])
      got_keys = got.reshape(want_keys.shape)
      np.testing.assert_array_equal(
        got_keys, want_keys, err_msg=f"{where}: keys of replica {r}"
      )
  else:
    want_keys = np.stack([_key_data(key, n) for n in expected.keys])
    got_keys = obs["aux"].reshape(want_keys.shape)
    np.testing.assert_array_equal(got_keys, want_keys, err_msg=f"{where}: keys")


SEEDS = range(math.ceil(EXAMPLES / len(PATHS)))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("path", list(PATHS))
def test_path_matches_the_reference(path, seed):
  sharded = path in ("jit_sharded", "jit_explicit")
  if (PATHS[path][0] is None or sharded) and jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  config, plan, expected, rng = draw_example(path, seed)
  run_and_check(path, seed, config, plan, expected, rng)


def run_and_check(path, seed, config, plan, expected, rng):
  """Runs a plan through a path and checks every call against the reference."""
  with jax.enable_x64(config.x64):
    key = _key(config, seed)
    params, observed = RUNNERS[path](config, plan, rng, key)
    assert len(observed) == len(plan)
    for i, (exp, obs) in enumerate(zip(expected, observed, strict=True)):
      where = f"{path} seed {seed} call {i} of {len(plan)}, {config}"
      check_call(config, exp, obs, params, key, where)
      params = obs.get("params")


def _two_terms(**changes) -> ref.Config:
  """Two terms ``("ce", "aux")`` on one float32 leaf of 3 elements."""
  config = ref.Config(
    leaves=(("p0", (3,), "float32"),),
    every_k=2,
    use_grad_mean=True,
    grad_reduction="mean",
    on_nonfinite="skip_window",
    skip_fn=False,
    accumulator_dtype=None,
    unit="updates",
    per_update=None,
    pass_weight=True,
    constant_weights=(None, None),
    literal_weight=False,
    pass_loss=True,
    rng=None,
    replicas=1,
    x64=False,
    terms=("ce", "aux"),
  )
  return dataclasses.replace(config, **changes)


def _micro_batch(*terms) -> ref.MicroBatch:
  """One replica's micro-batch of ``(gradient, weight, loss)`` per term."""
  return ref.MicroBatch(
    [
      ref.Replica(
        [ref.Term({"p0": np.asarray(g, float)}, w, v) for g, w, v in terms], False
      )
    ]
  )


def _check_stream(path, config, stream):
  plan = [([mb], False) for mb in stream]
  model = ref.Reference(config)
  expected = [model.call(mbs, is_scan) for mbs, is_scan in plan]
  stream = _library_view(stream, PATHS[path][1])
  run_and_check(path, 0, config, plan, expected, np.random.default_rng(0))


@pytest.mark.parametrize("path", ["stream", "update_jit"])
def test_a_nonfinite_term_of_weight_0_leaves_the_others_alone(path):
  """A micro-batch without ce tokens (its mean 0/0: NaN gradient, weight 0)
  adds only its aux term. (The train step pulled all terms back through one
  ``jax.vjp``, which made aux's gradient NaN, 0 * NaN, and skipped the
  window; found by this model, issue 28.)"""
  stream = [
    _micro_batch(([1.0, 2.0, 3.0], 3.0, 0.5), ([1.0, 1.0, 1.0], 1.0, 0.25)),
    _micro_batch(([math.nan] * 3, 0.0, math.nan), ([2.0, 2.0, 2.0], 1.0, 0.25)),
  ]
  _check_stream(path, _two_terms(), stream)


@pytest.mark.parametrize("path", ["stream", "update_jit"])
def test_progress_counts_an_update_whose_first_term_has_no_weight(path):
  """Three updates, the second with ce (the first term) of weight 0: each
  counts. (``progress_schedule`` counted an update only where
  ``window_weight``, the first term's, was positive, so the third update
  repeated the second's learning rate; found by this model, issue 28.)"""
  stream = [
    _micro_batch(([1.0, 2.0, 3.0], w, 0.5), ([1.0, 1.0, 1.0], 1.0, 0.25))
    for w in (3.0, 0.0, 3.0)
  ]
  _check_stream(path, _two_terms(every_k=1), stream)


def test_the_examples_exercise_every_documented_case():
  """The drawn examples are not vacuous: over the seeds this run uses, the
  reference applies updates and meets every case of the README's table and
  of windows of loss terms, which every path draws."""
  stats: dict[str, int] = {}
  paths_with_terms = set()
  for path in PATHS:
    for seed in SEEDS:
      config, plan, _, _ = draw_example(path, seed)
      model = ref.Reference(config)
      for mbs, is_scan in plan:
        model.call(mbs, is_scan)
      for name, count in model.stats.items():
        stats[name] = stats.get(name, 0) + count
      if config.terms is not None:
        paths_with_terms.add(path)
  assert all(count > 0 for count in stats.values()), stats
  assert stats["applied"] >= len(PATHS) * len(SEEDS), stats
  assert paths_with_terms == set(PATHS), set(PATHS) - paths_with_terms
