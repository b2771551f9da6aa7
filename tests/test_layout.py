"""The package's layering (docs/ARCHITECTURE.md): every import points down a floor or stays inside its
own package, and no modules import each other in a circle (lazy imports inside functions count)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tokenmill"

# Floors, top down; a module may import its own unit or a unit on a lower floor.
FLOORS = [
    ["bench"],
    ["entrypoints"],
    ["serve"],
    ["engine"],
    ["executor"],
    ["runner", "loader"],
    ["step_io", "models", "wire"],
    ["layers", "sampling_params", "kv_connector"],
    ["quantization", "lora", "config", "chat_template", "structured_outputs"],
    ["kernels", "distributed", "logger", "errors", "version"],
]
FLOOR = {unit: len(FLOORS) - i for i, units in enumerate(FLOORS) for unit in units}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != "tokenmill" and t != name:
                found.add(t)
    return found


def _unit(module: str) -> str:
    return module.split(".")[1]


def test_imports_point_down_and_form_no_circle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items() if m != "tokenmill"}
    units = {_unit(m) for m in graph}
    assert units <= set(FLOOR), f"modules on no floor: {sorted(units - set(FLOOR))} (add them to FLOORS)"
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                    if _unit(t) != _unit(m) and FLOOR[_unit(t)] >= FLOOR[_unit(m)])
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)
    # Circles: a depth-first search for a back edge.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_engine_holds_no_process_or_http_code():
    modules = _modules()
    for m, p in modules.items():
        if m.startswith("tokenmill.engine"):
            text = p.read_text()
            for word in ("fastapi", "uvicorn", "zmq", "multiprocessing", "subprocess"):
                assert f"import {word}" not in text and f"from {word}" not in text, f"{m} imports {word}"


# models/ modules that are not a model family's own
_MODEL_INFRA = {"tokenmill.models", "tokenmill.models.config", "tokenmill.models.interface",
                "tokenmill.models.presets", "tokenmill.models.registry", "tokenmill.models.llama"}


def test_model_families_plug_into_the_shared_decoder():
    """A family's module (models/moe.py, ...) builds on models/llama.py's decoder; the decoder and
    the config never import a family, and only the registry (besides other families) picks one."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items() if m != "tokenmill"}
    families = {m for m in graph if m.startswith("tokenmill.models.") and m not in _MODEL_INFRA}
    assert "tokenmill.models.moe" in families
    for family in families:  # directly, or through the family it extends (gpt_oss through moe)
        bases = {family} | (graph[family] & families)
        assert any("tokenmill.models.llama" in graph[b] for b in bases), f"{family} does not reuse the shared decoder"
    for infra in _MODEL_INFRA - {"tokenmill.models.registry"}:
        assert not graph.get(infra, set()) & families, f"{infra} imports a model family"
    importers = sorted(m for m, ts in graph.items() if ts & families and m not in families)
    assert importers == ["tokenmill.models.registry"], importers
