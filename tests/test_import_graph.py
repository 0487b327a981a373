"""The house rules of imports, read from the source with ``ast`` (no module is imported here).

* The serving core (``relay_engine.core``) imports the stdlib, numpy, torch (and the optional
  ``torch_npu``) and itself; never the lab.
* ``workers``, ``controlplane`` and ``frontend`` never import the lab; ``controlplane`` and
  ``workers`` never import each other; ``frontend`` reaches the domain through ``controlplane``.
* The lab uses only the core's public names (no ``_private`` ones).
* Nothing outside the serving core imports a cache tier module: the engine's tier stack
  (``relay_engine.core.tiers``) is the one way in.
* No import cycles anywhere in the project.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from relay_engine.core.outcomes import LOWER_TIER_MODULES, Outcome

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("relay_engine", "workers", "controlplane", "frontend")
CORE_THIRD_PARTY = {"numpy", "torch", "torch_npu"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            # ``from pkg import sub`` imports the submodule pkg.sub when there is one
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            out.append((module, names, node.lineno))
            out += [(sub, [], node.lineno) for sub in subs]
    return out


def _project_target(module: str) -> str | None:
    """The project module an import resolves to (the longest known prefix), or None if external."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _violations(rule) -> list[str]:
    bad = []
    for name, path in sorted(MODULES.items()):
        for module, names, line in _imports(name, path):
            message = rule(name, module, names)
            if message:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {message}")
    return bad


def test_the_graph_covers_both_rooms():
    assert any(m.startswith("relay_engine.core.") for m in MODULES)
    assert any(m.startswith("relay_engine.lab.") for m in MODULES)


def test_the_core_imports_only_the_stdlib_numpy_torch_and_itself():
    def rule(name, module, names):
        if not name.startswith("relay_engine.core"):
            return None
        top = module.split(".")[0]
        if module.startswith("relay_engine."):
            return None if module.startswith("relay_engine.core") else f"core imports {module}"
        if top in sys.stdlib_module_names or top in CORE_THIRD_PARTY or top == "__future__":
            return None
        return f"core imports {module} (allowed: stdlib, numpy, torch)"

    assert _violations(rule) == []


def test_nothing_but_the_commands_imports_the_lab():
    commands = {f"relay_engine.{c}" for c in ("bench", "editing", "profile", "traffic", "sim", "import_gr",
                                                         "calibrate")}

    def rule(name, module, names):
        if module.startswith("relay_engine.lab") and not name.startswith("relay_engine.lab") and name not in commands:
            return f"{name} imports the lab ({module})"
        return None

    assert _violations(rule) == []


def test_the_control_plane_and_the_workers_meet_only_in_redis():
    def rule(name, module, names):
        side = name.split(".")[0]
        other = {"controlplane": "workers", "workers": "controlplane"}.get(side)
        if other and module.split(".")[0] == other:
            return f"{name} imports {module}"
        if side == "frontend" and module.startswith("relay_engine"):
            return f"{name} imports {module}; the frontend goes through controlplane"
        return None

    assert _violations(rule) == []


def test_the_lab_uses_only_the_cores_public_names():
    def rule(name, module, names):
        if name.startswith("relay_engine.lab") and module.startswith("relay_engine.core"):
            private = [n for n in names if n.startswith("_")]
            return f"{name} takes private {private} from {module}" if private else None
        return None

    assert _violations(rule) == []


# The modules of the cache tiers (HBM's and every registered one under it); outside the core, only the
# stack (``tiers``) and its words (``outcomes``).
TIER_MODULES = {"relay_engine.core.kvcache", *LOWER_TIER_MODULES.values()}


def _tier_import(name: str, module: str, names: list[str]) -> str | None:
    if name.startswith("relay_engine.core.") or name.startswith("tests."):
        return None
    target = _project_target(module)
    if target in TIER_MODULES:
        return f"{name} imports the tier module {target}; ask the engine's tier stack (relay_engine.core.tiers)"
    return None


def test_nothing_outside_the_core_imports_a_tier_module():
    assert set(MODULES) >= TIER_MODULES, "a tier module was renamed: update its registration (or kvcache here)"
    assert {"relay_engine.core.dram", "relay_engine.core.disk"} <= TIER_MODULES
    assert _violations(_tier_import) == []


