"""The accumulator's layout: one protocol, a class per layout (a file each).

A :class:`Layout` says how ``opt_state.acc_grads`` holds the window's sums
between calls (its stored node, whose pytree structure names the layout,
never a shape) and how a train step's programs see them. Its class answers
for the stored node (``holds``, ``to_sum``, ``from_sum``, ``restore_target``);
an instance (a mesh, axes) builds programs. The base class is the one sum:
sums laid out as the params, no ``shard_map``. Every other layout registers
itself (:func:`register`); :func:`layout_of` finds a node's. Nothing outside this
layer asks a layout's type.

Examples:
  >>> import jax.numpy as jnp
  >>> layout_of({"w": jnp.ones(3)}) is Layout
  True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

from optax_accum._core import _checks, _placement
from optax_accum._core._state import MultiStepsState
from optax_accum._core._window import Names

#: A program body: ``Inputs`` to ``Outputs`` (``_step._programs``).
Body = Callable[[Any], Any]


class Sharded(NamedTuple):
  """A program's ``shard_map``: its mesh and axes, and the specs of what is
  split over them (the accumulator, the rows of a batch, ``aux``)."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]
  acc: Any
  rows: Any
  aux: Any


class Layout:
  """An accumulator layout; the defaults are the one sum's."""

  converts: ClassVar[bool] = False  # Programs take it converted (inside/outside).

  # -- the stored node --------------------------------------------------------

  @classmethod
  def holds(cls, acc: Any) -> bool:
    """Whether ``acc`` is stored in this layout (the one sum: no other's)."""
    return not any(kind.holds(acc) for kind in _KINDS)

  @classmethod
  def to_sum(cls, acc: Any) -> Any:
    """``acc`` as one sum laid out as the params (exact but for partial sums' add)."""
    return acc

  @classmethod
  def sum_shapes(cls, acc: Any) -> Any:
    """Shapes and dtypes of ``acc`` as one sum."""
    return jax.tree.map(_shape, acc)

  @classmethod
  def from_sum(cls, total: Any, target: Any) -> Any:
    """One sum ``total`` in the layout of ``target``, placed like it."""
    return jax.tree.map(_placement.placed_like, total, target)

  @classmethod
  def convert(cls, acc: Any, target: Any) -> Any:
    """``acc`` (any layout) in ``target``'s (this one), placed like it."""
    return cls.from_sum(to_sum(acc), target)

  @classmethod
  def saved_in(cls, saved: Any) -> bool:
    """Whether a checkpoint's ``acc_grads`` (a node or orbax's metadata, a dict)
    was saved in this layout."""
    return not any(kind.saved_in(saved) for kind in _KINDS)

  @classmethod
  def restore_target(cls, shapes: Any, saved: Any, given: Any) -> Any:
    """Host zeros in ``saved``'s layout and shapes, for sums of ``shapes`` (one
    sum); ``given`` is the accumulator of the state resumed from."""
    del saved, given
    return jax.tree.map(zeros, shapes)

  @classmethod
  def carried(cls, total: Any, given: Any) -> Any:
    """A traced call's one sum ``total`` in ``given``'s layout where a carry
    must keep its type (the user's ``lax.scan``); else ``total``."""
    del given
    return total

  @classmethod
  def kept(cls, acc: Any) -> Layout | None:
    """The layout a call runs in for a state stored in this one, on any devices
    (one sum stays one sum; a packed node becomes one); ``None``: the step
    chooses for the call's devices (per-replica partial sums)."""
    del acc
    return ONE_SUM

  # -- in a train step's programs -----------------------------------------------

  def lay_out(
    self, state: MultiStepsState, params: Any = None, terms: Names = None
  ) -> MultiStepsState:
    """``state``'s accumulator (any layout) in this one."""
    del params, terms
    return state._replace(acc_grads=to_sum(state.acc_grads))

  def policy(self) -> Any:
    """The reduction policy of this layout's bodies, or ``None`` (the step's)."""
    return None

  def body(self, body: Body, window: bool) -> Body:
    """``body`` on the accumulator as the program takes it (``window``: the
    body takes a whole window, its ``aux`` stacked along the first axis)."""
    del window
    return body

  def sharded(self, window: bool) -> Sharded | None:
    """The ``shard_map`` a program runs in, or ``None``."""
    del window
    return None

  def inside(self, acc: Any) -> Any:
    """The stored accumulator as the program takes it."""
    return acc

  def outside(self, acc: Any) -> Any:
    """The program's accumulator as stored."""
    return acc


