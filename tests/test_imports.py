"""The package's structure: no import cycles between its modules, and no private names imported across modules.

Both are read from the source (every `import` statement, at module level or inside a function), so a cycle hidden in
a function-level import counts too."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_qlora"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def package_imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> [(imported lit_qlora module, names imported from it, line)], the package's own imports only."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, list] = {m: [] for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                target = node.module
                if not target.startswith("lit_qlora"):
                    continue
                names = [a.name for a in node.names]
                # `from lit_qlora import demo`: the submodule, not a name of lit_qlora/__init__.py
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                if subs:
                    out[mod] += [(s, [], node.lineno) for s in subs]
                else:
                    out[mod].append((target, names, node.lineno))
            elif isinstance(node, ast.Import):
                out[mod] += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("lit_qlora")]
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    imports = package_imports()
    # the package's __init__ re-exports the public API: importing it is not a dependency of its submodules' design
    graph = {m: {t for t, _, _ in deps if t != "lit_qlora" and t != m} for m, deps in imports.items()
             if m != "lit_qlora"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_private_names_across_modules():
    bad = [f"{mod}:{line} imports {name} from {target}"
           for mod, deps in package_imports().items() for target, names, line in deps
           for name in names if name.startswith("_")]
    assert not bad, bad


def test_the_checker_sees_a_cycle():
    """The cycle finder itself, on a graph with a cycle hidden two steps deep (so the tests above can fail)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"


def architecture_layers() -> dict[str, int]:
    """module (lit_qlora.x) -> its layer number, from the table in ARCHITECTURE.md (`| 3 model | model, lora | ...`)."""
    layers = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0][:1].isdigit():
            for name in cells[1].split(","):
                layers[f"lit_qlora.{name.strip()}"] = int(cells[0].split()[0])
    return layers


def upward_imports(imports: dict, layers: dict[str, int]) -> list[str]:
    """Every import of a module from a higher layer than its own, as 'module (layer) imports target (layer)'."""
    def layer(m: str) -> int:
        return layers.get(m, layers.get(m.rsplit(".", 1)[0], 0))  # lit_qlora.demo.x sits with lit_qlora.demo

    return [f"{mod}:{line} (layer {layer(mod)}) imports {target} (layer {layer(target)})"
            for mod, deps in imports.items() if mod != "lit_qlora"
            for target, _, line in deps if target != "lit_qlora" and layer(target) > layer(mod)]


def test_every_module_has_a_layer_in_architecture_md():
    layers = architecture_layers()
    imports = package_imports()
    # a subpackage's __init__ that imports nothing (its docstring says what the subpackage owns) needs no layer
    missing = [m for m in imports if m != "lit_qlora" and m not in layers
               and m.rsplit(".", 1)[0] not in layers and not (is_package(m) and not imports[m])]
    assert not missing, f"{missing}: place each in a layer of the table in ARCHITECTURE.md"
    stale = [m for m in layers if m not in imports]
    assert not stale, f"ARCHITECTURE.md names modules that do not exist: {stale}"


def test_imports_only_go_down():
    bad = upward_imports(package_imports(), architecture_layers())
    assert not bad, "upward imports (move the code down, or the module up in ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_layer_check_sees_an_upward_import():
    layers = {"lit_qlora.utils": 1, "lit_qlora.model": 3}
    assert upward_imports({"lit_qlora.utils": [("lit_qlora.model", [], 7)], "lit_qlora.model": []}, layers) == [
        "lit_qlora.utils:7 (layer 1) imports lit_qlora.model (layer 3)"]
    assert upward_imports({"lit_qlora.model": [("lit_qlora.utils", [], 3)]}, layers) == []
