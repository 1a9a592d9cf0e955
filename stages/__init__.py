"""Built-in stage types; importing this package registers them."""

from stages import agents, anthropic, chat, echo, generate, openai_chat, openai_completions, openai_responses

__all__ = ["agents", "anthropic", "chat", "echo", "generate", "openai_chat", "openai_completions", "openai_responses"]
