"""The package's shape, as DESIGN.md draws it: imports point one way (commands -> server ->
protocols -> Store contract <- backends; model, config and logs at the bottom) and no two
modules import each other, not even through imports made inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cassmail"
PROTOCOLS = ("cassmail.smtp", "cassmail.pop3", "cassmail.imap")
BACKENDS = ("cassmail.store.cassandra", "cassmail.store.mbox", "cassmail.store.wheelfs")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The cassmail modules `name` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cassmail"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("cassmail")}
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def backend(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BACKENDS)


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {name: imports(name, path, known) for name, path in known.items()}
    # The one registry allowed to point back: the IMAP session fills its command table from the
    # command modules, which import the session (session.load_commands).
    edges["cassmail.imap.session"] = {m for m in edges["cassmail.imap.session"]
                                      if not (m.startswith("cassmail.imap.") and "cassmail.imap.session" in edges[m])}
    return edges


def test_no_two_modules_import_each_other() -> None:
    assert cycles(graph()) == []


def test_protocols_reach_the_store_only_through_its_contract() -> None:
    edges = graph()
    for name, targets in edges.items():
        if name.startswith(PROTOCOLS):
            assert not {t for t in targets if backend(t)}, name


def test_only_the_store_factory_imports_a_backend() -> None:
    edges = graph()
    importers = {name for name, targets in edges.items() if any(backend(t) for t in targets)}
    assert {name for name in importers if not name.startswith("cassmail.store")} == set()


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