@pytest.mark.parametrize("module", sorted(TIER_MODULES))
def test_the_tier_rule_catches_a_direct_import(module):
    assert _tier_import("relay_engine.lab.bench.warmup", module, [])
    assert _tier_import("workers.instance", f"{module}.Something", [])
    assert _tier_import("relay_engine.core.engine", module, []) is None


def test_the_engine_builds_its_lower_tiers_through_their_registration_only():
    """A new tier is its module and its entry in ``lower_tiers.LOWER_TIERS``: the engine imports none."""
    lower = set(LOWER_TIER_MODULES.values())
    assert lower <= set(MODULES)
    imported = {_project_target(module) for module, _, _ in _imports("relay_engine.core.engine",
                                                                      MODULES["relay_engine.core.engine"])}
    assert imported & lower == set()


def _tier_reach_ins(path: Path) -> list[int]:
    """Lines that reach past an engine into its tiers: ``engine.hbm``, ``engine.dram``, ``….cache.hbm``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in {"hbm", "dram", "disk"}:
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) \
                else ""
            if "engine" in owner_name or owner_name == "cache":
                lines.append(node.lineno)
    return lines


def test_nothing_outside_the_core_reaches_past_the_engine_into_a_tier():
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, path in sorted(MODULES.items())
           if not name.startswith("relay_engine.core") for line in _tier_reach_ins(path)]
    assert bad == []


def test_the_reach_in_rule_catches_the_old_warmup(tmp_path):
    old = tmp_path / "warmup.py"
    old.write_text("def prime(engine, key):\n    engine.hbm.get(key)\n    engine.dram.promote(key)\n"
                   "    self.engine.cache.hbm.insert(key)\n")
    assert _tier_reach_ins(old) == [2, 3, 4]


OUTCOME_WORDS = {o.value for o in Outcome}
_JS_OUTCOME = re.compile(r"\b(source|outcome)\s*[!=]==?\s*[\"'](" + "|".join(sorted(OUTCOME_WORDS)) + r")[\"']")


def _named(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _outcome_spellings(path: Path) -> list[int]:
    """Lines comparing a source or outcome with a bare string (``result.source == "hbm"``) or asking a
    rate of one (``rate("miss")``): the words live in ``relay_engine.core.outcomes``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(_named(o) in {"source", "outcome"} for o in operands):
                continue
        elif isinstance(node, ast.Call) and _named(node.func) == "rate":
            operands = node.args
        else:
            continue
        lines += [node.lineno for o in operands if isinstance(o, ast.Constant) and o.value in OUTCOME_WORDS]
    return lines


def test_where_a_rank_was_served_from_is_spelled_only_by_the_outcome_enum():
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, path in sorted(MODULES.items())
           if name != "relay_engine.core.outcomes" for line in _outcome_spellings(path)]
    for js in sorted((ROOT / "frontend").rglob("*.js")):
        bad += [f"{js.relative_to(ROOT)}:{n}" for n, text in enumerate(js.read_text().splitlines(), 1)
                if _JS_OUTCOME.search(text)]
    assert bad == []


def test_the_spelling_rule_catches_a_bare_outcome(tmp_path):
    old = tmp_path / "old.py"
    old.write_text('if result.source != "hbm":\n    pass\nself.rate("miss")\nx = "hbm_hits"\nchange == "hbm"\n')
    assert _outcome_spellings(old) == [1, 3]
    assert _JS_OUTCOME.search('if (row.outcome === "dram") {')


def test_there_are_no_import_cycles():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, _, _ in _imports(name, path):
            target = _project_target(module)
            # a package's __init__ is imported with its submodules; only edges between modules count
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    cycles = _strongly_connected(graph)
    assert cycles == [], "import cycles: " + "; ".join(" → ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm; components of more than one module are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("cycle", [{"a": {"b"}, "b": {"a"}}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}])
def test_the_cycle_finder_finds_cycles(cycle):
    assert _strongly_connected(cycle) == [set(cycle)]

