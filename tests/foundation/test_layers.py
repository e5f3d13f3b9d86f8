"""The package's layers hold: every module's imports of ds_rlhf modules, read with `ast`, against the layer order in
docs/ARCHITECTURE.md (the fenced `layers` block, top layer first). A module imports its own layer and the layers
below it, never one above; no two modules import each other, directly or around a loop; and the package's own
modules are imported at the top of a file (a function-local import is kept for heavy optional packages only, and
those are not ds_rlhf modules). Imports under `if TYPE_CHECKING:` are annotations only and do not count.
Only the modules docs/ARCHITECTURE.md names as the vLLM adapter layer import vLLM.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ds_rlhf"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
CYCLES = "import cycles (modules that import each other, directly or around a loop)"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the ds_rlhf module it imports
    line: int
    local: bool  # inside a function body

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> str:
    path = ROOT / Path(*name.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(ROOT))


def all_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a ds_rlhf module in one file: `import ds_rlhf.x`, `from ds_rlhf.x import y` (y a submodule
    or a name in x) and relative imports, with whether it sits inside a function."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt, local)
                continue
            visit_one(child, local)

    def visit_one(child: ast.AST, local: bool) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            for target in targets(child):
                if target == "ds_rlhf" or target.startswith("ds_rlhf."):
                    while target not in modules:  # `import ds_rlhf.x.y as z` / a name: the module that holds it
                        target = target.rpartition(".")[0]
                    found.append(Import(name, target, child.lineno, local))
        visit(child, local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def read_layers(text: str) -> list[list[str]]:
    """The fenced ```layers block: one layer a line, top layer first, each a list of module prefixes relative to
    ds_rlhf (`recipes` is the package ds_rlhf.recipes and everything in it, `ds_rlhf` the package's __init__)."""
    match = re.search(r"```layers\n(.*?)```", text, re.S)
    assert match, f"{ARCHITECTURE.relative_to(ROOT)} has no ```layers block"
    layers = []
    for line in match.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            layers.append(["ds_rlhf" if e == "ds_rlhf" else f"ds_rlhf.{e}" for e in line.replace(",", " ").split()])
    return layers


def layer_index(module: str, layers: list[list[str]]) -> int | None:
    """0 for the bottom layer, upwards; the longest matching prefix decides; None: no layer names the module."""
    best: tuple[int, int] | None = None
    for i, layer in enumerate(reversed(layers)):
        for prefix in layer:
            matches = module == prefix or (prefix != "ds_rlhf" and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself), Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def violations(package: Path = PACKAGE, architecture: Path = ARCHITECTURE) -> dict[str, list[str]]:
    modules = all_modules(package)
    layers = read_layers(architecture.read_text())
    imports = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    unplaced = sorted(m for m in modules if layer_index(m, layers) is None)
    upward = [f"{imp.where()}: {imp.importer} imports {imp.target}, a layer above it"
              for imp in imports
              if None not in (layer_index(imp.importer, layers), layer_index(imp.target, layers))
              and layer_index(imp.target, layers) > layer_index(imp.importer, layers)]
    local = [f"{imp.where()}: {imp.importer} imports {imp.target} inside a function (move it to the top)"
             for imp in imports if imp.local]
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, set()).add(imp.target)
    loops = [", ".join(c) for c in cycles(edges)]
    return {"modules in no layer": unplaced, "imports of a higher layer": upward, CYCLES: loops,
            "function-local imports of ds_rlhf modules": local}


def test_layers_hold():
    found = violations()
    report = "\n".join(f"{kind} ({len(items)}):\n  " + "\n  ".join(items) for kind, items in found.items() if items)
    assert not report, f"the layer rules of docs/ARCHITECTURE.md are broken:\n{report}"


def test_rules_catch_each_kind(tmp_path):
    """The checker itself, on a three-module package: an upward import, a cycle and a function-local import."""
    pkg = tmp_path / "ds_rlhf"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from ds_rlhf.high import b\n")
    (pkg / "low" / "c.py").write_text("from . import a\n\ndef f():\n    from ds_rlhf.low import a\n")
    (pkg / "high.py").write_text("from ds_rlhf.low.a import x\n\nif TYPE_CHECKING:\n    from ds_rlhf.low import c\n")
    doc = tmp_path / "ARCH.md"
    doc.write_text("```layers\nhigh\nlow\nds_rlhf\n```\n")
    found = violations(pkg, doc)
    assert found["modules in no layer"] == []
    assert [v.split(": ", 1)[1] for v in found["imports of a higher layer"]] == [
        "ds_rlhf.low.a imports ds_rlhf.high, a layer above it"]
    assert found[CYCLES] == [
        "ds_rlhf.high, ds_rlhf.low.a"]
    assert [v.split(": ", 1)[1] for v in found["function-local imports of ds_rlhf modules"]] == [
        "ds_rlhf.low.c imports ds_rlhf.low.a inside a function (move it to the top)"]


def test_every_layer_names_a_module():
    modules = all_modules()
    for layer in read_layers(ARCHITECTURE.read_text()):
        for prefix in layer:
            assert any(m == prefix or m.startswith(prefix + ".") for m in modules), f"{prefix}: no such module"


def imports_vllm(path: Path) -> bool:
    """Whether a file imports vLLM anywhere (top level or inside a function)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            return True
    return False


def vllm_adapter_layer(text: str) -> set[str]:
    """The modules the rule "Every vLLM call lives in the adapter layer: ..." of docs/ARCHITECTURE.md names (up to
    the pure mappings, which import no vLLM)."""
    match = re.search(r"Every vLLM call lives in the adapter layer:(.*?)its pure mappings", text, re.S)
    assert match, f"{ARCHITECTURE.relative_to(ROOT)} has no rule naming the vLLM adapter layer"
    return {"ds_rlhf." + p.removesuffix(".py").replace("/", ".") for p in re.findall(r"`([\w/]+\.py)`", match[1])}


def test_only_the_adapter_layer_imports_vllm():
    allowed = vllm_adapter_layer(ARCHITECTURE.read_text())
    modules = all_modules()
    assert allowed and allowed <= set(modules), sorted(allowed - set(modules))
    outside = sorted(name for name, path in modules.items() if imports_vllm(path) and name not in allowed)
    assert not outside, f"these modules import vLLM outside the adapter layer of docs/ARCHITECTURE.md: {outside}"
