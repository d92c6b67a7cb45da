"""Losses coupling a window's micro-batches (contrastive, MoE balance), exact in
two passes (Gradient Cache; docs/coupled.md): the representations and the window
loss's cotangents for them, then a scan-mode window on a surrogate (loss term
``"window"``) whose gradient is their vector-Jacobian product."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.stages import Lowered

from optax_accum._core import _checks, _placement, _reduction, _state
from optax_accum._core._multi_steps import MultiSteps, MultiStepsState
from optax_accum._step import _errors
from optax_accum._step._programs import micro_batch_key

_Out = tuple[Any, Any, Any]  # A step's params, opt_state and metrics.


class CoupledLoss(NamedTuple):
  """A loss over the whole window's representations, for :func:`make_train_step`.

  Attributes:
    represent: ``represent(params, micro_batch) -> z``, the micro-batch's
      representations (a tree of arrays, rows first): embeddings, router
      probabilities. With an ``rng`` passed to the step,
      ``represent(params, micro_batch, key)``.
    window_loss: ``window_loss(z, batch) -> (loss, weight)``: the loss over the
      window's representations and rows (the micro-batches' rows joined, in
      order, as one batch) and the number of items it averages over. On the
      whole batch, ``window_loss(represent(params, batch), batch)`` is the
      objective the window's gradient is exactly that of.
    loss_fn: Optional per-example loss beside it, ``loss_fn(params,
      micro_batch) -> (loss, weight)`` as :func:`make_train_step` takes; its
      window mean is added to ``L``, each with its own weight.
  """

  represent: Callable[..., Any]
  window_loss: Callable[[Any, Any], tuple[Any, Any]]
  loss_fn: Callable[..., Any] | None = None

  @property
  def terms(self) -> tuple[str, ...]:
    """The loss terms of the step's window: ``"window"``, and ``"examples"``
    with a ``loss_fn``."""
    return ("window",) if self.loss_fn is None else ("window", "examples")

  def whole_batch(self, params: Any, batch: Any, key: Any = None) -> jax.Array:
    """The objective on ``batch`` in one piece: the oracle a window equals
    (``key`` for a ``represent`` and ``loss_fn`` that take one)."""
    keys = () if key is None else (key,)
    loss, _ = self.window_loss(self.represent(params, batch, *keys), batch)
    if self.loss_fn is not None:
      loss = loss + self.loss_fn(params, batch, *keys)[0]
    return loss


def _on_a_mesh(x: Any) -> bool:
  """Whether ``x`` is on ``Explicit`` mesh axes (a reshape needs ``out_sharding``)."""
  sharding = jax.typeof(x).sharding
  mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
  return mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types


def _joined(tree: Any, axes: tuple[str, ...]) -> Any:
  """Leaves ``(k, rows, ...)`` with every replica's rows, in replica order, as
  ``(k * rows, ...)``, a window-level leaf ``(k,)`` as its first micro-batch's;
  on a mesh gathered, so the loss sees every row."""

  def gather(x: Any) -> Any:
    return x if x.ndim < 2 else jax.lax.all_gather(x, axes, axis=1, tiled=True)

  def join(x: Any) -> Any:
    if x.ndim == 1:
      return x[0]
    shape = (x.shape[0] * x.shape[1], *x.shape[2:])
    return jnp.reshape(x, shape, out_sharding=P() if _on_a_mesh(x) else None)

  return jax.tree.map(join, jax.tree.map(gather, tree) if axes else tree)


def _own(c: Any, x: Any, axes: tuple[str, ...]) -> Any:
  """The cotangent ``c`` (gathered, joined) cut to ``x``'s micro-batches and this
  replica's rows; a window-level leaf's whole on the first micro-batch of the
  first replica (its gradient is counted once)."""
  replica = _reduction.replica_index(axes)
  if x.ndim == 1:
    return jnp.zeros_like(x).at[0].set(jnp.where(replica == 0, c, 0))
  c = c.reshape(x.shape[0], -1, *x.shape[2:])
  if axes:
    c = jax.lax.dynamic_slice_in_dim(c, replica * x.shape[1], x.shape[1], axis=1)
  return jax.sharding.reshard(c, jax.typeof(x).sharding) if _on_a_mesh(x) else c


def cotangents(
  coupled: CoupledLoss, params: Any, window: Any, keys: Any, axes: tuple[str, ...]
) -> dict[str, Any]:
  """Pass 1: the cotangents ``dL/dz_i`` of this replica's rows, ``L`` broadcast
  to ``k``, and the weight shares and scales of the surrogate; ``ValueError``
  naming a batch leaf without rows."""

  def window_loss(z_joined: Any) -> tuple[jax.Array, jax.Array]:
    out = coupled.window_loss(z_joined, batch)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise ValueError(
        "`window_loss` must return (loss, weight): the window's loss and the "
        "number of items it averages over; got "
        f"{jax.typeof(out) if hasattr(out, 'dtype') else type(out).__name__}."
      )
    return out

  for path, x in jax.tree_util.tree_flatten_with_path(window)[0]:
    if jnp.ndim(x) < 2:  # window_loss sees the rows joined: a leaf needs rows.
      raise ValueError(
        f"batch leaf {jax.tree_util.keystr(path)} has no row axis (shape "
        f"{jnp.shape(x)[1:]} a micro-batch): a CoupledLoss joins the window's "
        "rows for window_loss. Give it a value per row, or compute it from "
        "the rows in window_loss."
      )
  z = jax.lax.map(lambda a: coupled.represent(params, *a), (window, *keys))
  batch = _joined(window, axes)
  # Varying over axes, or the loss's gradient would come back summed over them.
  z_all = jax.tree.map(lambda x: _reduction.varying_over(x, axes), _joined(z, axes))
  (loss, weight), grads = jax.value_and_grad(window_loss, has_aux=True)(z_all)
  k = jax.tree.leaves(window)[0].shape[0]
  shares = weight_shares(weight, k, jax.lax.axis_size(axes) if axes else 1)
  total = jnp.asarray(weight, shares.dtype)
  return {
    "cotangent": jax.tree.map(lambda c, x: _own(c, x, axes), grads, z),
    "loss": jnp.broadcast_to(loss, (k,)),
    "weight": shares,
    "scale": jnp.where(shares > 0, total / jnp.where(shares > 0, shares, 1), k),
  }


def weight_shares(weight: Any, k: int, replicas: int = 1) -> jax.Array:
  """A replica's ``k`` shares of ``weight``: ``weight / replicas / k`` each, the
  last that less the sum of the others, so the accumulator, adding them in
  order, sums them to ``weight / replicas`` exactly (that sum is within a
  factor 2 of it), and the replicas' sum is ``weight`` (exact for a power of
  two of replicas). float32 at least, never the loss's bfloat16."""
  dtype = jnp.promote_types(jnp.result_type(weight), jnp.float32)
  total = jnp.asarray(weight, dtype) / replicas
  share = total / k
  added = sum([share] * (k - 1), jnp.zeros([], dtype))  # As the accumulator does.
  return jnp.concatenate([jnp.full((k - 1,), share, dtype), (total - added)[None]])


