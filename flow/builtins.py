"""The built-in stage and resource types, registered in the default registry.

The compiler and the CLI import this module; the registry itself imports no
stage or resource module, so there is no import cycle. Nothing here imports
MLX: compiling, checking and drawing a graph stays fast (MLX loads with the
first model).
"""

from __future__ import annotations

from functools import cache

from flow.agent_store import AgentStore
from flow.downloads import DownloadsResource
from flow.pool import ModelPool
from flow.prefix import PrefixCacheResource
from flow.registry import Registry
from flow.resources import ModelResource
from flow.response_store import ResponseStore
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
from stages.rerank import Rerank, RerankDecode, RerankFormat
from stages.speech import SpeechDecode, SpeechFormat, Synthesize
from stages.transcription import Transcribe, TranscriptionsDecode, TranscriptionsFormat, TranslationsDecode
from stages.generate import Generate
from stages.library import DownloadsManage, FitCheck, LibraryList
from stages.adapters import AdaptersManage
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
