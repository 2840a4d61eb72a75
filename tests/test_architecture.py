"""The house rules of ARCHITECTURE.md, checked on the source: imports point one way, no import cycles,
no ``sys.path`` edits in the packages.

Layers, lowest first: ``config`` -> ``model`` -> ``draft`` -> ``pipeline`` (the decoding core and its entry
points) -> tools (``pipeline.tools``, ``split_and_save_models``, ``data``) -> ``scripts`` (developer scripts,
run as modules; nothing imports them). A module may import its own layer
or lower ones, at module level or inside a function alike; the decode path therefore never reaches tooling.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("config", "model", "draft", "pipeline", "data", "scripts")
TOP_SCRIPTS = ("split_and_save_models",)


def layer(module: str) -> int:
    if module.split(".")[0] == "scripts":
        return 5
    if module.startswith("pipeline.tools") or module in TOP_SCRIPTS or module.split(".")[0] == "data":
        return 4
    return {"config": 0, "model": 1, "draft": 2, "pipeline": 3}[module.split(".")[0]]


def modules() -> dict[str, Path]:
    out = {m: REPO / f"{m}.py" for m in TOP_SCRIPTS}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def project_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, anywhere in the file (function-level imports count)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: up from the module's own package
                pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = ".".join(part for part in (pkg, base) if part)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
    return deps


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: project_imports(m, p, known) for m, p in mods.items()}


def test_imports_point_one_way():
    bad = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
           for m, deps in graph().items() for d in sorted(deps) if layer(d) > layer(m)]
    assert not bad, "imports against the layering (config -> model -> draft -> pipeline -> tools):\n" + "\n".join(bad)


def test_no_import_cycles():
    """Package ``__init__`` modules aside, no two modules reach each other through imports."""
    g = {m: {d for d in deps if not (REPO / d.replace(".", "/") / "__init__.py").is_file()}
         for m, deps in graph().items()}
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


def test_no_sys_path_edits_in_packages():
    hits = [f"{p.relative_to(REPO)}:{i}" for m, p in modules().items()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "sys.path.insert" in line or "sys.path.append" in line]
    assert not hits, f"sys.path edits (use python -m from the repository root instead): {hits}"


def test_layering_check_sees_a_planted_violation(tmp_path):
    """The checker itself: a model module importing the pipeline is reported."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from pipeline.engine import Engine\n")
    deps = project_imports("model.bad", path, set(modules()))
    assert "pipeline.engine" in deps and layer("pipeline.engine") > layer("model.bad")
    path.write_text("import scripts.serve_bench\n")              # a tool reaching a developer script
    deps = project_imports("pipeline.tools.bad", path, set(modules()))
    assert "scripts.serve_bench" in deps and layer("scripts.serve_bench") > layer("pipeline.tools.bad")


def test_scripts_are_checked():
    assert {"scripts.fault_matrix", "scripts.rehearse_7b", "scripts.serve_bench"} <= set(modules())


def test_mode_registry_matches_config_and_makes_fresh_strategies():
    from config.modes import MODES
    from pipeline.modes import REGISTRY, new_decoder
    assert tuple(REGISTRY) == MODES
    for mode in ("pruned", "pipedec", "continuous"):   # strategy objects: one per generation
        a, b = new_decoder(mode), new_decoder(mode)
        assert a.__self__ is not b.__self__


def test_transports_implement_the_protocol():
    from pipeline.local_ring import LocalComm, LocalRing
    from pipeline.transport import Transport
    assert isinstance(LocalComm(LocalRing(2), 0), Transport)
    from pipeline.comm import Comm
    from pipeline.tp_run import GroupComm
    for cls in (Comm, GroupComm):   # (constructing them needs a process group: check the methods)
        missing = [m for m in ("send_next", "recv_prev", "poll_prev", "send_direct", "open_direct_inbox", "poll_direct")
                   if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)
