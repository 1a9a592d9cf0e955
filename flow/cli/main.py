"""``flow``: serve, check, viz, stages, probe, models, fit, pull, families, import, bench, launch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from flow.builtins import compile_file, compile_tables
from flow.catalog.bundled import resolve_graph_path
from flow.catalog.local_models import served_name
from flow.graph.compiled import CompiledGraph, CompileError, GraphError
from flow.graph.spec import SpecError, graph_files, load_tables

if TYPE_CHECKING:
    from pydantic import BaseModel

    from flow.catalog.capabilities import Capabilities
    from flow.catalog.families import Family
    from flow.catalog.local_models import LocalModel
    from flow.graph.resource import Reference


def _load_graph(path: str, *, model: str | None = None, distributed: dict[str, Any] | None = None) -> CompiledGraph:
    """Compile a graph file, with ``--model`` replacing the first model resource's path and name, and
    ``-n``/``--hostfile`` (``distributed``) making it a distributed model."""
    from flow.resources.model import is_pattern

    if model is None and distributed is None:
        return compile_file(path)
    try:
        tables = load_tables(Path(path))
    except SpecError as exc:
        raise CompileError([GraphError(exc.path, exc.message)], path) from None
    models = [rid for rid, t in tables.get("resources", {}).items() if t.get("type") == "model"]
    if not models:
        flag = "--model" if model is not None else "-n/--hostfile"
        raise CompileError([GraphError("resources", f"{flag} was given but the graph has no model resource",
                                       'add [resources.model] with type = "model"')], path)
    table: dict[str, Any] = tables["resources"][models[0]]
    if distributed is not None:
        table["distributed"] = {**table.get("distributed", {}), **distributed}
        if "ranks" in distributed:
            table["distributed"].pop("hostfile", None)
        if "hostfile" in distributed:
            table["distributed"].pop("ranks", None)
    if model is None:
        return compile_tables(tables, path)
    table["path"] = model
    table["name"] = served_name(model)
    table.pop("fallbacks", None)  # the graph's other sources were for the model it named
    # The old model's own name no longer fits; generic ids (default, glob patterns) still do.
    table["aliases"] = [a for a in table.get("aliases", []) if a == "default" or is_pattern(a)]
    return compile_tables(tables, path)


def _distributed_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    """``-n``, ``--hostfile``, ``--backend``, ``--parallel``: the first model's ``distributed`` table."""
    flags: dict[str, Any] = {}
    if args.ranks is not None:
        flags["ranks"] = args.ranks
    if args.hostfile is not None:
        flags["hostfile"] = str(Path(args.hostfile).expanduser().resolve())
    if args.backend is not None:
        flags["backend"] = args.backend
    if args.parallel is not None:
        flags["parallel"] = args.parallel
    if args.restart:
        flags["restart"] = True
    return flags or None


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from flow.cli import blas
    from flow.serve.lifecycle import serve
    from flow.serve.server import FlowServer, first_error
    from runtime.errors import ModelNotAvailable

    path = str(resolve_graph_path(args.graph))

    def load() -> CompiledGraph:
        """The graph as served: the file, with the command line's overrides (again at each reload)."""
        loaded = _load_graph(path, model=args.model, distributed=_distributed_flags(args))
        if args.api_key is not None:
            loaded.spec.server.api_key = args.api_key
        return loaded

    graph = load()
    host = args.host or graph.spec.server.host
    port = args.port if args.port is not None else graph.spec.server.port
    blas.advise()
    server = FlowServer(graph, loader=load)
    watched = (lambda: graph_files(Path(path))) if args.watch else None

    async def main() -> None:
        async def started_banner(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            await serve(server, host, port, watch_files=watched, task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(started_banner)
            print(f"flow: serving graph {graph.name!r} on {', '.join(binds)}", file=sys.stderr)
            for m in server.models:
                loaded = m.loaded or m.embedding or m.audio
                what = ("not loaded yet" if loaded is None else
                        "SMOKE-TEST MODEL: random weights, gibberish output" if loaded.smoke_test else m.source)
                print(f"flow: model {m.name} ({m.kind or 'kind unknown'}): {what}", file=sys.stderr)
            for route in graph.routes:
                print(f"flow:   {route.method} {route.path}  ({' -> '.join(route.stages)})", file=sys.stderr)

    try:
        trio.run(main)
        if server.restart:  # drained after SIGUSR1: the same command again, in this process (its PID stays)
            print("flow: restarting", file=sys.stderr)
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except KeyboardInterrupt:
        return 0
    except BaseException as raw:  # noqa: BLE001 - turned into a message below
        exc = first_error(raw)
        if isinstance(exc, ModelNotAvailable):
            print(f"flow: cannot load the model.\n{exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError) and "address" in str(exc).lower():
            print(f"flow: cannot listen on {host}:{port}: {exc}. Use --port to pick another port.", file=sys.stderr)
            return 2
        if isinstance(exc, KeyboardInterrupt):
            return 0
        raise
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    failed = False
    for path in args.graphs:
        try:
            graph = compile_file(resolve_graph_path(path))
        except CompileError as exc:
            print(exc, file=sys.stderr)
            failed = True
            continue
        print(f"{path}: ok — {len(graph.stages)} stages, {len(graph.resources)} resources, "
              f"{len(graph.routes)} routes")
    return 1 if failed else 0


def cmd_viz(args: argparse.Namespace) -> int:
    from viz import render_dot, render_html, render_mermaid, render_svg_file

    graph = compile_file(resolve_graph_path(args.graph))
    renderers = {"mermaid": render_mermaid, "dot": render_dot, "svg": render_svg_file, "html": render_html}
    text = renderers[args.format](graph)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _config_keys(config: type[BaseModel], references: Mapping[str, Reference]) -> list[str]:
    """One line per config key: type, default, what it is; references say what they name."""
    from flow.graph.compiler import type_label

    lines = []
    for key, field in config.model_fields.items():
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        about = references[key].describe() if key in references else field.description or ""
        lines.append(f"    {key}: {type_label(field.annotation)} ({default}) {about}".rstrip())
    return lines


def cmd_stages(args: argparse.Namespace) -> int:
    from flow.builtins import default_registry
    from flow.graph.compiler import type_label
    from flow.graph.stage import EntryStage, ExitStage

    registry = default_registry()
    for name, cls in registry.stages.items():
        print(f"{name}: {type_label(cls.input_type)} -> {type_label(cls.output_type)}")
        if cls.description:
            print(f"    {cls.description}")
        if issubclass(cls, EntryStage):
            print(f"    entry: takes routes and exit; hands its exit {cls.context_type.__name__}")
        if issubclass(cls, ExitStage):
            print(f"    exit: reads {cls.reads_context.__name__}")
        print("\n".join(_config_keys(cls.Config, cls.references)))
    print()
    for name, rcls in registry.resources.items():
        print(f"[resources.*] type = {name!r}: {rcls.description}")
        print("\n".join(_config_keys(rcls.Config, rcls.references)))
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from flow.catalog.capabilities import CapabilityStore
    from flow.catalog.families import FamilyError
    from flow.cli import blas
    from flow.cli.probe import probe
    from runtime.errors import ModelNotAvailable

    store = CapabilityStore(Path(args.db) if args.db else None)
    if args.list:
        for caps in store.all():
            if caps.kind == "embeddings":
                task = ("rerank (cross-encoder)" if caps.profile.get("task") == "score" else
                        f"embeddings, {caps.profile.get('dims')} dims, {caps.profile.get('pooling')} pooling")
                print(f"{caps.model}: {task}, max input {caps.context_length}")
                continue
            print(f"{caps.model}: {'vision, ' if caps.kind == 'vision' else ''}family {caps.family}, tools {caps.tool_delivery}/{caps.tool_parser}"
                  f"{' (verified)' if caps.tool_calls_verified else ''}, reasoning {caps.reasoning_parser}, "
                  f"thinking toggle {'yes' if caps.thinking else 'no'}, context {caps.context_length}")
        return 0
    if not args.model:
        print("flow probe: name a model (directory or hub id), or use --list", file=sys.stderr)
        return 2
    blas.advise()
    try:
        caps = probe(args.model, family_choice=args.family, max_tokens=args.max_tokens, store=store)
    except ModelNotAvailable as exc:
        print(f"flow: cannot load the model.\n{exc}", file=sys.stderr)
        return 2
    except FamilyError as exc:
        print(f"flow probe: {exc}", file=sys.stderr)
        return 2
    smoke = " (SMOKE-TEST MODEL: random weights, its answers mean nothing)" if caps.evidence.get("smoke_test") else ""
    print(f"model:           {caps.model}{smoke}")
    if caps.kind == "embeddings":
        _print_embedding_capabilities(caps)
        print(f"stored in:       {store.path}")
        return 0
    print(f"family:          {caps.family} (detected {caps.evidence['detected_family']})")
    print(f"tool delivery:   {caps.tool_delivery}")
    print(f"tool parser:     {caps.tool_parser} ({'a generated call parsed' if caps.tool_calls_verified else 'no call seen in the probe answer; family default kept'})")
    print(f"reasoning:       {caps.reasoning_parser}; thinking toggle: {'yes' if caps.thinking else 'no'}")
    print(f"context length:  {caps.context_length}")
    if caps.kind == "vision":
        vision = caps.profile
        tokens = ", ".join(f"{size}: {n}" for size, n in vision.get("image_tokens", {}).items())
        print(f"images:          {'several per message' if vision.get('multi_image') else 'one per message'}; "
              f"tokens per image {tokens}; at most {vision.get('max_images') or '(not declared)'} per prompt")
    print(f"stored in:       {store.path}")
    return 0


def _print_embedding_capabilities(caps: Capabilities) -> None:
    profile = caps.profile
    if profile.get("task") == "score":
        print(f"task:            rerank (a cross-encoder); pair scores {caps.evidence.get('pair_scores')}")
    else:
        sizes = profile.get("matryoshka")
        matryoshka = ("none" if not sizes else f"any from {sizes['smallest']}" if sizes.get("smallest")
                      else ", ".join(str(n) for n in sizes["sizes"]))
        print(f"task:            embeddings, {profile.get('dims')} dimensions, "
              f"{'unit vectors' if profile.get('normalized') else 'NOT unit vectors'}")
        print(f"pooling:         {profile.get('pooling')}")
        print(f"matryoshka:      {matryoshka}")
        print(f"similarity:      {caps.evidence.get('similarity')}")
    print(f"max input:       {caps.context_length} tokens")


def _size(n: int) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def _model_row(m: LocalModel) -> list[str]:
    caps = m.capabilities
    model_type = (m.model_type or "?") + (f" {m.quantization_bits}-bit" if m.quantization_bits else "")
    verified = caps is not None and caps.tool_calls_verified
    tools = f"{m.tool_delivery}/{m.tool_parser}" + (" (verified)" if verified else "")
    reasoning = m.reasoning_parser + (", thinking toggle" if caps is not None and caps.thinking else "")
    if m.profile is not None:  # an embedding model: its vectors instead of tools and reasoning
        what = "rerank scores" if m.profile["task"] == "score" else f"{m.profile['dims']} dims, {m.profile['pooling']}"
        return [m.id + (" (smoke test)" if m.smoke_test else ""), m.kind, model_type, _size(m.size_bytes),
                "-", what, "-", str(m.profile["max_length"])]
    return [m.id + (" (smoke test)" if m.smoke_test else ""), m.kind, model_type, _size(m.size_bytes),
            f"{m.family} ({m.family_source})", tools, reasoning, str(caps.context_length) if caps else "-"]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _no_models_message() -> str:
    from flow.catalog.local_models import hub_cache_dir, smoke_test_root

    return (f"flow models: no local models found (looked in the Hugging Face hub cache {hub_cache_dir()}, "
            f"$FLOW_MODEL_PATH{'' if os.environ.get('FLOW_MODEL_PATH') else ' (not set)'}, "
            f"and the smoke-test builds in {smoke_test_root()}).\n"
            "To get one: `flow serve graphs/default.toml` downloads the default model on first start; "
            "or set FLOW_MODEL_PATH to directories of MLX models (config.json + *.safetensors), "
            "or name them: `flow models DIR ...`.")


def cmd_models(args: argparse.Namespace) -> int:
    import json

    from flow.catalog.local_models import find_local_models

    missing = [d for d in args.dirs if not Path(d).expanduser().is_dir()]
    if missing:
        print(f"flow models: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    models = find_local_models([Path(d).expanduser() for d in args.dirs])
    if args.json:
        print(json.dumps([m.to_json() for m in models], indent=2))
    elif models:
        _print_table([["MODEL", "KIND", "TYPE", "SIZE", "FAMILY", "TOOLS|VECTORS", "REASONING", "CONTEXT"],
                      *(_model_row(m) for m in models)])
    if not models:
        print(_no_models_message(), file=sys.stderr if args.json else sys.stdout)
    elif not args.json and any(m.family_source == "detected" for m in models):
        print("\ndetected: chosen from config.json, the name and the chat template; "
              "`flow probe MODEL` checks and remembers how a model really takes tools and thinking.")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    import json

    from flow.catalog.fit import assess, text_report
    from runtime.errors import ModelNotAvailable
    from runtime.models import resolve_model_path

    try:  # never downloads: fit reads the files already here
        path = resolve_model_path(os.path.expanduser(args.model), offline=True)
        fit = assess(args.model, path, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk)
    except (ModelNotAvailable, ValueError) as exc:
        print(f"flow fit: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(fit.json(), indent=2) + "\n" if args.json else text_report(fit))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    import threading

    from flow.resources.downloads import Download, Offline, Progress, progress_line, pull

    download = Download(args.repo, args.revision)
    outcome: dict[str, BaseException | Path] = {}

    def work() -> None:
        try:
            outcome["path"] = pull(download, Progress(download))
        except BaseException as exc:  # shown below, after the progress line
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="flow-pull", daemon=True)
    worker.start()
    tty = sys.stderr.isatty()
    while worker.is_alive():
        worker.join(0.25 if tty else 5)
        if download.state == "running":
            sys.stderr.write(("\r\033[K" if tty else "") + progress_line(download) + ("" if tty else "\n"))
            sys.stderr.flush()
    if tty:
        sys.stderr.write("\r\033[K")
    error = outcome.get("error")
    if error is not None:
        print(f"flow pull: {error if isinstance(error, Offline) else download.error}", file=sys.stderr)
        return 1
    print(f"{args.repo}: {download.files_total} files, {download.total_bytes:,} bytes in {outcome['path']}")
    return 0


def _family_json(family: Family) -> dict[str, Any]:
    return {"name": family.name, "description": family.description, "extends": family.extends,
            "detect": family.detect.model_dump(),
            "tools": family.tools.model_dump(exclude={"prompt", "call_format"}),
            "reasoning": family.reasoning.model_dump(),
            "stop_tokens": family.stop_tokens}


def _options(options: Mapping[str, Any]) -> str:
    return f" ({'; '.join(f'{k} = {v!r}' for k, v in options.items())})" if options else ""


def cmd_families(args: argparse.Namespace) -> int:
    import json

    from flow.catalog.families import FamilyError, builtin_families, family_dirs

    try:
        families = builtin_families()
    except FamilyError as exc:
        print(f"flow families: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([_family_json(f) for f in families.values()], indent=2))
        return 0
    for family in families.values():
        d = family.detect
        print(f"{family.name}: {family.description or '(no description)'}")
        rules = [("model_type", d.model_types), ("architectures", d.architectures),
                 ("name (regex)", d.name_patterns), ("template has", d.template_contains)]
        for label, values in rules:
            if values:
                print(f"    {label + ':':<15}{', '.join(values)}")
        if d.template_contains:
            print(f"    {'':<15}(a chat template without {'it' if len(d.template_contains) == 1 else 'them all'} "
                  "rules this family out)")
        if d.template_required:
            print(f"    {'':<15}(only a model whose chat template is known: without one, its base's family decides)")
        if d.priority:
            print(f"    {'priority:':<15}{d.priority} (breaks ties)")
        if not any(values for _, values in rules):
            how = "the fallback when nothing matches" if family.name == "default" else "only when named"
            print(f"    {'detected:':<15}never; {how}")
        tools, reasoning = family.tools, family.reasoning
        loose = "; calls without markup taken too" if tools.loose_calls else ""
        print(f"    {'tools:':<15}{tools.parser} parser{_options(tools.options)}, delivered by {tools.delivery}{loose}"
              if tools.parser != "null" else f"    {'tools:':<15}none (null parser)")
        toggle = f", thinking toggle {reasoning.toggle}" if reasoning.toggle else ""
        effort = f", reasoning effort as {reasoning.effort}" if reasoning.effort else ""
        effort += f", thinking budget as {reasoning.budget}" if reasoning.budget else ""
        print(f"    {'reasoning:':<15}{reasoning.parser} parser{_options(reasoning.options)}{toggle}{effort}"
              if reasoning.parser != "null" else f"    {'reasoning:':<15}none (null parser)")
        if family.stop_tokens:
            print(f"    {'stops:':<15}{', '.join(family.stop_tokens)}")
    print(f"\nfrom {', '.join(str(d) for d in family_dirs())} ($FLOW_FAMILY_PATH adds directories); "
          "`flow models` shows which family each local model gets.")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from runtime.gguf_import import GGUFImportError, import_gguf

    try:
        result = import_gguf(args.file, dtype=args.dtype, out=Path(args.out) if args.out else None)
    except GGUFImportError as exc:
        print(f"flow import: {exc}", file=sys.stderr)
        return 1
    done = "already imported" if result.reused else f"imported in {result.seconds:.0f} s"
    print(f"{done} ({result.dtype}): {result.path}")
    print(f"serve it: flow serve default --model {result.path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from flow.cli.bench import main as bench_main

    return bench_main(args.bench_args)


def cmd_launch(args: argparse.Namespace) -> int:
    from flow.cli.launch import main as launch_main

    return launch_main(args.launch_args)


def cmd_cache(args: argparse.Namespace) -> int:
    from flow.cli.cache_verify import main as verify_main

    return verify_main(args.cache_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flow", description="A local inference server for MLX models.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a graph over HTTP")
    p.add_argument("graph", help="graph file, or a bundled graph's name (works from any directory): "
                                 "`flow serve demo` (tiny smoke-test model), `flow serve default`")
    p.add_argument("--model", help="local model directory, GGUF file (imported once) or Hugging Face repo id "
                                   "(replaces the graph's model)")
    p.add_argument("--host", help="address to listen on (default: the graph's, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: the graph's, 8080)")
    p.add_argument("--api-key", default=os.environ.get("FLOW_API_KEY") or None,
                   help="require this key on every API route (x-api-key or Authorization: Bearer); "
                        "default: $FLOW_API_KEY, else the graph's server.api_key, else none")
    p.add_argument("--watch", action="store_true",
                   help="reload the graph when its file (or one it extends) changes; SIGHUP and "
                        "POST /admin/reload reload it too")
    p.add_argument("-n", "--ranks", type=int, help="serve the model across N processes on this machine "
                                                   "(mlx.distributed, ring over loopback); rank 0 is this one")
    p.add_argument("--hostfile", help="serve the model across the hosts of this mlx.launch hostfile")
    p.add_argument("--backend", choices=["ring", "jaccl", "mpi", "nccl", "any"],
                   help="mx.distributed backend for -n/--hostfile (default ring)")
    p.add_argument("--parallel", choices=["tensor", "pipeline"],
                   help="tensor: each rank a slice of every layer (default); pipeline: each rank some layers")
    p.add_argument("--restart", action="store_true",
                   help="when a distributed model's group is lost, drain and start again (forming a new group)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("probe", help="find out how a model takes tools and thinking; remember it for serving")
    p.add_argument("model", nargs="?", help="local model directory, Hugging Face repo id, or tiny:PRESET")
    p.add_argument("--family", default="auto", help="family to start from (default: detect)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per probe answer (default 160)")
    p.add_argument("--db", help="capability database (default: the user data directory)")
    p.add_argument("--list", action="store_true", help="list what earlier probes recorded")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("models", help="list local models (hub cache, $FLOW_MODEL_PATH, DIRs) and their capabilities")
    p.add_argument("dirs", nargs="*", metavar="DIR",
                   help="more directories to search: model directories or directories of them")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("fit", help="will a local model fit here: memory, max safe context, predicted decode tok/s")
    p.add_argument("model", help="a local model: hub repo id in the cache, directory, or tiny:PRESET")
    p.add_argument("--max-batch", type=int, default=32, help="the engine's max_batch (logits memory)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill_chunk (activations)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub into its cache (again: only the files it lacks)")
    p.add_argument("repo", help="repository id, owner/name")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("families", help="list the model families flow knows: detection, tool and reasoning parsers")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of text")
    p.set_defaults(func=cmd_families)

    p = sub.add_parser("import", help="import a GGUF file (llama.cpp, Ollama, LM Studio) as an MLX model directory")
    p.add_argument("file", help="the .gguf file; for a split GGUF (x-00001-of-00003.gguf) any part")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16", "q4", "q8"], default="auto",
                   help="weights as float, or re-quantized by MLX to 4 or 8 bits (default auto: the file's own "
                        "precision class: float stays float, 5-8 bit becomes q8, 4 bit and less q4)")
    p.add_argument("--out", help="directory to write (default: the model cache, ~/.cache/flow/gguf/…)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("check", help="compile graph files and report every error")
    p.add_argument("graphs", nargs="+", help="graph files or bundled graph names (default, demo)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("viz", help="draw a graph as mermaid, DOT, SVG or a standalone HTML page")
    p.add_argument("graph", help="graph file or bundled graph name (default, demo)")
    p.add_argument("--format", choices=["mermaid", "dot", "svg", "html"], default="mermaid",
                   help="svg and html: the drawing the console (GET /) shows, without its live figures")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_viz)

    p = sub.add_parser("stages", help="list stage and resource types with ports and config keys")
    p.set_defaults(func=cmd_stages)

    p = sub.add_parser("bench", help="single-stream benchmark: raw mlx-lm vs the server (see --help)",
                       add_help=False)
    p.set_defaults(func=cmd_bench, bench_args=[])

    p = sub.add_parser("launch", help="run Claude Code, Codex or OpenCode on a flow server, configured for it "
                                      "(see --help)", add_help=False)
    p.set_defaults(func=cmd_launch, launch_args=[])

    p = sub.add_parser("cache", help="the prefix cache: `flow cache verify FILE` checks that a hit gives a "
                                     "conversation the same next token as a cold run (see --help)", add_help=False)
    p.add_argument("action", choices=["verify"])
    p.set_defaults(func=cmd_cache, cache_args=[])
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra  # flow bench has its own options (flow bench --help)
    elif args.command == "launch":
        args.launch_args = extra  # so has flow launch; and what follows its -- is the client's
    elif args.command == "cache":
        args.cache_args = extra  # flow cache verify's own options
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "bench", "cache") and argv is None:
        from flow.cli.blas import reexec_with_openblas

        reexec_with_openblas()
    try:
        return int(args.func(args))
    except CompileError as exc:
        print(exc, file=sys.stderr)
        return 1


def run() -> None:
    """The ``flow`` command: :func:`main`, then the process ends without the interpreter's teardown.

    Why: threads that ran MLX (the device thread, worker threads that built arrays) keep thread-local MLX
    state, and tearing that down while the interpreter finalizes can abort the process ("terminate called
    without an active exception", SIGABRT) after a clean stop — seen with ``flow serve`` on real models. By the
    time :func:`main` returns, everything flow owns is closed (the server's stop closes its stores and flushes
    the prefix cache's disk tier), so what is skipped is only that teardown; logs and output are flushed first.
    """
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End the process with ``code`` once logs and output are flushed, skipping the interpreter's teardown (see
    :func:`run`; scripts that ran MLX in threads, an embedded server's benchmarks, end the same way)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