def coupled_optimizer(coupled: CoupledLoss, optimizer: MultiSteps) -> MultiSteps:
  """``optimizer`` with the coupled loss terms; ``ValueError`` if it cannot."""
  config = optimizer.config
  if config.terms not in (None, coupled.terms):
    raise ValueError(
      f"A CoupledLoss sets the loss terms itself, {coupled.terms}: build the "
      f"MultiSteps without terms= (it has {config.terms})."
    )
  if config.should_skip_update_fn is not None:
    raise ValueError(
      "A CoupledLoss takes no should_skip_update_fn: every micro-batch's "
      "gradient is a part of one window's loss, so rejecting one would apply "
      "a partial window. Build the MultiSteps without it (a non-finite window "
      "is skipped whole: on_nonfinite='skip_window')."
    )
  if config.grad_reduction != "mean" or config.on_nonfinite != "skip_window":
    raise ValueError(
      "A CoupledLoss needs grad_reduction='mean' and on_nonfinite='skip_window': "
      "every micro-batch's gradient depends on the whole window, so none can be "
      "summed or dropped alone."
    )
  if config.noise_scale:
    raise ValueError(
      "A CoupledLoss cannot measure the noise scale (noise_scale=True): its "
      "micro-batches' gradients are parts of one window's loss, not samples "
      "of it. Build the MultiSteps without noise_scale."
    )
  return optimizer.replace(terms=coupled.terms)


