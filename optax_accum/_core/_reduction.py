"""The reduction policy: what a window's sums are summed over, and when.

The window arithmetic (:mod:`optax_accum._core._window`) never reduces by itself.
Under ``shard_map`` with ``check_vma=True`` the gradient of params that entered
replicated comes back already summed over the data axes: it is counted once
(``"sum"``) or refused (``"mean"``: per-replica weights no longer apply).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._core import _checks

AxisName = str | tuple[str, ...]


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes over which ``x`` is typed to differ per replica."""
  return jax.typeof(x).manual_axis_type.varying


def varying_over(x: Any, axes: Any) -> jax.Array:
  """``x`` typed as varying over ``axes`` (as it is outside ``shard_map``)."""
  missing = tuple(sorted(set(axes) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else jnp.asarray(x)


def unreduced_axes(x: Any) -> frozenset[str]:
  """The mesh axes over which ``x`` holds partial sums (JAX's ``unreduced``)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  return frozenset(getattr(spec, "unreduced", ()))


def check_replicas(axis_name: AxisName | None, weight: Any) -> None:
  """Refuses ``MultiSteps.update``'s ``weight`` that may vary per replica under
  manual axes that no ``axis_name`` names (under ``pmap``: any ``weight``);
  ``axis_name=()`` opts out."""
  if axis_name is not None or weight is None:
    return
  manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
  if manual and (not varying_axes(jax.lax.axis_index(manual)) or _own_axes(weight)):
    weight_differs = "with a `weight` that can differ per replica, "
    raise _unnamed(manual, "MultiSteps.update", weight_differs)


def check_named_axes(axis_name: AxisName | None, reduced: Any, where: str) -> None:
  """Refuses manual mesh axes (``shard_map``, ``pmap``) that neither
  ``axis_name`` nor the step's own reduction names, whatever the weight: the
  gradients of replicated params come back summed over them, or each replica
  keeps its own window. ``axis_name=()`` opts out."""
  manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
  if manual and axis_name is None and not reduced:
    raise _unnamed(manual, where, "")


def _unnamed(manual: tuple[str, ...], where: str, weight: str) -> ValueError:
  named = manual[0] if len(manual) == 1 else manual
  return ValueError(
    f"{where} runs under the manual mesh axes {manual} (pmap or shard_map) "
    f"{weight}without `axis_name`: each replica would divide by its own window weight "
    f"and the replicated params would drift apart. Pass axis_name={named!r} (to "
    "MultiSteps or make_train_step) and drop your own pmean/psum of the gradients (the "
    "accumulator sums the weighted gradients over the axis once), or axis_name=() if "
    "the replicas are independent on purpose."
  )


def _any_over(flag: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  flag = jnp.asarray(flag)
  return jax.lax.psum(flag.astype(jnp.int32), axes) > 0 if axes else flag


def _own_axes(window: Any) -> frozenset[str]:
  """The mesh axes of independent windows: those ``window``'s weights vary over."""
  return frozenset().union(*[varying_axes(v) for v in jax.tree.leaves(window)])


@dataclasses.dataclass(frozen=True)
class Reduction:
  """The base of every reduction policy: its defaults are the behaviour without
  data-parallel axes (:class:`Local`)."""

  axes: tuple[str, ...] = ()
  at_window_end: bool = False

  def sum(self, x: Any) -> jax.Array:
    """``x`` summed over the replicas: ``x`` itself."""
    return jnp.asarray(x)

  def own(self, x: Any) -> jax.Array:
    """``x`` as this replica's own value (no-op without replicas)."""
    return jnp.asarray(x)

  def any(self, flag: jax.Array, window: Any = ()) -> jax.Array:
    """Whether ``flag`` holds on any shard of the same window, on all of them:
    combined over the axes it varies over and ``window``'s weights do not."""
    return _any_over(flag, tuple(sorted(varying_axes(flag) - _own_axes(window))))

  def over_shards(self, x: jax.Array, window: Any = ()) -> jax.Array:
    """``x`` summed over the model-parallel shards of one window (see :meth:`any`)."""
    axes = tuple(sorted(varying_axes(x) - _own_axes(window) - set(self.axes)))
    return jax.lax.psum(x, axes) if axes else x

  def summed_already(self, x: Any) -> tuple[str, ...]:
    """The replica axes over which JAX already summed ``x``: none here."""
    return ()

  def gradient(self, x: jax.Array) -> jax.Array:
    """A weighted gradient as it is stored in the accumulator."""
    return x

  def window_gradient(self, acc: Any) -> Any:
    """The accumulator as the window's summed gradient."""
    return acc

  def agree(self, tree: Any) -> Any:
    """``tree`` the same on every replica (no-op without replicas)."""
    return tree

  def cast_params(self, params: Any) -> Any:
    """``params`` typed so that their gradients come out as this policy adds them."""
    return params

  def per_window(self) -> Reduction:
    """This policy, keeping partial sums until the window ends (a scan's)."""
    return self


class Local(Reduction):
  """No data-parallel axes: weights, losses and gradients are already global."""


class Replicas(Reduction):
  """Per-replica values summed over mesh axes ``axes`` (a tuple); with
  ``at_window_end`` gradients stay per-replica partial sums until
  :meth:`window_gradient`."""

  @property
  def typed(self) -> bool:
    """Whether JAX types values as varying per replica (``check_vma=True``)."""
    try:
      probe = jax.lax.axis_index(self.axes[0])
    except NameError as e:
      named = self.axes[0] if len(self.axes) == 1 else self.axes
      raise ValueError(
        f"`axis_name` {named!r} is not a mesh axis here: call inside "
        "shard_map or pmap over it, or drop `axis_name` under plain jit, where "
        "sharded gradients are already global."
      ) from e
    return self.axes[0] in varying_axes(probe)

  def sum(self, x: Any) -> jax.Array:
    """``x`` summed over the replicas, counting once what JAX summed already."""
    return jax.lax.psum(self._own_once(x), self.axes)

  def _own_once(self, x: Any) -> jax.Array:
    """This replica's share of ``x``: what JAX summed already on the first only."""
    if summed := self.summed_already(x):
      x = _on_first(x, summed)
    return self.own(jnp.asarray(x))

  def own(self, x: Any) -> jax.Array:
    # A value the same on every replica (a constant weight) is still each
    # replica's own: it sums over them, as under pmap or check_vma=False.
    return varying_over(x, self.axes) if self.typed else jnp.asarray(x)

  def any(self, flag: jax.Array, window: Any = ()) -> jax.Array:
    return _any_over(super().any(flag, window), self.axes)

  def summed_already(self, x: Any) -> tuple[str, ...]:
    return tuple(a for a in self.axes if a not in varying_axes(x)) if self.typed else ()

  def gradient(self, x: jax.Array) -> jax.Array:
    return self._own_once(x) if self.at_window_end else self.sum(x)

  def window_gradient(self, acc: Any) -> Any:
    psum = functools.partial(jax.lax.psum, axis_name=self.axes)
    return jax.tree.map(psum, acc) if self.at_window_end else acc

  def per_window(self) -> Reduction:
    return Replicas(self.axes, at_window_end=True)

  def cast_params(self, params: Any) -> Any:
    """``params`` typed as varying per replica, so that JAX does not sum their
    gradients before the per-replica weights apply."""
    if not self.typed:
      return params
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
      if sharded := set(varying_axes(p)) & set(self.axes):
        raise ValueError(
          f"params{jax.tree_util.keystr(path)} differs per replica over mesh axis "
          f"{sorted(sharded)[0]!r}, the data axis `axis_name` sums over: params "
          "sharded over the data axis (FSDP, ZeRO) would have their gradients summed "
          "twice. Pass params replicated over it (in_specs P() or P over a model axis "
          "only), or shard them over the data axis under plain jit without axis_name, "
          "where XLA reduce-scatters each micro-batch's gradient."
        )
    return jax.tree.map(self.own, params)

  def agree(self, tree: Any) -> Any:
    """Each leaf's maximum over the replicas (for a bool: any)."""

    def combine(x: Any) -> jax.Array:
      x = jnp.asarray(x)
      axes = tuple(a for a in self.axes if a in varying_axes(x) or not self.typed)
      if axes and x.dtype == jnp.bool_:
        return jax.lax.pmax(x.astype(jnp.int32), axes) > 0
      return jax.lax.pmax(x, axes) if axes else x

    return jax.tree.map(combine, tree)


@dataclasses.dataclass(frozen=True)
class Deferred(Reduction):
  """Plain ``jit`` on an ``Explicit`` mesh, the batch split over data axes ``over``.
  Gradients of the params ``leaves`` marks stay ``unreduced`` partial sums until
  :meth:`window_gradient`; the others' join them on the first replica."""

  mesh: Any = None
  over: tuple[str, ...] = ()
  leaves: tuple[bool, ...] = ()
  at_window_end: bool = True

  def cast_params(self, params: Any) -> Any:
    flat, treedef = jax.tree.flatten(params)
    if len(flat) != len(self.leaves):
      raise ValueError(
        f"params have {len(flat)} leaves; this step's programs were built for "
        f"{len(self.leaves)}."
      )
    pairs = zip(flat, self.leaves, strict=True)
    cast = [self._resharded(p, reduced=set(self.over)) if d else p for p, d in pairs]
    return jax.tree.unflatten(treedef, cast)

  def _resharded(self, x: jax.Array, **extra: Any) -> jax.Array:
    """``x`` resharded to its own partitions on the mesh, with ``extra``
    (``reduced=``) and nothing ``unreduced``."""
    parts = getattr(jax.typeof(x).sharding, "spec", P()).partitions
    return jax.reshard(x, jax.sharding.NamedSharding(self.mesh, P(*parts, **extra)))

  def gradient(self, x: jax.Array) -> jax.Array:
    """``x`` as partial sums: as it is if ``unreduced``, else on the first
    replica only (zeros elsewhere), which moves nothing."""
    if unreduced_axes(x):
      return x
    parts = jax.typeof(x).sharding.spec.partitions
    out = P(*parts, unreduced=set(self.over))
    first = functools.partial(_on_first, axes=self.over)
    return jax.shard_map(
      first, mesh=self.mesh, in_specs=P(*parts), out_specs=out, check_vma=False
    )(x)

  def window_gradient(self, acc: Any) -> Any:
    """Each partial sum reduced: the window's one gradient reduction."""
    return jax.tree.map(lambda a: self._resharded(a) if unreduced_axes(a) else a, acc)


def replica_index(axis_name: AxisName) -> jax.Array:
  """This replica's row-major position over the mesh axes ``axis_name``."""
  index = jnp.zeros([], jnp.int32)
  for axis in _checks.axes(axis_name):
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return index


def _on_first(x: Any, axes: AxisName) -> jax.Array:
  """``x`` on the first replica over ``axes``, zeros on the others."""
  return jnp.where(replica_index(axes) == 0, x, jnp.zeros_like(x))


def policy(axis_name: AxisName | None, at_window_end: bool = False) -> Reduction:
  """The reduction for ``axis_name``: :class:`Replicas` over it, or :class:`Local`.

  Examples:
    >>> policy(None)
    Local(axes=(), at_window_end=False)
    >>> policy("data", at_window_end=True)
    Replicas(axes=('data',), at_window_end=True)
  """
  axes = _checks.axes(axis_name)
  return Replicas(axes, at_window_end) if axes else Local()
