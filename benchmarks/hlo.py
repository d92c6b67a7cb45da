"""The ops of a compiled program, read from its HLO text: which kind, how
many bytes, and whether a while loop runs them (its collectives, say)."""

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
    [Op(kind='all-reduce', bytes=32, in_loop=False)]
  """
  return ops(hlo_text, KINDS)


def ops(hlo_text: str, kinds: tuple[str, ...]) -> list[Op]:
  """The ops of the given ``kinds`` in a compiled program's ``as_text()``,
  fused ones included (see :func:`collectives`)."""
  op = re.compile(r"=\s*(?P<type>.*?)\s(?P<kind>" + "|".join(kinds) + r")(?:-start)?\(")
  bodies = _computations(hlo_text)
  in_loop = _in_loops(bodies)
  found = []
  for name, lines in bodies.items():
    for line in lines:
      match = op.search(line)
      if match:
        kind, size = match.group("kind"), _bytes(match.group("type"))
        found.append(Op(kind, size, name in in_loop))
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


def _in_loops(bodies: dict[str, list[str]]) -> set[str]:
  """The computations a while loop's body or condition calls, at any depth."""

  def called(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
      names.update(_CALLED.findall(line))
      for group in _BRANCHES.findall(line):
        names.update(n.strip().lstrip("%") for n in group.split(","))
    return names

  in_loop: set[str] = set()
  frontier = []
  for lines in bodies.values():
    for line in lines:
      if " while(" in line:
        frontier.extend(_CALLED.findall(line))
  while frontier:
    name = frontier.pop()
    if name in in_loop or name not in bodies:
      continue
    in_loop.add(name)
    frontier.extend(called(bodies[name]))
  return in_loop
