"""One state layout, restored with the orbax call users write first (issue 41).

Every path's state (one device, loss terms, Explicit
1-D and 2-D meshes, ``axis_name``, scan mode, the step in the user's own
``jit``) is saved with orbax in the middle of a window and at its end,
restored against ``step.init(params)`` (``opt.init(params)`` for a state of
``MultiSteps.update``), and
resumes bit-identical to the uninterrupted run. The layout is in the state's
structure, never a shape: 16 scalar params on 16 replicas resume exactly.
"""

import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import PerReplica

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

K, WINDOWS, ROWS, LENGTH, BIASES = 4, 2, 8, 5, 16


def _loss(params, batch):
  out = batch["x"] @ params["w"] + sum(params["b"])[None, None, :]
  err = (jnp.tanh(out).sum(-1) - batch["y"]) ** 2
  n = batch["mask"].sum()
  return (err * batch["mask"]).sum() / n, n


def _terms_loss(params, batch):
  value, n = _loss(params, batch)
  l2 = sum((b**2).sum() for b in params["b"])
  return {"nll": (value, n), "l2": (l2, jnp.float32(1))}


@functools.cache
def _stream():
  """The run's micro-batches; rows of very different token counts."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(K * WINDOWS):
    lengths = rng.integers(1, LENGTH + 1, ROWS)
    out.append(
      {
        "x": rng.normal(size=(ROWS, LENGTH, 3)).astype(np.float32),
        "y": rng.normal(size=(ROWS, LENGTH)).astype(np.float32),
        "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32),
      }
    )
  return tuple(out)


def _params0():
  """A matrix and 16 small biases."""
  rng = np.random.default_rng(1)
  biases = [rng.normal(size=4).astype(np.float32) * 0.1 for _ in range(BIASES)]
  return {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": biases}


PATHS = [
  "one-device",
  "terms",
  "explicit-1d",
  "explicit-2d",
  "axis_name",
  "scan",
  "jit",
]


@functools.cache
def _path(name):
  """``(place_params, place_batch, step, init)`` of one path."""
  terms = name == "terms"
  opt = optax_accum.MultiSteps(
    optax.adamw(3e-2, weight_decay=0.1), K, terms=("nll", "l2") if terms else None
  )
  loss = _terms_loss if terms else _loss
  if name in ("one-device", "terms", "scan", "jit"):
    device = jax.devices()[0]
    mode = "scan" if name == "scan" else "stream"
    step = optax_accum.make_train_step(loss, opt, mode=mode)
    init = step.init  # One sum, as opt.init gives.
    if name == "jit":
      step = jax.jit(step)
    batch = _windows if name == "scan" else (lambda b: b)
    return (lambda t: jax.device_put(t, device)), batch, step, init
  if name == "explicit-2d":
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    specs = {"w": P(None, "model"), "b": [P("model")] * BIASES}
  else:
    mesh = jax.make_mesh((8,), ("data",))
    specs = {"w": P(), "b": [P()] * BIASES}
  axis_name = "data" if name == "axis_name" else None
  step = optax_accum.make_train_step(loss, opt, axis_name=axis_name)

  def place_params(tree):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.device_put(tree, shardings)

  def place_batch(tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))

  return place_params, place_batch, step, step.init


def _windows(micro_batches):
  """Scan mode: one call per window."""
  return jax.tree.map(lambda *rows: np.stack(rows), *micro_batches)


def _run(name, params, state, micro_batches):
  place_params, place_batch, step, init = _path(name)
  if params is None:
    params = place_params(_params0())
    state = init(params)
  if name == "scan":
    calls = [
      place_batch(micro_batches[i : i + K]) for i in range(0, len(micro_batches), K)
    ]
  else:
    calls = [place_batch(b) for b in micro_batches]
  for call in calls:
    params, state, _ = step(params, state, call)
  return params, state


@functools.cache
def _uninterrupted(name):
  params, _ = _run(name, None, None, _stream())
  return jax.device_get(params)


def _layout_of(name):
  if name in ("one-device", "scan", "jit"):
    return dict
  if name == "terms":
    return tuple
  return PerReplica


@pytest.mark.parametrize("position", [2, K], ids=["mid-window", "window-end"])
@pytest.mark.parametrize("name", PATHS)
def test_a_naive_orbax_restore_resumes_bit_identical(name, position, tmp_path):
  if name == "scan" and position != K:
    pytest.skip("scan mode saves at window ends only")
  params, state = _run(name, None, None, _stream()[:position])
  assert int(state.mini_step) == position % K
  assert isinstance(state.acc_grads, _layout_of(name))
  saver = ocp.StandardCheckpointer()
  path = tmp_path / "checkpoint"
  saver.save(path, {"params": params, "opt_state": state, "position": position})
  saver.wait_until_finished()
  place_params, _, _, init = _path(name)
  fresh = place_params(jax.tree.map(np.zeros_like, _params0()))
  target = {"params": fresh, "opt_state": init(fresh), "position": 0}
  restored = saver.restore(path, target)
  assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
  rest = _stream()[int(restored["position"]) :]
  resumed, _ = _run(name, restored["params"], restored["opt_state"], rest)
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(resumed), _uninterrupted(name)
  )


def test_relayout_converts_every_layout_exactly_where_the_maths_allows():
  """One sum to per replica and back is exact (the first replica's partial
  sum); ``opt.update`` names ``relayout`` for a per-replica state."""
  params = _params0()
  opt = optax_accum.MultiSteps(optax.sgd(0.1), K)
  one = optax_accum.make_train_step(_loss, opt).init(params)
  assert jax.tree.structure(one) == jax.tree.structure(opt.init(params))
  filled = jax.tree.map(
    lambda a: jnp.arange(a.size, dtype=a.dtype).reshape(a.shape), one.acc_grads
  )
  one = one._replace(acc_grads=filled)
  assert isinstance(optax_accum.relayout(one, None).acc_grads, dict)
  init = _path("explicit-1d")[3]
  spread = _path("explicit-1d")[0](params)
  per_replica = optax_accum.relayout(one, init(spread))
  assert isinstance(per_replica.acc_grads, PerReplica)
  assert per_replica.acc_grads.sums["w"].shape == (8, 3, 4)
  back = optax_accum.relayout(per_replica, one)
  jax.tree.map(np.testing.assert_array_equal, back.acc_grads, filled)
  with pytest.raises(ValueError, match=r"optax_accum\.relayout"):
    opt.update(jax.tree.map(jnp.ones_like, spread), per_replica, spread)
  grown = {**params, "c": np.zeros(3, np.float32)}
  with pytest.raises(ValueError, match=r"\['c'\]"):
    optax_accum.relayout(per_replica, opt.init(grown))


SIXTEEN = textwrap.dedent(
  """
  import os
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
  import sys, jax, jax.numpy as jnp, numpy as np, optax, optax_accum
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P
  jax.config.update("jax_enable_x64", False)
  mesh = jax.make_mesh((16,), ("data",))
  rng = np.random.default_rng(0)
  p0 = {f"g{i:02d}": np.float32(rng.normal()) for i in range(16)}
  p0["w"] = rng.normal(size=(4, 4)).astype(np.float32)
  batches = []
  for _ in range(2):
    mask = (rng.random(32) < 0.7).astype(np.float32)
    batches.append({"x": rng.normal(size=(32, 4)).astype(np.float32), "mask": mask})

  def loss(p, b):
    gates = sum(p[f"g{i:02d}"] * b["x"][:, i % 4] for i in range(16))
    rows = ((b["x"] @ p["w"]).sum(-1) * gates) ** 2
    n = b["mask"].sum()
    return (rows * b["mask"]).sum() / n, n

  opt = optax_accum.MultiSteps(optax.sgd(1.0), 2)
  step = optax_accum.make_train_step(loss, opt)
  place = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
  params = place(p0, P())
  params, state, _ = step(params, step.init(params), place(batches[0], P("data")))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(sys.argv[1], {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  fresh = place(jax.tree.map(np.zeros_like, p0), P())
  restored = ckpt.restore(sys.argv[1], {"params": fresh, "opt_state": step.init(fresh)})
  params, state, _ = step(
    restored["params"], restored["opt_state"], place(batches[1], P("data"))
  )
  whole = jax.tree.map(lambda *r: np.concatenate(r), *batches)
  want = jax.tree.map(lambda p, g: p - g, p0, jax.grad(lambda p: loss(p, whole)[0])(p0))
  err = max(
    float(np.max(np.abs(np.asarray(a) - b) / (np.abs(b) + 1e-3)))
    for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(want))
  )
  print("ERR", err)
  """
)


def test_sixteen_scalars_on_sixteen_replicas_resume_with_the_whole_batch(tmp_path):
  """The per-replica sums of 16 scalars have the shape one buffer of 16
  scalars would: restored naively mid-window, the window's update is the
  whole batch's (it was off by 0.556 when layouts were told by shape)."""
  out = subprocess.run(
    [sys.executable, "-c", SIXTEEN, str(tmp_path / "ckpt")],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  err = float(out.stdout.split("ERR")[-1])
  assert err <= 1e-5, err


SGD = optax_accum.MultiSteps(optax.sgd(1.0), K)
_STEP = optax_accum.make_train_step(_loss, SGD)


@functools.cache
def _handing(kind):
  """A function ``(params, state, micro_batches) -> (params, state)`` of one
  path on one device (no donation: states are shared between paths)."""
  step = optax_accum.make_train_step(_loss, SGD, donate=False)
  if kind == "update":
    update = jax.jit(SGD.update)

    def run(params, state, micro_batches):
      for b in micro_batches:
        (_, n), g = jax.value_and_grad(_loss, has_aux=True)(params, b)
        u, state = update(g, state, params, weight=n)
        params = optax.apply_updates(params, u)
      return params, state

    return run
  if kind == "scan":
    scan = optax_accum.make_train_step(_loss, SGD, mode="scan", donate=False)
    return lambda p, s, mbs: scan(p, s, _windows(mbs))[:2]
  if kind == "lax.scan":

    @jax.jit
    def run(params, state, stacked):
      def body(carry, b):
        return step(*carry, b)[:2], None

      return jax.lax.scan(body, (params, state), stacked)[0]

    return lambda p, s, mbs: run(p, s, _windows(mbs))
  inner = jax.jit(step) if kind == "jit" else step

  def loop(params, state, micro_batches):
    for b in micro_batches:
      params, state, _ = inner(params, state, b)
    return params, state

  return loop


@pytest.mark.parametrize("second", ["update", "stream", "scan", "jit", "lax.scan"])
@pytest.mark.parametrize("first", ["update", "stream", "jit", "lax.scan"])
def test_any_paths_state_continues_on_any_other_path(first, second):
  """Half a window on one path, the rest on another: the whole batch's
  update (one device, one sum)."""
  params = _params0()
  batches = _stream()[:K]
  params_, state = _handing(first)(params, _STEP.init(params), batches[:2])
  assert isinstance(state.acc_grads, dict)
  got, state = _handing(second)(params_, state, batches[2:])
  assert isinstance(state.acc_grads, dict) and int(state.gradient_step) == 1
  whole = jax.tree.map(lambda *rows: np.concatenate(rows), *batches)
  grad = jax.grad(lambda p: _loss(p, whole)[0])(params)
  want = jax.tree.map(lambda p, g: p - g, params, grad)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want
  )


@pytest.mark.parametrize("inside", ["jit", "lax.scan"])
def test_a_per_replica_state_continues_in_your_jit_and_lax_scan(inside):
  """Half a window from Python on an 8-device Explicit mesh (per-replica
  partial sums), the rest in the user's ``jit`` or ``lax.scan``: the state
  keeps its type through the carry, and the window's update is the whole
  batch's. (With ``axis_name`` the in-graph step runs inside ``shard_map``,
  and under plain ``jit`` its error says so.)"""
  mesh = jax.make_mesh((8,), ("data",))
  step = optax_accum.make_train_step(_loss, SGD, donate=False)
  params0 = jax.device_put(_params0(), NamedSharding(mesh, P()))
  rows = NamedSharding(mesh, P("data"))
  batches = _stream()[:K]
  params, state = params0, step.init(params0)
  for b in batches[:2]:
    params, state, _ = step(params, state, jax.device_put(b, rows))
  assert isinstance(state.acc_grads, PerReplica)
  rest = [jax.device_put(b, rows) for b in batches[2:]]
  if inside == "jit":
    in_jit = jax.jit(lambda p, s, b: step(p, s, b)[:2])
    for b in rest:
      params, state = in_jit(params, state, b)
  else:
    stacked = jax.device_put(
      _windows(batches[2:]), NamedSharding(mesh, P(None, "data"))
    )

    @jax.jit
    def run(params, state, stacked):
      def body(carry, b):
        return step(*carry, b)[:2], None

      return jax.lax.scan(body, (params, state), stacked)[0]

    params, state = run(params, state, stacked)
  assert isinstance(state.acc_grads, PerReplica) and int(state.gradient_step) == 1
  whole = jax.tree.map(lambda *r: np.concatenate(r), *batches)
  grad = jax.grad(lambda p: _loss(p, whole)[0])(_params0())
  want = jax.tree.map(lambda p, g: p - g, _params0(), grad)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
    jax.device_get(params),
    want,
  )


