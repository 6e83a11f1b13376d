"""The package's layers and import rule (README "Architecture"), checked on the source with ``ast``.

Layers, lowest first; a module imports only from its own package or from a lower layer:

    core < data < models < eval < train < flare < ops < experiments < cli

- ``core``, ``data``, ``models``, ``eval`` and ``train`` never import ``nvflare`` (nor ``fedssl.flare``);
- nothing imports upward (e.g. ``flare`` importing ``experiments`` or ``cli``);
- no module outside ``flare`` touches a private member (``obj._name``) of a ``flare`` class;
- the package root holds ``__init__.py`` and packages only;
- a module uses every name it imports (a package's ``__init__`` re-exports through ``__all__``).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "custom" / "fedssl"
RANK = {"core": 0, "data": 1, "models": 2, "eval": 3, "train": 4, "flare": 5, "ops": 6, "experiments": 7, "cli": 8}
NO_NVFLARE = {"core", "data", "models", "eval", "train"}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "fedssl" else None


def imported_modules(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree`` (relative imports resolved against ``module``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names if package_of(f"{name}.{a.name}") and
                    name == "fedssl"]
    return out


def layer_violations(module: str, source: str) -> list[str]:
    """The import-rule violations of one module's source."""
    own = package_of(module)
    tree = ast.parse(source)
    problems = []
    if own is not None and own not in RANK and module.count(".") == 1:
        problems.append(f"{module} sits at the package root: put it in a layer")
        return problems
    for line, name in imported_modules(tree, module):
        if own in NO_NVFLARE and (name == "nvflare" or name.startswith("nvflare.")):
            problems.append(f"{module}:{line} imports {name}: the {own} layer must not depend on FLARE")
        target = package_of(name)
        if own is None or target is None or target == own:
            continue
        if target not in RANK:
            problems.append(f"{module}:{line} imports {name}: {target} is not a layer (root modules are not allowed)")
        elif RANK[target] >= RANK[own]:
            problems.append(f"{module}:{line} imports {name}: {own} (rank {RANK[own]}) may not import {target} "
                            f"(rank {RANK[target]})")
    return problems


def flare_private_members(sources: dict[str, str]) -> set[str]:
    """Names ``_x`` defined as methods or assigned as ``self._x`` in the classes of ``fedssl.flare``."""
    names = set()
    for module, source in sources.items():
        if package_of(module) != "flare":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(sub.name):
                        names.add(sub.name)
                    elif (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and _private(sub.attr)
                          and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        names.add(sub.attr)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_access_violations(module: str, source: str, flare_private: set[str]) -> list[str]:
    """Accesses ``x._name`` (x not ``self``/``cls``) to a private member of a flare class, outside ``flare``."""
    if package_of(module) == "flare":
        return []
    tree = ast.parse(source)
    if not any(package_of(name) == "flare" for _, name in imported_modules(tree, module)):
        return []
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in flare_private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            problems.append(f"{module}:{node.lineno} touches {node.attr}, a private member of a fedssl.flare class")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in flare_private):
            problems.append(f"{module}:{node.lineno} reads {node.args[1].value!r} of a fedssl.flare class by getattr")
    return problems


