"""The capture proxy's wire protocols: one adapter each, behind `WireProtocol`."""

from collectors.proxy.wire.anthropic_messages import AnthropicMessages
from collectors.proxy.wire.base import StreamWriter, WireProtocol, stream_body
from collectors.proxy.wire.openai_chat import OpenAIChat
from collectors.proxy.wire.openai_responses import OpenAIResponses

WIRES: tuple[WireProtocol, ...] = (OpenAIChat(), AnthropicMessages(), OpenAIResponses())

__all__ = ["WIRES", "AnthropicMessages", "OpenAIChat", "OpenAIResponses", "StreamWriter", "WireProtocol",
           "stream_body"]