# -- issue 48: states matched to params by leaf path, on every path ------------


def _named_loss(params, batch):
  h = batch["x"]
  for name in sorted(params):
    h = h + params[name][None]
  n = batch["mask"].sum()
  return ((jnp.tanh(h).sum(-1) ** 2) * batch["mask"]).sum() / n, n


def _named_params(names):
  rng = np.random.default_rng(2)
  return {name: rng.normal(size=4).astype(np.float32) * 0.1 for name in names}


def _named_batches():
  rng = np.random.default_rng(3)
  return [
    {
      "x": rng.normal(size=(ROWS, 4)).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.8).astype(np.float32),
    }
    for _ in range(K)
  ]


NAMES = [f"b{i:02d}" for i in range(20)]
OTHERS = {
  "lost-b00": NAMES[1:],
  "renamed-z00": ["z00", *NAMES[1:]],  # The same shapes, in the same order.
}


def _other_paths(kind):
  """A call ``(params, state, micro_batch)`` of one path: the streaming and
  scan steps from Python, the step in the user's ``jit`` and ``lax.scan``,
  and ``MultiSteps.update``."""
  step = optax_accum.make_train_step(_named_loss, SGD, donate=False)
  if kind == "stream":
    return step
  if kind == "scan":
    scan = optax_accum.make_train_step(_named_loss, SGD, mode="scan", donate=False)
    return lambda p, s, b: scan(p, s, _windows([b]))
  if kind == "jit":
    return jax.jit(step)
  if kind == "lax.scan":
    run = jax.jit(
      lambda p, s, w: jax.lax.scan(lambda c, b: (step(*c, b)[:2], None), (p, s), w)
    )
    return lambda p, s, b: run(p, s, _windows([b]))
  grad = jax.grad(lambda p, b: _named_loss(p, b)[0])
  return lambda p, s, b: jax.jit(SGD.update)(grad(p, b), s, p)


