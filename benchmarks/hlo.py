"""The ops of a compiled program, read from its HLO text: which kind, how
many bytes, and whether a while loop or a conditional's branch runs them (its
collectives, say)."""

from __future__ import annotations

import re
from typing import NamedTuple

#: The collectives that move data between devices, as HLO names them.
KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}
_BYTES |= {"c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
  r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


class Op(NamedTuple):
  """One op of a program: what it is, how many bytes, and where."""

  kind: str  # "all-reduce", "reduce", ...
  bytes: int  # Of its result, all operands of a combined one together.
  in_loop: bool  # Inside a while loop's body or condition (runs per iteration).
  in_branch: bool = False  # Inside a conditional's branch (runs where it is taken).


def _bytes(types: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(types):
    size = _BYTES.get(dtype, 4)
    for dim in filter(None, dims.split(",")):
      size *= int(dim)
    total += size
  return total


def collectives(hlo_text: str) -> list[Op]:
  """The collectives in a compiled program's ``as_text()``.

  Examples:
    >>> text = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %r = f32[8]{0} all-reduce(%p), to_apply=%add
    ... }'''
    >>> collectives(text)
    [Op(kind='all-reduce', bytes=32, in_loop=False, in_branch=False)]
  """
  return ops(hlo_text, KINDS)


def ops(hlo_text: str, kinds: tuple[str, ...]) -> list[Op]:
  """The ops of the given ``kinds`` in a compiled program's ``as_text()``,
  fused ones included (see :func:`collectives`)."""
  op = re.compile(r"=\s*(?P<type>.*?)\s(?P<kind>" + "|".join(kinds) + r")(?:-start)?\(")
  bodies = _computations(hlo_text)
  in_loop, in_branch = _under(bodies, " while("), _under(bodies, " conditional(")
  found = []
  for name, lines in bodies.items():
    for line in lines:
      match = op.search(line)
      if match:
        kind, size = match.group("kind"), _bytes(match.group("type"))
        found.append(Op(kind, size, name in in_loop, name in in_branch))
  return found


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Each computation's instruction lines, by name."""
  bodies: dict[str, list[str]] = {}
  current: list[str] | None = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = bodies.setdefault(header.group(1), [])
    elif current is not None and line.strip() and line.strip() != "}":
      current.append(line)
  return bodies


def _under(bodies: dict[str, list[str]], op: str) -> set[str]:
  """The computations that an ``op`` (``" while("``, ``" conditional("``)
  calls, at any depth."""

  def called(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
      names.update(_CALLED.findall(line))
      for group in _BRANCHES.findall(line):
        names.update(n.strip().lstrip("%") for n in group.split(","))
    return names

  under: set[str] = set()
  frontier = []
  for lines in bodies.values():
    for line in lines:
      if op in line:
        frontier.extend(called([line]))
  while frontier:
    name = frontier.pop()
    if name in under or name not in bodies:
      continue
    under.add(name)
    frontier.extend(called(bodies[name]))
  return under


# --- control flow in a lowered (StableHLO) program ---------------------------

_CASE = re.compile(r'%([\w#:]+) = "stablehlo\.case"\(%([\w#]+)\)')
_WHILE = re.compile(r"stablehlo\.while\(")
_DEF = r"%{name}(?::\d+)? = (.*)$"
_CONSTANT = re.compile(r"%([\w#]+) = stablehlo\.constant")
_COMPARE = re.compile(
  r"stablehlo\.compare\s+\w+, %(iterArg\w*), %([\w#]+), (?:SIGNED|UNSIGNED)"
)


def data_dependent_control_flow(stablehlo_text: str) -> list[str]:
  """The ``case`` and ``while`` ops of a lowered program (``Lowered.as_text()``)
  whose branch or trip count depends on the data: what XLA:GPU decides on the
  host, copying the predicate there and waiting for the device.

  A ``case`` on a constant (``lax.platform_dependent`` lowered for one
  platform) and a ``while`` whose condition compares with a constant (a
  ``lax.scan``, a static ``fori_loop``) are not counted. Each entry is the
  op's line.
  """
  lines = stablehlo_text.splitlines()
  found = []
  for i, line in enumerate(lines):
    case = _CASE.search(line)
    branches = case is not None and not _constant(lines[:i], case.group(2))
    loops = _WHILE.search(line) is not None and not _counted(lines[i + 1 :])
    if branches or loops:
      found.append(line.strip())
  return found


def _constant(before: list[str], name: str) -> bool:
  """Whether ``%name``, defined last in ``before``, is a constant, or a
  ``case`` on a constant whose branches return constants."""
  pattern = re.compile(_DEF.format(name=re.escape(name)))
  for j in range(len(before) - 1, -1, -1):
    found = pattern.search(before[j].strip())
    if found is None:
      continue
    if found.group(1).startswith("stablehlo.constant"):
      return True
    case = _CASE.search(before[j])
    return case is not None and _constant(before[:j], case.group(2))
  return False


def _counted(after: list[str]) -> bool:
  """Whether the ``while`` whose lines follow counts its trips: its condition
  compares a loop-carried integer with a constant (a ``lax.scan``, a static
  ``fori_loop``), not a value computed from the data."""
  cond = []
  for line in after:
    if line.strip().startswith("} do {"):
      break
    cond.append(line)
  constants = {m.group(1) for m in map(_CONSTANT.search, cond) if m}
  for line in cond:
    compare = _COMPARE.search(line)
    if compare and compare.group(2) in constants:
      return True
  return False
