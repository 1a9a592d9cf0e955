"""Built-in stage types; importing this package registers them."""

from stages import chat, generate, openai_chat

__all__ = ["chat", "generate", "openai_chat"]