@pytest.mark.parametrize("other", list(OTHERS))
@pytest.mark.parametrize("kind", ["stream", "scan", "jit", "lax.scan", "update"])
def test_a_state_for_other_params_is_refused_naming_the_leaf(kind, other):
  """Half a window for 20 biases, continued with params that lost ``b00``
  (or renamed it ``z00``, same shapes): a ``ValueError`` naming ``b00``, never
  sums matched by position (0.25 and 0.54 off the whole batch, silently)."""
  params = _named_params(NAMES)
  _, state, _ = _NAMED(params, _NAMED.init(params), _named_batches()[0])
  assert isinstance(state.acc_grads, dict)
  with pytest.raises(ValueError, match=r"\['b00'\]"):
    _other_paths(kind)(_named_params(OTHERS[other]), state, _named_batches()[1])


_NAMED = optax_accum.make_train_step(_named_loss, SGD, donate=False)


def test_relayout_works_under_set_mesh():
  """``relayout`` both ways between one device's sum and 8 replicas' partial
  sums inside ``with jax.set_mesh(mesh)``, where a program of arrays
  committed to one device cannot run: exact."""
  params = jax.device_put(_params0(), jax.devices()[0])
  _, one, _ = _STEP(params, _STEP.init(params), _stream()[0])
  init = _path("explicit-1d")[3]
  spread = init(_path("explicit-1d")[0](_params0()))
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    per_replica = optax_accum.relayout(one, spread)
    back = optax_accum.relayout(per_replica, one)
  assert isinstance(per_replica.acc_grads, PerReplica)
  assert isinstance(back.acc_grads, dict)
  jax.tree.map(np.testing.assert_array_equal, back.acc_grads, one.acc_grads)


