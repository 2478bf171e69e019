"""The layout holds: every import of casspec, dsia, dytc and scripts (module level, inside functions and under
TYPE_CHECKING, parsed from the sources, nothing imported) goes down the layers, never up and never in a cycle; and no
module or function outgrows what one person reads at once.

Layers: dsia <- dytc <- casspec <- scripts; within casspec, its subpackages (CASSPEC_LAYERS): cache <- loading <-
calibrate <- runtime <- tools, serve <- the command line."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsia", "dytc", "casspec", "scripts")  # in layer order
CASSPEC_LAYERS = (  # casspec's subpackages (and top-level modules) by layer, lowest first
    ("cache",),  # the user cache's files, keys and locks; kept state
    ("loading",),  # reading checkpoints (HF folders, GGUF), native kernels, the levels' stored copies
    ("calibrate",),  # measuring the machine: kernels, latency profiles, the levels plane, agreement, first use
    ("runtime",),  # Engine, the decode step, the target, requests, methods, statistics
    ("tools", "serve"),  # bench, ablations, the oracle replay's recording; the server
    ("cli_args", "cli", "__main__", ""),  # the command line (and the package's exports)
)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts).removesuffix(".__init__")] = f
    return out


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `mod` imports anywhere in its source (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[:len(mod.split(".")) - node.level + (path.name == "__init__.py")]
                head = ".".join(base + ([node.module] if node.module else []))
            else:
                head = node.module or ""
            names = [head] + [f"{head}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, f, known) for m, f in known.items()}


def layer(mod: str) -> tuple[int, int]:
    """(package layer, layer within casspec) of a module."""
    pkg, _, rest = mod.partition(".")
    part = rest.partition(".")[0]
    inner = next((i for i, names in enumerate(CASSPEC_LAYERS) if part in names), -1) if pkg == "casspec" else 0
    return PACKAGES.index(pkg), inner


def test_every_casspec_module_has_a_layer():
    unplaced = [m for m in modules() if m.partition(".")[0] == "casspec" and layer(m)[1] < 0]
    assert not unplaced, f"add these modules to CASSPEC_LAYERS: {unplaced}"


def test_imports_go_down_the_layers():
    upward = [f"{a} -> {b}" for a, bs in graph().items() for b in bs if layer(b) > layer(a)]
    assert not upward, f"imports up the layers: {upward}"


def test_no_import_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [m, n]) if n in stack else f"{m} -> {n}")
            elif not state.get(n):
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(edges):
        if not state.get(m):
            visit(m, [])
    assert not cycles, f"import cycles: {cycles}"


def test_the_layout_check_finds_an_upward_import_and_a_cycle(tmp_path):
    """The parser sees a function-level import and a TYPE_CHECKING one (what the checks above rest on)."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
                 "def g():\n    from casspec.runtime.engine import Engine\n")
    known = {"dsia.m": f, "dsia.b": f, "casspec.runtime.engine": f}
    assert imports("dsia.m", f, known) == {"dsia.b", "casspec.runtime.engine"}
    assert layer("casspec.runtime.engine") > layer("dsia.m")


def test_sizes_one_person_reads_at_once():
    """No module of casspec, dsia or dytc over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES."""
    over = []
    for mod, f in modules().items():
        if mod.partition(".")[0] == "scripts":
            continue
        src = f.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            over.append(f"{mod}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over.append(f"{mod}.{node.name}: {n} lines")
    assert not over, f"split these by responsibility: {over}"
