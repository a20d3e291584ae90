"""Finds import circles between the files of every Rust crate of the workspace (``use``
of another module of the crate) and of the Python package (module-level imports), and
prints each; exits 1 if there is any, or if ``flashloss.jax``'s two paths import each
other. ``python3 scripts/import_cycles.py`` from the repository.

A Rust file's edges: each ``use crate::…`` / ``use super::…`` path, and each
``crate::…`` path written in its code (``crate::front::gpu(…)``), resolved to the
deepest module file it names (a re-export from ``mod.rs`` is an edge to that
``mod.rs``); ``mod x;`` declarations are not imports. A Python module's edges: its
module-level ``import``/``from … import`` of the package's own modules (a name imported
from a package that is one of its modules is an edge to that module).

Circles are looked for between files, and between the members of each module with
children (a folder: ``fused::support`` with all its files is one member of ``fused``, so
``fused::passes -> fused::support/… -> fused::terms -> fused::support/key`` is a circle of
``fused``'s members even though no two files import each other). Besides, no module of
``flashloss.jax.ffi`` may import one of ``flashloss.jax.pallas`` or the other way, at any
level (a function's own imports too): the two paths share only the modules above them."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST = sorted(p.parent for p in ROOT.glob("crates/*/Cargo.toml")) + [ROOT / "fuzz"]
PYTHON = ROOT / "crates/flashloss-py/python"
#: Subpackages that must not import each other (``flashloss.jax``'s FFI and Pallas paths).
APART = ("flashloss.jax.ffi", "flashloss.jax.pallas")


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _rust_module(src: Path, path: Path) -> tuple:
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def _rust_graph(src: Path) -> dict:
    """The module graph of the crate whose sources are ``src`` (its ``lib.rs`` or ``main.rs``
    the root; the files of ``src/bin`` are left out, each a crate of its own)."""
    files = {_rust_module(src, p): p for p in src.rglob("*.rs") if p.relative_to(src).parts[0] != "bin"}
    use = re.compile(r"^(pub(?:\([a-z]+\))?\s+)?use\s+([^;]+);", re.M)  # top level: not inline test modules
    inline = re.compile(r"(?<![\w:$])crate::(?:[a-z_][a-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*")  # a path in the code
    stmts = {}
    for m, p in files.items():
        text = p.read_text()
        code = "\n".join(line.split("//")[0] for line in text.splitlines() if not use.match(line.strip()))
        stmts[m] = [(bool(vis), st.replace("\n", " ")) for vis, st in use.findall(text)]
        stmts[m] += [(False, path) for path in inline.findall(code)]

    def start(module, parts):
        """The module a path starts from and the rest of it (None: outside the crate)."""
        children = {m[len(module)] for m in files if m[: len(module)] == module and len(m) > len(module)}
        if parts[0] == "crate":
            return (), parts[1:]
        if parts[0] in ("super", "self"):
            base, rest = module, parts
            while rest and rest[0] in ("super", "self"):
                base, rest = (base[:-1] if rest[0] == "super" else base), rest[1:]
            return base, rest
        if parts[0] in children:
            return module, parts
        return None

    def reexports(module) -> dict:
        """The items ``module`` re-exports (``pub use``): name -> path parts, from it."""
        out = {}
        for public, st in stmts[module]:
            if public:
                for item in _expand(st):
                    name = item.split(" as ")[-1].split("::")[-1].strip()
                    out[name] = item.split(" as ")[0].split("::")
        return out

    def resolve(module, parts, depth=0):
        begun = start(module, parts)
        if begun is None or depth > 20:
            return None
        target, rest = begun
        for i, part in enumerate(rest):
            if target + (part,) in files:
                target = target + (part,)
                continue
            again = reexports(target).get(part) if target in files else None
            if again is not None and i == len(rest) - 1:
                return resolve(target, again, depth + 1) or target
            break
        return target if target in files else None

    graph = {}
    for module in files:
        edges = set()
        for _, st in stmts[module]:
            for item in _expand(st):
                target = resolve(module, item.split(" as ")[0].split("::"))
                if target is not None and target != module:
                    edges.add(target)
        graph[module] = edges
    return {"::".join(k) or "crate": {"::".join(t) or "crate" for t in v} for k, v in graph.items()}


def _expand(path: str) -> list:
    """``a::{b, c::{d}}`` as ``a::b``, ``a::c::d``."""
    path = path.strip()
    if "{" not in path:
        return [path.split(" as ")[0].strip()]
    head, _, body = path.partition("{")
    body = body[: body.rindex("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    return [x for item in items if item.strip() for x in _expand(head + item.strip())]


def _python_graph() -> dict:
    mods = {}
    for p in (PYTHON / "flashloss").rglob("*.py"):
        rel = p.relative_to(PYTHON).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = p
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def _members(graph: dict, sep: str) -> list:
    """``(parent, graph of its members)`` for every module with children: each member
    stands for itself and every module below it."""
    out = []
    parents = {n.rpartition(sep)[0] for n in graph if sep in n}
    for parent in sorted(parents):
        prefix = parent + sep

        def member(n):
            return n[len(prefix) :].split(sep)[0] if n.startswith(prefix) else None

        sub: dict = {}
        for n, edges in graph.items():
            a = member(n)
            if a is None:
                continue
            sub.setdefault(a, set()).update(b for b in map(member, edges) if b is not None and b != a)
        out.append((parent, sub))
    return out


def _circles(label: str, graph: dict, sep: str) -> int:
    cycles = _cycles(graph)
    for parent, sub in _members(graph, sep):
        cycles += [[f"{parent}{sep}{m}" for m in c] for c in _cycles(sub)]
    print(f"{label}: {len(graph)} modules, {len(cycles)} import circles")
    for c in cycles:
        print("  circle:", " <-> ".join(c))
    return len(cycles)


def _apart() -> int:
    """Imports (at any level) between the subpackages of :data:`APART`."""
    bad = 0
    for p in (PYTHON / "flashloss").rglob("*.py"):
        rel = p.relative_to(PYTHON).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if p.name == "__init__.py" else name.rpartition(".")[0]
        own = next((a for a in APART if name == a or name.startswith(a + ".")), None)
        if own is None:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                other = next((a for a in APART if a != own and (t == a or t.startswith(a + "."))), None)
                if other is not None:
                    print(f"  {name} imports {t}: {own} and {other} must not import each other")
                    bad += 1
                    break
    print(f"flashloss.jax paths {' / '.join(APART)}: {bad} imports between them")
    return bad


def main() -> int:
    found = sum(_circles(str(src.relative_to(ROOT) / "src"), _rust_graph(src / "src"), "::") for src in RUST)
    found += _circles("flashloss (Python)", _python_graph(), ".")
    found += _apart()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