#: The one sum: sums laid out as the params, the step's own reduction.
ONE_SUM = Layout()

_KINDS: list[type[Layout]] = []


def register(kind: type[Layout]) -> type[Layout]:
  """Makes ``kind``'s stored node known to :func:`layout_of` and :func:`resume_target`
  (a class decorator: a new layout is one file)."""
  if kind not in _KINDS:
    _KINDS.append(kind)
  return kind


def layout_of(acc: Any) -> type[Layout]:
  """The layout that stores ``acc``: a registered one's, else the one sum."""
  return next((kind for kind in _KINDS if kind.holds(acc)), Layout)


def to_sum(acc: Any) -> Any:
  """``acc`` in any layout as one sum (exact but for the partial sums' add)."""
  return layout_of(acc).to_sum(acc)


def sum_shapes(acc: Any) -> Any:
  """Shapes of ``acc`` (any layout) as one sum."""
  return layout_of(acc).sum_shapes(acc)


def convert(acc: Any, target: Any) -> Any:
  """``acc`` (any layout) in ``target``'s layout (``None``: one sum), placed like it."""
  if target is None:
    return to_sum(acc)
  return layout_of(target).convert(acc, target)


def carried(state: MultiStepsState, given: Any) -> MultiStepsState:
  """A traced call's ``state`` with its sums in ``given``'s layout where a carry
  must keep its type (:meth:`Layout.carried`)."""
  acc = state.acc_grads
  if layout_of(acc) is layout_of(given):
    return state
  return state._replace(acc_grads=layout_of(given).carried(acc, given))


def relayout(state: MultiStepsState, like: MultiStepsState) -> MultiStepsState:
  """``state`` with its accumulator in the layout of ``like``'s.

  ``like`` is a state of the same params from ``opt.init(params)`` or, for a
  train step on a mesh, ``step.init(params)``. A sum becoming the first
  replica's partial sum is exact, and so is unpacking a checkpoint's packed
  sums (:class:`~optax_accum.Packed`, written before packing was removed);
  partial sums for another layout are added up first (a rounding per add).
  Arrays take the placement of ``like``'s.

  Raises:
    ValueError: if the two accumulators are not of the same params.

  Examples:
    A checkpoint's packed sums (20 leaves in one buffer), restored against
    :func:`~optax_accum.resume_target`'s target, as one sum:

    >>> import numpy as np, optax, optax_accum
    >>> params = {f"b{i:02d}": np.zeros(2, np.float32) for i in range(20)}
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> saved = {"acc_grads": {"groups": [np.arange(40, dtype=np.float32)], "rest": ()}}
    >>> restored = optax_accum.resume_target(opt.init(params), saved)
    >>> type(restored.acc_grads).__name__
    'Packed'
    >>> restored = restored._replace(acc_grads=optax_accum.Packed(
    ...   (np.arange(40, dtype=np.float32),), (), restored.acc_grads.packing))
    >>> one = optax_accum.relayout(restored, opt.init(params))
    >>> type(one.acc_grads).__name__, one.acc_grads["b03"].tolist()
    ('dict', [6.0, 7.0])
  """
  acc = state.acc_grads
  target = None if like is None else like.acc_grads
  if _same_layout(acc, target):
    return state
  # Outside a trace, no context mesh (under the user's jax.set_mesh, arrays
  # committed to other devices cannot meet): their own shardings place the work.
  traced = _placement.traced(state, like)
  with contextlib.nullcontext() if traced else jax.set_mesh(None):
    total = sum_shapes(acc)
    _checks.check_tree_matches(
      total,
      sum_shapes(target) if target is not None else total,
      name="state's accumulator",
      ref_name="`like`'s (relayout converts states of the same params; start a "
      "state for other params from opt.init(params))",
    )
    return state._replace(acc_grads=convert(acc, target))