class CoupledStep:
  """A train step on a :class:`CoupledLoss`: pass 1, then a scan-mode step on the
  surrogate, in one program. Streaming, each call but a window's last puts a
  device copy of its micro-batch in the state's ``held``; the last runs them
  all as one window. ``optimizer`` is the accumulator the window runs: the
  given one, with the loss terms."""

  def __init__(
    self,
    coupled: CoupledLoss,
    optimizer: MultiSteps,
    build: Callable[[Callable[..., Any], MultiSteps], Any],
    mode: str = "scan",
    donate: bool = True,
  ):
    self.coupled, self.mode = coupled, mode
    self.optimizer = coupled_optimizer(coupled, optimizer)
    self._axes = _checks.axes(self.optimizer.config.axis_name)
    self._step = build(self._surrogate, self.optimizer)
    jit = jax.jit(donate_argnums=(0, 1) if donate else ())
    self._program, self._held_program = jit(self._both_passes), jit(self._held_window)

  def _surrogate(self, params: Any, micro: Any, *key: Any) -> Any:
    """Pass 2's loss on ``{"batch", "cotangent", "loss", "weight", "scale"}``:
    term ``"window"`` of value ``L``, weight ``w_i`` (shares summing to ``W``)
    and gradient ``W / w_i`` times the VJP, so the window's weighted mean of the
    ``k`` gradients is ``dL/dparams``."""
    z = self.coupled.represent(params, micro["batch"], *key)
    products = jax.tree.map(lambda c, zi: jnp.sum(c * zi), micro["cotangent"], z)
    dot = sum(jax.tree.leaves(products))
    grad = micro["scale"] * (dot - jax.lax.stop_gradient(dot))  # Of value 0.
    terms = {"window": (jax.lax.stop_gradient(micro["loss"]) + grad, micro["weight"])}
    if self.coupled.loss_fn is not None:
      terms["examples"] = self.coupled.loss_fn(params, micro["batch"], *key)
    return terms

  def init(self, params: Any) -> MultiStepsState:
    """The state to start from, laid out as the window's step keeps it (one
    sum with ``axis_name``: each replica's rows are summed inside a window)."""
    one_sum = self.optimizer.config.axis_name is not None
    return (self.optimizer if one_sum else self._step).init(params)

  @_errors.explained
  def __call__(
    self,
    params: Any,
    opt_state: Any,
    batch: Any,
    rng: Any = None,
    *,
    end_window: Any = False,
  ) -> _Out:
    """A window in one program; streaming, one micro-batch: held in the state,
    or the window it ends run whole."""
    _errors.check_not_a_train_state(params)
    if self.mode != "stream":
      _errors.check_end_window(end_window, scan=True)
      _state.check_not_holding(opt_state, "a scan-mode step")
      _errors.check_counts_keys(opt_state, rng)
      return self._on_mesh(self._program, params, opt_state, batch, rng)
    if _placement.traced(batch, end_window):
      raise ValueError(
        "A streaming step on a CoupledLoss holds micro-batches between calls, "
        "which a trace cannot: in your own jit or scan use mode='scan'."
      )
    given = getattr(opt_state, "held", None) or ()
    state = opt_state._replace(held=None) if given else opt_state
    _errors.check_state(state)
    # A copy (a loader may refill its buffers), host arrays on the host first: a
    # program reads its host arguments when it runs, after the call returns.
    own = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.array(x), batch)
    held = (*_like(batch, given), _copied(own))
    config = self.optimizer.config  # A schedule's k is read from the state (a wait).
    k = config.constant_k or int(config.k_at(int(jax.device_get(state.gradient_step))))
    if len(held) < k and not bool(end_window):
      # Nothing is computed before the window's last (its loss comes with it).
      metrics = {"micro_steps": np.int32(len(held)), "updated": np.bool_(False)}
      metrics["update_count"] = state.gradient_step
      return params, state._replace(held=held), metrics
    return self._on_mesh(self._held_program, params, state, held, rng)

  def _on_mesh(self, run: Any, params: Any, state: Any, batch: Any, rng: Any) -> Any:
    """``run`` called under the mesh ``batch`` is split over ``axis_name`` on,
    where it needs one and the caller set none (the program then maps over it);
    ``ValueError`` if there is none."""
    axes, here = self._axes, jax.sharding.get_abstract_mesh()
    if not axes or set(axes) <= set(here.axis_names) or _placement.traced(batch):
      return run(params, state, batch, rng)
    for mesh in map(_placement.mesh_of, jax.tree.leaves(batch)):
      if mesh is not None and set(axes) <= set(mesh.axis_names):
        with jax.set_mesh(mesh):
          return run(params, state, batch, rng)
    raise ValueError(_NO_MESH.format(axes=axes))

  def _both_passes(self, params: Any, opt_state: Any, batch: Any, rng: Any) -> _Out:
    """Pass 1, then the scan-mode step on the surrogate (traced, so inlined);
    with ``axis_name`` each replica on its own rows, in a ``shard_map`` over the
    batch's mesh where the caller is in none."""
    axes, mesh = self._axes, jax.sharding.get_abstract_mesh()
    if mesh.manual_axes and self.optimizer.config.axis_name is None:
      manual = tuple(mesh.manual_axes)
      raise ValueError(
        f"The train step runs under the manual mesh axes {manual} (pmap or "
        "shard_map) without `axis_name`: each replica's window loss would see "
        "its own rows only, and the replicated params would drift apart. Pass "
        f"axis_name={manual[0] if len(manual) == 1 else manual!r} to "
        "make_train_step: the replicas then gather the window's representations."
      )
    if axes and not set(axes) <= set(mesh.manual_axes):
      if not set(axes) <= set(mesh.axis_names):
        raise ValueError(_NO_MESH.format(axes=axes))
      names, specs = set(axes), (P(), P(), P(None, axes), P())
      return jax.shard_map(
        self._both_passes, mesh=mesh, in_specs=specs, out_specs=P(), axis_names=names
      )(params, opt_state, batch, rng)
    k, keys = jax.tree.leaves(batch)[0].shape[0], []
    if rng is not None:  # The keys pass 2 gives the window's micro-batches.
      seen = getattr(opt_state, "micro_batches_seen", 0)
      keys = [jax.vmap(lambda i: micro_batch_key(rng, seen + i, axes))(jnp.arange(k))]
    window = {"batch": batch, **cotangents(self.coupled, params, batch, keys, axes)}
    return self._step(params, opt_state, window, rng)

  def _held_window(self, params: Any, opt_state: Any, held: Any, rng: Any) -> _Out:
    """A streamed window's micro-batches, stacked, as one window."""
    window = jax.tree.map(lambda *x: jnp.stack(x), *held)
    return self._both_passes(params, opt_state, window, rng)

  def lower(self, params: Any, opt_state: Any, batch: Any, rng: Any = None) -> Lowered:
    """The window's program (both passes), lowered: for XLA's figures."""
    return self._program.lower(params, opt_state, batch, rng)


