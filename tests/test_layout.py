"""The layout: no import cycles between speccomp's modules (imports inside functions count too: a cycle there is
the same tangle, only hidden), and the torch-free parts stay torch-free."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"speccomp": ROOT / "speccomp", "speccomp.passes": ROOT / "passes", "speccomp.backends": ROOT / "backends"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = file.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = file
    return found


def imports(name: str, file: Path, known: dict) -> set[str]:
    """The speccomp modules `name` imports, anywhere in the file (module level or inside functions)."""
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, file, known) for name, file in known.items()}
    # a package's __init__ importing its own submodules is no cycle of its own: drop those edges
    graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    assert len(known) > 40, "the module walk found too little: is the layout still speccomp/, passes/, backends/?"
    assert cycles(graph) == [], "modules that import each other (move what both need into a third module)"


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_torch_free_modules_import_no_torch():
    code = ("import sys; import speccomp, speccomp.engine, speccomp.runtime.calls, speccomp.runtime.packed, "
            "speccomp.runtime.budget, speccomp.drafters.lookup, "
            "speccomp.drafters.text_bridge, "
            "speccomp.errors, speccomp.prompts; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
