"""The package's layers: mlxinfer's own modules import one way, down the layers of the README's file map,
at the top of each file; a function-level import of an mlxinfer module only where it guards an optional
dependency (MLX where a numpy-only path runs, the server's packages)."""

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mlxinfer"


def _file_map() -> str:
    """The README's file map: the code block under its "## Design" heading."""
    text = (ROOT.parent / "README.md").read_text()
    design = text[text.index("\n## Design"):]
    return design[design.index("```") + 3:design.index("```", design.index("```") + 3)]


def _named(file_map: str) -> set[str]:
    """The paths (under mlxinfer/) the file map names: words ending in .py or / , braces expanded
    (models/{llama,qwen3}.py is models/llama.py and models/qwen3.py)."""
    named = set()
    for word in file_map.split():
        m = re.fullmatch(r"(.*)\{(.*)\}(.*)", word)
        for w in ([m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [word]):
            if w.endswith((".py", "/")):
                named.add(w)
    return named


def _layers(file_map: str) -> list[list[str]]:
    """Each layer's module names (models/llama.py: "models.llama", and its package "models"; server/:
    "server"), from the file map's rows; only paths in the package count (its last row names the
    folders beside it: metal_kernels/, tests/)."""
    layers = []
    for line in file_map.splitlines()[1:]:
        words = line.split()
        if not words:
            continue
        if words[0].isdigit():
            layers.append([])
        for path in sorted(_named(line)):
            if not (ROOT / path).exists():
                continue
            name = path.removesuffix(".py").rstrip("/").replace("/", ".")
            layers[-1] += [name] + ([name.split(".")[0]] if "." in name else [])
    return layers


# The README's file map, bottom up (a module may import its own layer and those below; no circle),
# read from the map itself: a row that starts with a number opens its layer.
LAYERS = _layers(_file_map())
LAYERS[-1] += ["__main__", ""]  # `python -m mlxinfer` and the package's __init__: above everything
DEFERRED = {  # (importer, imported): function-level imports that guard an optional dependency
    ("backends", "backends.mlx"),  # MLX, where the numpy backend runs without it
    ("server", "server.app"),  # the server's packages (fastapi, uvicorn, ...), an optional extra
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    for i, names in enumerate(LAYERS):
        if name in names or any(name.startswith(n + ".") for n in names if n):
            return i
    raise AssertionError(f"mlxinfer.{name} is not in the file map's layers (tests/test_layout.py, README)")


def own_imports(path: pathlib.Path):
    """(imported module, at top level?) for each import of an mlxinfer module in the file."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("mlxinfer"):
                target = node.module[len("mlxinfer."):] if node.module != "mlxinfer" else ""
            else:
                continue
            targets = [target] if node.module else [f"{target}.{a.name}".strip(".") for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name[len("mlxinfer."):] for a in node.names if a.name.startswith("mlxinfer.")]
        else:
            continue
        for t in targets:
            if (ROOT / (t.replace(".", "/") + ".py")).exists() or (ROOT / t.replace(".", "/") / "__init__.py").exists():
                yield t, id(node) in top
            elif "." in t and (ROOT / (t.rsplit(".", 1)[0].replace(".", "/") + ".py")).exists():
                yield t.rsplit(".", 1)[0], id(node) in top  # `from .x import name`: the module x


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) or "__init__" for p in MODULES])
def test_imports_run_down_the_layers_at_the_top_of_the_file(path):
    name = module_name(path)
    mine = layer_of(name)
    for target, at_top in own_imports(path):
        if target == name:
            continue
        assert layer_of(target) <= mine, f"mlxinfer.{name} (layer {mine}) imports mlxinfer.{target} (layer {layer_of(target)})"
        assert at_top or (name, target) in DEFERRED, f"mlxinfer.{name} imports mlxinfer.{target} inside a function"


def test_no_import_circle():
    graph = {module_name(p): {t for t, _ in own_imports(p) if t != module_name(p)} for p in MODULES}
    state = {}

    def visit(n, path):
        if state.get(n) == "done":
            return
        assert state.get(n) != "open", "import circle: " + " -> ".join(path + [n])
        state[n] = "open"
        for m in sorted(graph.get(n, ())):
            if m:  # the package itself runs first whatever is imported: not an arrow
                visit(m, path + [n])
        state[n] = "done"

    for n in sorted(graph):
        visit(n, [])


def test_a_planted_circle_and_an_upward_import_are_seen(tmp_path, monkeypatch):
    """The checks above can fail: a model importing the engine is an arrow up and a circle."""
    planted = tmp_path / "mlxinfer"
    for p in MODULES:
        dst = planted / p.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(p.read_text())
    (planted / "models" / "qwen3.py").write_text((planted / "models" / "qwen3.py").read_text()
                                                 + "\nfrom ..engine import Engine\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", planted)
    monkeypatch.setattr(here, "MODULES", sorted(planted.rglob("*.py")))
    with pytest.raises(AssertionError, match="layer 4.*imports mlxinfer.engine"):
        test_imports_run_down_the_layers_at_the_top_of_the_file(planted / "models" / "qwen3.py")
    with pytest.raises(AssertionError, match="import circle"):
        test_no_import_circle()


def test_the_file_map_names_every_module():
    """Every module of the package is in the README's file map (a package listed with a trailing / covers
    its files: server/), and the map names no file that is not there."""
    named = _named(_file_map())
    files = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    covered = {f for f in files if f in named or any(f.startswith(d) for d in named if d.endswith("/"))}
    assert files - covered == set(), "modules missing from the README's file map"
    assert {n for n in named if n.endswith(".py")} - files == set(), "the file map names files that do not exist"


def test_a_module_left_out_of_the_file_map_is_seen():
    named = _named("x.py models/{a,b}.py server/")
    assert named == {"x.py", "models/a.py", "models/b.py", "server/"}