@pytest.mark.parametrize("how", ["relayout", "_replace"])
def test_a_converted_state_goes_back_to_the_step_that_returned_it(how):
  """A state the step returned, converted to ``opt.init``'s layout with
  ``relayout`` (or its ``acc_grads`` ``_replace``d, as the docstring once
  wrote), handed back: the step ends the window with the whole batch's
  update."""
  params = _named_params(NAMES)
  step = optax_accum.make_train_step(_named_loss, SGD, donate=False)
  batches = _named_batches()
  p, state = params, step.init(params)
  for b in batches[:2]:
    p, state, _ = step(p, state, b)
  one = optax_accum.relayout(state, SGD.init(params))
  if how == "_replace":
    one = state._replace(acc_grads=one.acc_grads)
  for b in batches[2:]:
    p, one, _ = step(p, one, b)
  whole = jax.tree.map(lambda *rows: np.concatenate(rows), *batches)
  grad = jax.grad(lambda q: _named_loss(q, whole)[0])(params)
  want = jax.tree.map(lambda q, g: q - g, params, grad)
  assert int(one.gradient_step) == 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5), p, want)


@pytest.mark.parametrize("devices", [4, 1])
def test_a_mid_window_checkpoint_of_8_replicas_resumes_on_fewer_devices(
  devices, tmp_path
):
  """Half a window on 8 replicas (per-replica partial sums), saved with
  orbax; restored on 4 devices, or on one, against
  ``resume_target(step.init(params), ckpt.metadata(path)...)``: the window
  ends as the uninterrupted 8-replica run does (the 8 partial sums added up
  once: rounding only)."""
  place8, batch8, step8, init8 = _path("explicit-1d")
  params = place8(_params0())
  state, stream = init8(params), _stream()[:K]
  for b in stream[:2]:
    params, state, _ = step8(params, state, batch8(b))
  saver = ocp.StandardCheckpointer()
  path = tmp_path / "checkpoint"
  saver.save(path, {"params": params, "opt_state": state})
  saver.wait_until_finished()
  want = params
  for b in stream[2:]:
    want, state, _ = step8(want, state, batch8(b))
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  here = NamedSharding(mesh, P())
  step = optax_accum.make_train_step(_loss, _path("explicit-1d")[2].optimizer)
  fresh = jax.device_put(jax.tree.map(np.zeros_like, _params0()), here)
  saved = saver.metadata(path).item_metadata["opt_state"]
  target = optax_accum.resume_target(step.init(fresh), saved)
  restored = saver.restore(path, {"params": fresh, "opt_state": target})
  got, state = restored["params"], restored["opt_state"]
  for b in stream[2:]:
    got, state, _ = step(got, state, jax.device_put(b, NamedSharding(mesh, P("data"))))
  assert int(state.gradient_step) == 1
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
    jax.device_get(got),
    jax.device_get(want),
  )