def _same_layout(acc: Any, target: Any) -> bool:
  """Whether ``acc`` is in ``target``'s layout, shapes included."""
  structure = jax.tree.structure(acc)
  if structure != jax.tree.structure(target):  # type: ignore[operator]  # jaxlib stub gap
    return False
  shapes = [np.shape(x) for x in jax.tree.leaves(acc)]
  return shapes == [np.shape(x) for x in jax.tree.leaves(target)]


def resume_target(state: MultiStepsState, saved: Any) -> MultiStepsState:
  """``state`` as the target to restore a checkpoint of ``saved``'s layout.

  A checkpoint's layout (per-replica sums of shape ``(8, ...)`` for 8
  replicas) may fit no target from ``step.init(params)`` on the devices you
  resume on: this builds one.

  Args:
    state: The state you would start from where you resume (``step.init(params)``
      or ``opt.init(params)`` on the devices you resume on).
    saved: The saved optimizer state, or its checkpoint metadata: orbax's
      ``ckpt.metadata(path).item_metadata["opt_state"]`` (anything with the
      saved ``acc_grads``' fields and shapes).

  Returns:
    ``state`` with its accumulator in the saved layout, as host arrays of the
    saved shapes (zeros, for the restore to fill), and the saved ``held``
    micro-batches of a streamed coupled window likewise; every other field
    as it is. Pass what the restore returns to the step: it lays the sums out for
    its devices (for your own ``jit``, first
    ``optax_accum.relayout(restored, step.init(params))``).

  Raises:
    ValueError: if ``saved`` holds packed sums (:class:`~optax_accum.Packed`,
      written before packing was removed) that are not of these params.

  Examples:
    A state saved with 8 replicas' partial sums, resumed on one device:

    >>> import numpy as np, optax, optax_accum
    >>> opt = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
    >>> here = opt.init({"w": np.zeros(3, np.float32)})
    >>> saved = {"acc_grads": {"sums": {"w": np.zeros((8, 3), np.float32)}}}
    >>> resume_target(here, saved).acc_grads.sums["w"].shape
    (8, 3)
  """
  held = field(saved, "held", None)
  if held is not None:  # A streamed coupled window's micro-batches.
    held = tuple(jax.tree.map(zeros, list(held), is_leaf=is_array))
    state = state._replace(held=held)
  acc = field(saved, "acc_grads")
  shapes = jax.tree.map(_shape, sum_shapes(state.acc_grads))
  if _paths(acc) == _paths(shapes):  # The params' own tree: one sum, whatever its keys.
    kind: type[Layout] = Layout
  else:
    kind = next((kind for kind in _KINDS if kind.saved_in(acc)), Layout)
  return state._replace(acc_grads=kind.restore_target(shapes, acc, state.acc_grads))


def _paths(tree: Any) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
  """``tree``'s leaves as key names and shapes, sorted: the same for a node and
  orbax's metadata of it (a dict for a ``NamedTuple`` or a dataclass)."""

  def name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)

  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_array)[0]
  return sorted((tuple(map(name, path)), np.shape(x)) for path, x in flat)


def saved_as(
  saved: Any, node: type, fields: set[str], optional: frozenset[str] = frozenset()
) -> bool:
  """Whether a checkpoint's ``acc_grads`` is a ``node``: the node itself, or
  orbax's metadata of one (a dict of its data ``fields``, and of ``optional``
  ones, nothing else: a one sum whose params have a key of that name is not
  taken for it)."""
  if isinstance(saved, Mapping):
    return fields <= set(saved) <= fields | optional
  return isinstance(saved, node)


def field(tree: Any, name: str, *default: Any) -> Any:
  """A field of a state, a layout node or a checkpoint's metadata (a dict)."""
  if isinstance(tree, Mapping):
    return tree[name] if name in tree or not default else default[0]
  return getattr(tree, name, *default)


def is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def leaves(tree: Any) -> list[Any]:
  """``tree``'s arrays (or metadata with a shape and a dtype)."""
  return jax.tree.leaves(tree, is_leaf=is_array)


def zeros(shape: Any) -> np.ndarray:
  """Host zeros of ``shape``'s shape and dtype."""
  return np.zeros(np.shape(shape), shape.dtype)


def renamed(wrapper: Body, body: Body) -> Body:
  """``wrapper`` named as ``body``, whose program it builds (what jit logs)."""
  wrapper.__name__ = wrapper.__qualname__ = getattr(body, "__name__", "program")
  return wrapper


def _shape(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
