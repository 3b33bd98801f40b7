"""docs/design.md §2's layers, enforced on the source: `algorithms → placement, engines → flowactors`.

flowactors imports none of engines, placement, algorithms; engines and placement import nothing from algorithms
and nothing from each other (they are side by side above flowactors). Every `.py` file of the four packages is
parsed with `ast`, and every import counts wherever it stands (inside a function, under `TYPE_CHECKING`, in a
`try`): `import` and `from ... import` (relative ones resolved), `importlib.import_module` / `__import__` /
`importlib.util.find_spec` with a literal name, and a string that is a dotted path to one of the packages' modules
(the way `engines/__init__.py` names the modules it loads lazily).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowactors", "engines", "placement", "algorithms")
ALLOWED = {  # the other project packages each layer may import (its own always)
    "flowactors": set(),
    "engines": {"flowactors"},
    "placement": {"flowactors"},
    "algorithms": {"flowactors", "engines", "placement"},
}
_DYNAMIC = {"import_module", "__import__", "find_spec"}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_project_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] not in PACKAGES:
        return False
    here = ROOT.joinpath(*parts[:2])
    return here.with_suffix(".py").is_file() or (here / "__init__.py").is_file()


def imports_of(source: str, path: Path, strings: bool = True) -> list[tuple[int, str]]:
    """(line, module) for everything `source` (the text of `path`) imports or names for a dynamic import (with
    `strings`, also every string that is a dotted path to a project module: a lazy import's name, or a log
    channel's)."""
    module = _module_parts(path)
    package = module if path.name == "__init__.py" else module[:-1]
    found: list[tuple[int, str]] = []
    named: set[int] = set()  # string constants already counted as the argument of a dynamic import
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..x import y` climbs level - 1 packages from this file's package
                base = package[: len(package) - (node.level - 1)]
                if node.module:
                    found.append((node.lineno, ".".join([*base, node.module])))
                else:  # `from .. import x`: each name may be a module
                    found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
            else:
                found.append((node.lineno, node.module or ""))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in _DYNAMIC:
                found.append((node.lineno, node.args[0].value))
                named.add(id(node.args[0]))
        elif (
            strings
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in named
            and _DOTTED.fullmatch(node.value)
            and _is_project_module(node.value)
        ):
            found.append((node.lineno, node.value))
    return found


def violations(layer: str, path: Path, source: str) -> list[str]:
    """The imports in `source` (the text of `path`, a file of package `layer`) that docs/design.md §2 forbids."""
    forbidden = set(PACKAGES) - ALLOWED[layer] - {layer}
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in imports_of(source, path)
        if name.split(".")[0] in forbidden
    ]


@pytest.mark.parametrize("layer", PACKAGES)
def test_imports_point_down_the_layers(layer: str) -> None:
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no sources under {layer}/"
    bad = [v for path in files for v in violations(layer, path, path.read_text())]
    assert not bad, (
        f"{layer} may import only {sorted(ALLOWED[layer]) or 'none'} of {PACKAGES} "
        f"(docs/design.md §2):\n" + "\n".join(bad)
    )


def test_the_checker_sees_every_kind_of_import() -> None:
    """Source of an imagined flowactors/engines/ module (never written: the checker only takes its path) with a
    forbidden import of each kind, among allowed ones that must not be reported."""
    source = """
import os, flowactors.batch
from flowactors import Batch
from . import protocols
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from placement.plan import Plan
def f():
    import algorithms.objectives.losses as core
    from ... import engines
    from ...algorithms import loop
    import importlib
    return importlib.import_module("engines.roles"), __import__("placement")
LAZY = {"Thing": "algorithms.ppo", "own": "flowactors.batch", "prose": "see engines.roles", "other": "a.b"}
"""
    path = ROOT / "flowactors" / "engines" / "imagined.py"
    assert sorted(name for _, name in imports_of(source, path)) == sorted(
        [
            "os",
            "flowactors.batch",
            "flowactors",
            "flowactors.engines.protocols",
            "typing",
            "placement.plan",
            "algorithms.objectives.losses",
            "engines",
            "algorithms",
            "importlib",
            "engines.roles",
            "placement",
            "algorithms.ppo",
            "flowactors.batch",
        ]
    )
    bad = sorted(v.split(" imports ")[1] for v in violations("flowactors", path, source))
    assert bad == sorted(
        [
            "placement.plan",
            "algorithms.objectives.losses",
            "engines",
            "algorithms",
            "engines.roles",
            "placement",
            "algorithms.ppo",
        ]
    )
    assert violations("algorithms", ROOT / "algorithms" / "imagined.py", "import engines, placement\n") == []
    assert len(violations("engines", ROOT / "engines" / "imagined.py", "import engines, placement\n")) == 1


def test_the_dashboard_names_no_rlhf_metric_or_role() -> None:
    """The RLHF metric names and role colours are the program's (`key_metrics`, algorithms/run/dashboard_style.py)."""
    page = ROOT / "flowactors" / "dashboard"
    text = "".join(p.read_text() for p in sorted(page.iterdir()) if p.suffix in (".py", ".html"))
    assert "def install_dashboard" in text, "the dashboard package moved; point this test at it"
    for word in ("reward_mean", "critic"):
        assert word not in text, f"flowactors/dashboard/ names {word!r}; the program passes its own names in"


def _module_file(dotted: str) -> Path | None:
    """The project file that `dotted` (or its longest importable prefix) names."""
    parts = dotted.split(".")
    if parts[0] not in PACKAGES:
        return None
    for n in range(len(parts), 0, -1):
        here = ROOT.joinpath(*parts[:n])
        if here.with_suffix(".py").is_file():
            return here.with_suffix(".py")
        if (here / "__init__.py").is_file():
            return here / "__init__.py"
    return None


def import_graph() -> dict[Path, set[Path]]:
    """file → the project files it imports, wherever the import stands (`imports_of`); `from a.b import c` where
    c is a module counts as an import of a.b.c. A package's `__init__.py` handing on names of its own submodules
    (a lazy face such as `engines/__init__.py`, the one place a module's name in a string loads it) draws no arrow
    down: importing the package is not a dependency of it."""
    graph: dict[Path, set[Path]] = {}
    for path in sorted(p for layer in PACKAGES for p in (ROOT / layer).rglob("*.py")):
        source = path.read_text()
        names = [name for _, name in imports_of(source, path, strings=path.name == "__init__.py")]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        targets = {_module_file(name) for name in names} - {None, path}
        if path.name == "__init__.py":
            targets = {t for t in targets if path.parent not in t.parents}
        graph[path] = targets  # type: ignore[assignment]
    return graph


def circles(graph: dict[Path, set[Path]]) -> list[set[Path]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[set[Path]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle() -> None:
    """docs/design.md §2: a lower module never reaches up, not even from inside a function; the runtime
    (flowactors/: controller, futures, transport/, the worker's runtime) included."""
    bad = [" ↔ ".join(sorted(str(p.relative_to(ROOT)) for p in c)) for c in circles(import_graph())]
    assert not bad, "import circles:\n" + "\n".join(bad)


def _private_crossings(source: str, name: str) -> list[str]:
    """`from flowactors.x import _name` and `module._name` on an imported flowactors module, in `source` (the
    text of the file `name`)."""
    tree = ast.parse(source)
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flowactors":
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if _module_file(target) is not None and _module_file(target) != _module_file(node.module or ""):
                    modules.add(alias.asname or alias.name)  # a module imported by name (`from flowactors import _x`)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}:{node.lineno} imports {alias.name} from {node.module}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module_of_flowactors() -> None:
    """A name with a leading underscore is its module's own: another module of the runtime that needs it means the
    name is part of an interface (make it public there) or the code is in the wrong module."""
    files = sorted((ROOT / "flowactors").rglob("*.py"))
    found = [f for p in files for f in _private_crossings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_finds_one() -> None:
    probe = "from flowactors import _runtime\nfrom flowactors.log import _hidden\n_runtime._GROUPS\n"
    found = _private_crossings(probe, "probe.py")
    assert [f.split(" ", 1)[1] for f in found] == ["imports _hidden from flowactors.log", "uses _runtime._GROUPS"]


RUNTIME_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "flowactors" / "transport").glob("*.py")
) + ["flowactors.futures", "flowactors.controller"]


_IMPORT_EACH = """
import json, os, sys, traceback
import torch, torch.distributed.checkpoint, dask, distributed  # third-party, once: each fork pays for ours only
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("flowactors", "engines", "algorithms", "placement"))
assert not ours, f"imported before the forks: {ours}"
failed = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child: this module first, then exit without the parent's clean-up
        os.close(read)
        try:
            __import__(module)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc()[-2000:].encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    if os.waitpid(pid, 0)[1] != 0:
        failed[module] = said or "the child ended without a traceback"
print(json.dumps(failed))
"""


def test_each_runtime_module_imports_alone() -> None:
    """Each transport module (and the futures and controller modules) imports first in a process that has imported
    no module of this project: no module of the runtime depends on another having been imported before it. Each is
    a fork of one interpreter that imported torch and Dask (what every one of them imports anyway) and nothing of
    ours, so the check costs one interpreter's start, not one per module."""
    import json
    import subprocess
    import sys

    broken = "flowactors.no_such_module"  # the check itself: a module that cannot be imported is reported
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *RUNTIME_MODULES, broken],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"flowactors.transport", "flowactors.transport.tasks"} <= set(RUNTIME_MODULES)  # the package was found
    assert f"No module named '{broken}'" in failed.pop(broken, "")
    assert not failed, "\n".join(f"import {m} alone:\n{e}" for m, e in failed.items())


def test_the_circle_finder_finds_a_circle() -> None:
    a, b, c, d = (Path(x) for x in "abcd")
    assert circles({a: {b}, b: {c}, c: {a, d}, d: set()}) == [{a, b, c}]
    assert circles({a: {b}, b: set()}) == []
