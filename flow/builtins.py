"""The composition root: the built-in stage and resource types in the default registry, and the compiler
bound to it.

The only module that imports every stage and resource type. The compiler (``flow.graph``) knows none of
them: it compiles against the registry it is given, and ``compile_tables``, ``compile_file`` and
``compile_spec`` here give it this one. The CLI, the tests and the benchmarks compile through here. Nothing
here imports MLX: compiling, checking and drawing a graph stays fast (MLX loads with the first model).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from flow.graph import compiler
from flow.graph.compiled import CompiledGraph
from flow.graph.registry import Registry
from flow.graph.spec import GraphSpec
from flow.resources.agent_store import AgentStore
from flow.resources.downloads import DownloadsResource
from flow.resources.model import ModelResource
from flow.resources.pool import ModelPool
from flow.resources.prefix_cache import PrefixCacheResource
from flow.resources.response_store import ResponseStore
from stages.adapters import AdaptersManage
from stages.agents import AgentsGenerateDecode, AgentsGenerateFormat, AgentsManage
from stages.anthropic import (
    AnthropicCountTokensDecode,
    AnthropicCountTokensFormat,
    AnthropicMessagesDecode,
    AnthropicMessagesFormat,
)
from stages.audio import VoicesList
from stages.chat import ChatPrepare, ChatProcess
from stages.echo import EchoGenerate
from stages.embeddings import Embed, EmbeddingsDecode, EmbeddingsFormat
from stages.generate import Generate
from stages.library import DownloadsManage, FitCheck, LibraryList
from stages.models import ModelsList
from stages.ollama import (
    OllamaChatDecode,
    OllamaEmbedDecode,
    OllamaEmbedFormat,
    OllamaFormat,
    OllamaGenerateDecode,
    OllamaModels,
)
from stages.openai_chat import OpenAIChatDecode, OpenAIChatFormat
from stages.openai_completions import OpenAICompletionsDecode, OpenAICompletionsFormat
from stages.openai_responses import OpenAIResponsesDecode, OpenAIResponsesFormat, OpenAIResponsesRetrieve
from stages.rerank import Rerank, RerankDecode, RerankFormat
from stages.speech import SpeechDecode, SpeechFormat, Synthesize
from stages.transcription import Transcribe, TranscriptionsDecode, TranscriptionsFormat, TranslationsDecode
from viz.console import ConsoleGraph, ConsolePage

STAGES = (
    OpenAIChatDecode, OpenAIChatFormat,
    OpenAIResponsesDecode, OpenAIResponsesFormat, OpenAIResponsesRetrieve,
    OpenAICompletionsDecode, OpenAICompletionsFormat,
    AnthropicMessagesDecode, AnthropicMessagesFormat, AnthropicCountTokensDecode, AnthropicCountTokensFormat,
    AgentsManage, AgentsGenerateDecode, AgentsGenerateFormat,
    OllamaChatDecode, OllamaGenerateDecode, OllamaFormat, OllamaModels, OllamaEmbedDecode, OllamaEmbedFormat,
    ModelsList, AdaptersManage,
    EmbeddingsDecode, Embed, EmbeddingsFormat, RerankDecode, Rerank, RerankFormat,
    TranscriptionsDecode, TranslationsDecode, Transcribe, TranscriptionsFormat,
    SpeechDecode, Synthesize, SpeechFormat, VoicesList,
    ChatPrepare, Generate, EchoGenerate, ChatProcess,
    ConsolePage, ConsoleGraph, LibraryList, FitCheck, DownloadsManage,
)
RESOURCES = (ModelResource, ModelPool, PrefixCacheResource, ResponseStore, AgentStore, DownloadsResource)


@cache
def default_registry() -> Registry:
    """The built-ins and the installed plugins (loaded once per process)."""
    registry = Registry()
    for cls in (*STAGES, *RESOURCES):
        registry.add(cls)
    registry.load_plugins()
    return registry


def compile_spec(spec: GraphSpec, source: str = "", registry: Registry | None = None) -> CompiledGraph:
    """``spec`` compiled against the built-ins (or ``registry``)."""
    return compiler.compile_spec(spec, source, registry or default_registry())


def compile_tables(tables: dict[str, Any], source: str = "", registry: Registry | None = None) -> CompiledGraph:
    """Graph tables (as a TOML file reads) compiled against the built-ins (or ``registry``)."""
    return compiler.compile_tables(tables, source, registry or default_registry())


def compile_file(path: str | Path, registry: Registry | None = None) -> CompiledGraph:
    """A graph file, read, merged and compiled against the built-ins (or ``registry``); raises
    :class:`~flow.graph.compiled.CompileError` with every problem."""
    return compiler.compile_file(path, registry or default_registry())
