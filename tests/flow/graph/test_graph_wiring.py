"""The graph decides everything: resource references and entry/exit contracts are checked by the compiler,
the registry has no import cycle, and checking a graph imports no MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from flow.builtins import compile_tables
from flow.graph.compiled import CompileError
from flow.graph.resource import Links
from flow.graph.spec import load_tables
from tests.harness import GRAPHS

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("flow", "stages", "protocols", "runtime", "viz")


def default_tables() -> dict[str, Any]:
    return load_tables(GRAPHS / "default.toml")


def errors_of(tables: dict[str, Any]) -> list[str]:
    with pytest.raises(CompileError) as caught:
        compile_tables(tables, "test")
    return [str(e) for e in caught.value.errors]


def test_the_issues_two_graphs_do_not_compile() -> None:
    misspelt = default_tables()
    misspelt["resources"]["prefix_cache"]["models"] = ["modle"]
    assert errors_of(misspelt) == ["resources.prefix_cache.models[0]: no resource named 'modle'\n"
                                   "    hint: did you mean 'model'?"]
    crossed = default_tables()
    crossed["stages"]["openai_chat"]["exit"] = "agents_generate_out"
    (contract, orphan) = errors_of(crossed)
    assert contract.startswith("stages.openai_chat.exit: contract mismatch: exit 'agents_generate_out' "
                               "(agents.generate.format) reads AgentTurnContext, entry 'openai_chat' "
                               "(openai.chat.decode) hands on ProtocolContext")
    assert "exits that can answer 'openai_chat': " in contract and "openai_chat_out" in contract
    assert orphan.startswith("stages.openai_chat_out: missing route")


def test_every_planted_wiring_error_in_one_run() -> None:
    tables = default_tables()
    resources, stages = tables["resources"], tables["stages"]
    stages["prepare"]["models"] = ["modle"]  # unknown id
    resources["agent_store"]["cache"] = "model"  # wrong kind
    resources["pool_a"] = {"type": "model_pool"}  # two pools claim every model
    resources["pool_b"] = {"type": "model_pool"}
    resources["second_cache"] = {"type": "prefix_cache", "disk": False, "models": ["model"]}
    stages["responses"]["exit"] = "openai_chat_out"  # Responses' context, read by nothing: fine
    stages["completions"]["exit"] = "responses_out"  # responses_out reads ResponsesContext: mismatch
    stages["models"]["models"] = ["model", "prefix_cache"]  # a stage naming the wrong kind
    text = "\n".join(errors_of(tables))
    assert "stages.prepare.models[0]: no resource named 'modle'\n    hint: did you mean 'model'?" in text
    assert ("resources.agent_store.cache: resource conflict: 'model' is a 'model' resource, this needs a "
            "'prefix_cache' one") in text
    assert ("resources.pool_b.models: resource conflict: 'model' is already named by model_pool 'pool_a'; a model "
            "belongs to one model_pool") in text
    assert "resources.second_cache.models" in text and "already named by prefix_cache" in text
    assert ("stages.completions.exit: contract mismatch: exit 'responses_out' (openai.responses.format) reads "
            "ResponsesContext, entry 'completions' (openai.completions.decode) hands on CompletionsContext") in text
    assert "stages.models.models[1]: resource conflict: 'prefix_cache' is a 'prefix_cache' resource" in text
    assert "stages.responses.exit" not in text


def test_single_references_default_to_the_only_one_and_ask_when_ambiguous() -> None:
    tables = default_tables()
    tables["resources"]["responses_b"] = {"type": "response_store"}
    text = "\n".join(errors_of(tables))
    assert "stages.responses.store: the graph has 2 'response_store' resources; name the one to use" in text
    tables["stages"]["responses"]["store"] = tables["stages"]["responses_out"]["store"] = "responses_b"
    tables["stages"]["responses_get"]["store"] = "response_store"
    graph = compile_tables(tables, "test")
    assert graph.stages["responses"].refs == {"store": ("responses_b",)}
    resources = graph.resources
    assert resources["agent_store"].uses == ("prefix_cache", "model")
    assert resources["model"].served_by == ("prefix_cache",)
    order = list(resources)
    assert order.index("prefix_cache") < order.index("model") < order.index("agent_store")


def test_resource_references_may_not_loop() -> None:
    from flow.graph.registry import Registry
    from flow.graph.resource import Reference, Resource, ResourceConfig

    class PairConfig(ResourceConfig):
        other: str | None = None

    class Pair(Resource):
        type_name = "pair"
        Config = PairConfig
        references = {"other": Reference("pair")}

    registry = Registry()
    registry.add(Pair)
    from flow.builtins import STAGES

    for stage in STAGES:
        registry.add(stage)
    tables = {"resources": {"a": {"type": "pair", "other": "b"}, "b": {"type": "pair", "other": "a"}},
              "stages": {"models": {"type": "openai.responses.retrieve", "routes": ["GET /x/{response_id}"],
                                    "exit": "models"}}}
    with pytest.raises(CompileError) as caught:
        compile_tables(tables, "loop", registry)
    text = str(caught.value)
    assert "resources refer to each other in a cycle: a → b → a" in text or "b → a → b" in text
    assert Pair("a", PairConfig(), Links()).stats() is None


def test_default_exit_and_shell_paths_are_checked() -> None:
    tables = default_tables()
    tables["server"]["default_exit"] = "prepare"
    tables["stages"]["models"]["routes"] = ["GET /health"]
    text = "\n".join(errors_of(tables))
    assert "server.default_exit: 'prepare' (chat.prepare) is not an exit stage" in text
    assert "stages.models.routes: /health is the server's own (health)" in text


def test_checking_a_graph_imports_no_mlx() -> None:
    code = ("import sys; from flow.builtins import compile_file; from viz import render_mermaid; "
            "render_mermaid(compile_file('graphs/default.toml')); "
            "import flow.cli.main; flow.cli.main.main(['stages']) if False else None; "
            "heavy = [m for m in ('mlx', 'mlx_lm', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    stages = subprocess.run([sys.executable, "-X", "importtime", "-m", "flow.cli", "stages"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert stages.returncode == 0 and "models.list" in stages.stdout
    assert " mlx" not in stages.stderr  # -X importtime lists every module imported, on stderr


def test_the_compiler_knows_no_stage_and_no_mlx() -> None:
    """The framework core stands alone: the compiler is handed a registry, it imports none."""
    code = ("import sys, flow.graph.compiler; "
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('stages', 'viz', 'mlx', 'mlx_lm') "
            "or m.startswith(('flow.serve', 'flow.resources', 'flow.builtins', 'flow.cli'))]; "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _top_level_imports(path: Path) -> set[str]:
    """Modules a file imports when it is imported: module level only (not TYPE_CHECKING, not functions)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                else ():
            if isinstance(sub, ast.Import):
                found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
                found.update(f"{sub.module}.{alias.name}" for alias in sub.names)
    return found


def test_no_import_cycle() -> None:
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for imported in _top_level_imports(path):
            if imported in modules and imported != name:
                graph.add_edge(name, imported)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, [" → ".join([*c, c[0]]) for c in cycles[:5]]