def names_in_expression(text: str) -> set[str]:
    """The names read by ``text`` if it is a Python expression (a string annotation such as ``"os.PathLike[str]"``
    or an ``__all__`` entry); a string that is not an expression (a docstring, a message) reads none."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def unused_imports(module: str, source: str) -> list[str]:
    """Names a module imports and never reads: not as a name, an attribute base, ``__all__`` or inside a string
    annotation (``"os.PathLike[str]"``)."""
    tree = ast.parse(source)
    imported: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
            for alias in node.names:
                imported[(alias.asname or alias.name).split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= names_in_expression(node.value)
    return [f"{module}:{line} imports {name} and never uses it" for name, line in sorted(imported.items())
            if name not in used]


def package_sources() -> dict[str, str]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


# ---------------------------------------------------------------------------------------------- the package
def test_every_module_follows_the_import_rule():
    problems = [p for m, s in package_sources().items() for p in layer_violations(m, s)]
    assert not problems, "\n".join(problems)


def test_no_module_outside_flare_touches_a_private_member_of_a_flare_class():
    sources = package_sources()
    private = flare_private_members(sources)
    assert private, "no private member found in fedssl.flare: the scan is broken"
    problems = [p for m, s in sources.items() for p in private_access_violations(m, s, private)]
    assert not problems, "\n".join(problems)


def test_every_module_uses_what_it_imports():
    problems = [p for m, s in package_sources().items() for p in unused_imports(m, s)]
    assert not problems, "\n".join(problems)


def test_the_package_root_holds_only_packages():
    loose = sorted(p.name for p in PKG.iterdir() if p.suffix == ".py" and p.name != "__init__.py")
    assert not loose, f"modules at the package root: {loose}; put each in its layer (README 'Architecture')"
    for name in RANK:
        assert (PKG / name / "__init__.py").is_file(), f"layer {name} is missing"
    unknown = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name not in RANK and p.name != "__pycache__")
    assert not unknown, f"packages that are not a layer: {unknown}; add them to RANK and the README"


# ---------------------------------------------------------------------------------------------- the checker itself
@pytest.mark.parametrize("module,source,expect", [
    ("fedssl.core.x", "import nvflare.apis.dxo\n", "must not depend on FLARE"),
    ("fedssl.train.x", "from nvflare.apis.dxo import DXO\n", "must not depend on FLARE"),
    ("fedssl.core.x", "from fedssl.models.unet import build_unet\n", "may not import models"),
    ("fedssl.data.x", "from fedssl.models import vit\n", "may not import models"),
    ("fedssl.train.x", "from fedssl.flare.constants import EXCLUDED_META\n", "may not import flare"),
    ("fedssl.ops.x", "from fedssl.experiments.fcl_demo import run_demo\n", "may not import experiments"),
    ("fedssl.flare.x", "from fedssl.experiments.fcl_demo import run\n", "may not import experiments"),
    ("fedssl.flare.x", "import fedssl.cli\n", "may not import cli"),
    ("fedssl.eval.x", "from ..flare import constants\n", "may not import flare"),
    ("fedssl.ops.x", "from fedssl import vit_finetune\n", "not a layer"),
])
def test_the_import_rule_catches(module, source, expect):
    problems = layer_violations(module, source)
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("module,source", [
    ("fedssl.flare.x", "from fedssl.train.fcl import FCLLocalTrainer\nimport nvflare\n"),
    ("fedssl.experiments.x", "from fedssl.ops.simulate import run_simulation\nfrom fedssl.flare import constants\n"),
    ("fedssl.eval.x", "from fedssl.data.volume import Volume\nfrom fedssl.models.unet import build_unet\n"),
])
def test_the_import_rule_allows(module, source):
    assert layer_violations(module, source) == []


def test_private_member_check_catches_access_from_outside_flare():
    flare = {"fedssl.flare.ex": "class E:\n    def __init__(self):\n        self._splits = 1\n    def _warm_up(self):\n"
                                "        return self._splits\n"}
    private = flare_private_members(flare)
    assert private == {"_splits", "_warm_up"}
    bad = "from fedssl.flare.ex import E\ne = E()\ne._warm_up()\nprint(getattr(e, '_splits'))\n"
    assert len(private_access_violations("fedssl.experiments.central", bad, private)) == 2
    assert private_access_violations("fedssl.flare.other", bad, private) == []
    good = "from fedssl.flare.ex import E\nclass F:\n    def __init__(self):\n        self._splits = 2\n"
    assert private_access_violations("fedssl.experiments.central", good, private) == []
    assert os.path.isdir(PKG)


def test_unused_import_check_catches_and_allows():
    bad = "from __future__ import annotations\nimport os\nfrom torch import nn, optim\nx = nn.Linear\n"
    assert unused_imports("fedssl.core.x", bad) == ["fedssl.core.x:3 imports optim and never uses it",
                                                    "fedssl.core.x:2 imports os and never uses it"]
    good = 'import os\nimport numpy as np\nP = "os.PathLike[str]"\ny = np.zeros(1)\n'
    assert unused_imports("fedssl.core.x", good) == []
    assert names_in_expression("os.PathLike[str]") == {"os", "str"}
    assert names_in_expression("Not an expression: a docstring.") == set()
