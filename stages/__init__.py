"""Built-in stage types; importing this package registers them."""

from stages import anthropic, chat, echo, generate, openai_chat, openai_completions, openai_responses

__all__ = ["anthropic", "chat", "echo", "generate", "openai_chat", "openai_completions", "openai_responses"]
