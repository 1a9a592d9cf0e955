"""Graph compilation: every planted error reported in one pass, with key paths and hints."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import networkx as nx
import pytest

from flow.builtins import compile_file
from flow.cli.main import main as cli_main
from flow.graph.compiled import CompileError
from flow.graph.compiler import compatible
from protocols.ir import Generation, GenerationStarted, StreamEvent, TextDelta, TokenChunk

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"

BROKEN = textwrap.dedent("""
    name = "broken"

    [resources.model]
    type = "model"
    path = "tiny:tiny-qwen3"
    max_bacth = 4

    [stages.entry]
    type = "openai.chat.decode"
    routes = ["POST /v1/chat/completions"]
    exit = "out"

    [stages.prepare]
    type = "chat.prepar"
    inputs = ["entry"]

    [stages.generate]
    type = "generate"
    inputs = ["entyr"]
    modles = ["model"]

    [stages.process]
    type = "chat.process"
    inputs = ["entry"]

    [stages.out]
    type = "openai.chat.format"
    inputs = ["process"]

    [stages.loop_a]
    type = "chat.process"
    inputs = ["loop_b"]

    [stages.loop_b]
    type = "chat.process"
    inputs = ["loop_a"]

    [stages.model]
    type = "generate"
    models = ["nothing"]
""")


def test_all_errors_in_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(BROKEN)
    with pytest.raises(CompileError) as info:
        compile_file(path)
    errors = {e.path: e for e in info.value.errors}
    text = str(info.value)
    # misspelled key -> the closest valid key
    assert "did you mean 'max_batch'" in (errors["resources.model.max_bacth"].hint or "")
    # unknown type -> closest known type
    assert "chat.prepare" in (errors["stages.prepare.type"].hint or "")
    # dangling input -> the ids that exist
    assert "dangling input" in errors["stages.generate.inputs[0]"].message
    assert "entry" in (errors["stages.generate.inputs[0]"].hint or "")
    assert "did you mean 'models'" in (errors["stages.generate.modles"].hint or "")
    # type mismatch names both port types
    mismatch = errors["stages.process.inputs[0]"].message
    assert "type mismatch" in mismatch and "ChatRequest" in mismatch and "Generation" in mismatch
    # cycle with its path
    assert re.search(r"cycle: loop_(a|b) → loop_(a|b) → loop_(a|b)", text)
    # resource reference errors and duplicate ids
    assert "no resource named 'nothing'" in errors["stages.model.models[0]"].message
    assert "duplicate id" in errors["stages.model"].message
    assert len(info.value.errors) >= 9


def test_route_errors(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(textwrap.dedent("""
        [resources.model]
        type = "model"
        path = "tiny:tiny-qwen3"
        [stages.entry]
        type = "openai.chat.decode"
        routes = ["FETCH chat"]
        [stages.other]
        type = "openai.chat.decode"
        exit = "prepare"
        [stages.prepare]
        type = "chat.prepare"
        inputs = ["entry"]
        routes = ["POST /x"]
    """))
    with pytest.raises(CompileError) as info:
        compile_file(path)
    paths = {e.path: e.message for e in info.value.errors}
    assert "not a route" in paths["stages.entry.routes[0]"]
    assert "missing exit" in paths["stages.entry.exit"]
    assert "missing route" in paths["stages.other.routes"]
    assert "only entry stages" in paths["stages.prepare.routes"]


def test_extends_and_drop(tmp_path: Path) -> None:
    child = tmp_path / "child.toml"
    child.write_text(f'extends = "{GRAPHS / "default.toml"}"\n[resources.model]\nmax_batch = 3\n')
    graph = compile_file(child)
    assert graph.resources["model"].config.max_batch == 3  # type: ignore[attr-defined]
    assert graph.resources["model"].config.path == "mlx-community/Qwen3-0.6B-4bit"  # type: ignore[attr-defined]
    dropped = tmp_path / "dropped.toml"
    dropped.write_text(f'extends = "{GRAPHS / "default.toml"}"\ndrop = ["nothing_here"]\n')
    with pytest.raises(CompileError, match="nothing named 'nothing_here'"):
        compile_file(dropped)


def test_default_graph_routes_run_only_their_path() -> None:
    graph = compile_file(GRAPHS / "default.toml")
    route = next(r for r in graph.routes if r.path == "/v1/chat/completions")
    assert route.stages == ("openai_chat", "prepare", "generate", "process", "openai_chat_out")
    assert nx.is_directed_acyclic_graph(graph.graph)


def test_compatibility_rule() -> None:
    assert compatible(TokenChunk, Generation)
    assert compatible(Generation, Generation)
    assert not compatible(Generation, TokenChunk)
    assert compatible(TextDelta, StreamEvent)
    assert not compatible(GenerationStarted, StreamEvent)


def test_flow_check_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text(BROKEN)
    assert cli_main(["check", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "stages.prepare.type" in err and "resources.model.max_bacth" in err and "cycle" in err
    assert cli_main(["check", str(GRAPHS / "default.toml"), str(GRAPHS / "demo.toml")]) == 0


def test_viz_mermaid_and_dot_name_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    graph = compile_file(GRAPHS / "default.toml")
    assert cli_main(["viz", str(GRAPHS / "default.toml"), "--format", "mermaid"]) == 0
    mermaid = capsys.readouterr().out
    assert mermaid.startswith("flowchart LR\n")
    node_re = re.compile(r'^    (\w+)(\(\["|\["|\[\(")(.+?)("\]\)|"\]|"\)\])$')
    edge_re = re.compile(r"^    (\w+) (-->|-.->)(\|[^|]*\|)? (\w+)$")
    nodes = set()
    for line in mermaid.splitlines()[1:]:
        if line.startswith("    classDef") or line.startswith("    class "):
            continue
        if m := node_re.match(line):
            nodes.add(m.group(1))
        else:
            m = edge_re.match(line)
            assert m, f"not valid mermaid: {line!r}"
            assert m.group(1) in nodes and m.group(4) in nodes
    for sid, stage in graph.stages.items():
        assert f"{sid}<br/>[{stage.type_name}]" in mermaid
    assert cli_main(["viz", str(GRAPHS / "default.toml"), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith('digraph "default" {') and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for sid in graph.stages:
        assert f"stage_{sid} [label=" in dot
    assert "label=\"Generation\"" in dot