def test_a_one_sum_of_params_named_like_a_layouts_fields_resumes_as_one_sum():
  """Params with a top-level ``sums`` or ``groups`` leaf: their one-sum
  checkpoint's metadata is not taken for per-replica or packed sums."""
  for name in ("sums", "groups"):
    params = {name: np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    saved = {"acc_grads": {name: np.zeros(3, np.float32), "b": np.zeros(2)}}
    target = optax_accum.resume_target(opt.init(params), saved)
    assert jax.tree.structure(target.acc_grads) == jax.tree.structure(params), name
    assert target.acc_grads[name].shape == (3,)


def test_resume_target_takes_the_saved_layout():
  """Packed (a checkpoint written before packing was removed), per-replica
  and one-sum checkpoints each get a target of their own layout and shapes
  (host zeros), from any state of the same params; packed groups these
  params never gave are refused."""
  params = _named_params(NAMES)
  one = SGD.init(params)
  packed = {"acc_grads": {"groups": [np.zeros(80, np.float32)], "rest": ()}}
  target = optax_accum.resume_target(one, packed)
  assert isinstance(target.acc_grads, optax_accum.Packed)
  assert [g.shape for g in target.acc_grads.groups] == [(80,)]
  saved = one._replace(
    acc_grads=PerReplica(jax.tree.map(lambda a: np.zeros((8, *a.shape)), params), ())
  )
  assert optax_accum.resume_target(one, saved).acc_grads.sums["b07"].shape == (8, 4)
  assert optax_accum.resume_target(target, one).acc_grads["b07"].shape == (4,)
  fewer = {"acc_grads": {"groups": [np.zeros(68, np.float32)], "rest": ()}}
  with pytest.raises(ValueError, match=r"packed in groups of \[68\] elements"):
    optax_accum.resume_target(one, fewer)


def _any_shape_loss(params, batch):
  """A loss of params of any shape (the step checks its gradient's leaves)."""
  return sum(jnp.sum(v**2) for v in params.values()), batch["mask"].sum()


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_state_for_a_reshaped_leaf_names_the_leaf(mode):
  """Params whose ``b00`` changed shape (4 to 2 x 2, the same size): the
  leaf and both shapes are named."""
  params = _named_params(NAMES)
  stream = optax_accum.make_train_step(_any_shape_loss, SGD, donate=False)
  _, state, _ = stream(params, stream.init(params), _named_batches()[0])
  reshaped = {**params, "b00": params["b00"].reshape(2, 2)}
  step = optax_accum.make_train_step(_any_shape_loss, SGD, mode=mode, donate=False)
  batch = _named_batches()[1]
  with pytest.raises(ValueError, match=r"\['b00'\] has shape \(2, 2\)"):
    step(reshaped, state, _windows([batch]) if mode == "scan" else batch)
