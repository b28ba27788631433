"""The layout's rules, as tests: imports follow the data flow, no cycles, no private names.

harpjax is one package per phase (``docs/layout.md``). Every module of ``harpjax/`` is parsed
(not imported) and each of its imports, at module level or inside a function, is checked:

* **direction**: a phase imports only from the phases before it in the data flow (the table
  :data:`RANKS`), so planning runs without devices or Ray and the compiler never reaches into
  the runtime;
* **surface**: across phases, a module imports only what the other phase's ``__init__.py``
  exports (its ``__all__``), never one of its modules directly;
* **privacy**: no module imports another module's ``_name``;
* **no cycles**, function-level imports included;
* **Ray** is imported only in ``harpjax/runtime/``.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "harpjax"

RANKS = {
    "harpjax.errors": 0, "harpjax._compat": 0, "harpjax._version": 0,
    "harpjax.cluster": 1,
    "harpjax.compiler": 2, "harpjax.compiler.trace": 2,
    "harpjax.compiler.layers": 3,
    "harpjax.compiler.profile": 4,
    "harpjax.compiler.schedule": 5,
    "harpjax.compiler.plan": 6,
    "harpjax.compiler.stages": 7,
    "harpjax.runtime": 8,
    "harpjax.options": 9, "harpjax.phases": 9, "harpjax.api": 9,
    "harpjax": 10,
    "harpjax.models": 11,
    "harpjax.examples": 12, "harpjax.cli": 12, "harpjax.__main__": 12,
}
"""Each unit of the data flow (a phase's package, or a top-level module) and its position: a
unit imports only from units of the same or a lower rank."""


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def unit_of(module: str) -> str:
  """The longest unit of :data:`RANKS` that ``module`` belongs to."""
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in RANKS:
      return ".".join(parts[:n])
  raise AssertionError(f"{module} belongs to no unit of RANKS; add it to tests/test_layout.py")


def _exports(module: str) -> set[str]:
  tree = ast.parse(MODULES[module].read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                            for t in node.targets):
      return set(ast.literal_eval(node.value))
  return set()


Import = collections.namedtuple("Import", "importer line target names")


def _imports() -> list[Import]:
  """Every harpjax (and ray) import: ``target`` is the imported module, ``names`` the names
  taken from it (empty for ``import x``); ``from pkg import submodule`` targets the submodule."""
  out = []
  for mod, path in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        for a in node.names:
          out.append(Import(mod, node.lineno, a.name, ()))
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        plain = []
        for a in node.names:
          sub = f"{node.module}.{a.name}"
          if sub in MODULES:
            out.append(Import(mod, node.lineno, sub, ("<module>",)))
          else:
            plain.append(a.name)
        if plain:
          out.append(Import(mod, node.lineno, node.module, tuple(plain)))
  return out


IMPORTS = _imports()
INTERNAL = [i for i in IMPORTS if i.target.split(".")[0] == "harpjax"]


def _where(i: Import) -> str:
  return f"{MODULES[i.importer].relative_to(ROOT.parent)}:{i.line}"


def test_every_module_belongs_to_a_unit():
  for mod in MODULES:
    unit_of(mod)


def test_imports_follow_the_data_flow():
  bad = [f"{_where(i)}: {unit_of(i.importer)} (rank {RANKS[unit_of(i.importer)]}) imports "
         f"{i.target} (rank {RANKS[unit_of(i.target)]})"
         for i in INTERNAL if RANKS[unit_of(i.target)] > RANKS[unit_of(i.importer)]]
  assert not bad, "\n".join(bad)


def test_other_phases_are_reached_through_their_public_surface():
  bad = []
  for i in INTERNAL:
    src, dst = unit_of(i.importer), unit_of(i.target)
    if src == dst or i.target in ("harpjax._compat", "harpjax._version", "harpjax.errors"):
      continue
    parent, _, leaf = i.target.rpartition(".")
    if i.names == ("<module>",) and (i.target == dst or (parent == dst and
                                                          leaf in _exports(dst))):
      continue   # the package, or a submodule it exports (``from ...trace import primitives``)
    if i.target != dst:
      bad.append(f"{_where(i)}: imports {i.target}, a module inside {dst}; import from {dst}")
      continue
    missing = [n for n in i.names if n not in _exports(dst)]
    if missing:
      bad.append(f"{_where(i)}: {missing} are not in {dst}.__all__")
  assert not bad, "\n".join(bad)


def test_no_private_names_are_imported():
  bad = [f"{_where(i)}: imports {n} from {i.target}" for i in INTERNAL for n in i.names
         if n.startswith("_") and not n.startswith("__") and n != "<module>"]
  bad += [f"{_where(i)}: imports the private module {i.target}" for i in INTERNAL
          if i.target.rpartition(".")[2].startswith("_") and not i.target.startswith("harpjax.__")
          and i.target not in ("harpjax._compat", "harpjax._version")]
  assert not bad, "\n".join(bad)


def test_no_import_cycles():
  graph = collections.defaultdict(set)
  for i in INTERNAL:
    if i.target in MODULES and i.target != i.importer:
      graph[i.importer].add(i.target)
  # A package's __init__ imports its modules; a module importing its own package's __init__
  # is a cycle (import siblings by their module path instead).
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        cycles.append(stack[stack.index(n):] + [n])
      elif n not in state:
        visit(n)
    stack.pop()
    state[m] = 2

  for m in sorted(MODULES):
    if m not in state:
      visit(m)
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_runtime_imports_ray():
  bad = [_where(i) for i in IMPORTS if i.target.split(".")[0] == "ray"
         and unit_of(i.importer) != "harpjax.runtime"]
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("unit", sorted(u for u in RANKS if u in MODULES and
                                        MODULES[u].name == "__init__.py"))
def test_each_package_states_its_surface(unit):
  assert _exports(unit) or unit in ("harpjax.compiler", "harpjax.examples"), \
      f"{unit}/__init__.py has no __all__"


def _named_in_layout_doc() -> set[str]:
  """The module paths the tree of ``docs/layout.md`` names: every ``name.py`` on a line of the
  tree, in the folder its line's indentation puts it (a line that starts with one ``name/``
  opens that folder at that indentation; the names on it are inside)."""
  text = (ROOT.parent / "docs" / "layout.md").read_text()
  tree = text.split("```\nharpjax/\n", 1)[1].split("```", 1)[0]
  named, folders = set(), [(-1, "harpjax")]   # (indentation, folder)
  for line in tree.splitlines():
    if not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    first = line.split()[0]
    if first.endswith("/") or first.endswith(".py"):
      while folders[-1][0] >= indent:
        folders.pop()
      if indent == 0:   # a top-level folder beside harpjax/ (tools/)
        folders = [(-1, "")]
    words = line.split()
    if first.endswith("/") and sum(w.endswith("/") for w in words) == 1:
      folders.append((indent, "/".join(p for p in (folders[-1][1], first.rstrip("/")) if p)))
    here = folders[-1][1]
    for w in words:
      w = w.strip("(),;:`")
      if w.endswith(".py") and "/" not in w:
        named.add(f"{here}/{w}" if here else w)
  return named


def test_layout_doc_names_every_module():
  named = _named_in_layout_doc()
  missing = sorted(str(p.relative_to(ROOT.parent)) for p in MODULES.values()
                   if p.name != "__init__.py" and str(p.relative_to(ROOT.parent)) not in named)
  assert not missing, ("docs/layout.md does not name these modules; add each to its folder "
                       "in the tree, with what it holds: " + ", ".join(missing))