_NO_MESH = (  # The error for ``axis_name`` with no mesh, formatted with ``axes``.
  "`axis_name` {axes!r} outside shard_map: a CoupledLoss step splits each "
  "window's rows over it, so the batch must be a jax.Array on a mesh with "
  "those axes (jax.device_put(batch, NamedSharding(mesh, P(None, {axes!r}))) "
  "in scan mode; in your own jit, under jax.set_mesh(mesh)). Or drop "
  "axis_name: under plain jit the window is global."
)


@jax.jit
def _copied(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


def _like(micro_batch: Any, held: tuple[Any, ...]) -> tuple[Any, ...]:
  """``held`` in ``micro_batch``'s tree (a checkpoint restores tuples as lists);
  ``ValueError`` naming the leaf where ``micro_batch`` is unlike the window's
  first (a window stacks its micro-batches)."""
  if not held:
    return held
  first = jax.tree_util.tree_flatten_with_path(held[0])
  given = jax.tree_util.tree_flatten_with_path(micro_batch)
  if [_names(p) for p, _ in first[0]] != [_names(p) for p, _ in given[0]]:
    raise ValueError(
      f"micro-batch {len(held)} of this coupled window has the tree "
      f"{given[1]}, the window's first {first[1]}: a window stacks its "
      "micro-batches, so each must have the same leaves."
    )
  for (_, a), (path, b) in zip(first[0], given[0], strict=True):
    if (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b)):
      raise ValueError(
        f"micro-batch {len(held)} of this coupled window has leaf "
        f"{jax.tree_util.keystr(path)} of shape {jnp.shape(b)} and dtype "
        f"{jnp.result_type(b)}, the window's first {jnp.shape(a)} and "
        f"{jnp.result_type(a)}: a window stacks its micro-batches. Pad every "
        "micro-batch to one shape (padding rows weigh 0 in window_loss)."
      )
  return tuple(jax.tree.unflatten(given[1], jax.tree.leaves(h)) for h in held)


def _names(path: Any) -> tuple[Any, ...]:
  """A leaf's path by names and positions, whatever the containers (orbax
  restores a tuple as a list, a NamedTuple's fields as a dict's keys)."""
  return tuple(
    getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path
  )
