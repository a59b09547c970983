"""The capture proxy's wire protocols: one adapter each, behind `WireProtocol`."""

from collectors.proxy.wire.anthropic_messages import AnthropicMessages
from collectors.proxy.wire.base import WireProtocol
from collectors.proxy.wire.openai_chat import OpenAIChat

WIRES: tuple[WireProtocol, ...] = (OpenAIChat(), AnthropicMessages())

__all__ = ["WIRES", "AnthropicMessages", "OpenAIChat", "WireProtocol"]
