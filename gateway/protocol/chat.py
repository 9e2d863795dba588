"""Our messages and tools in the shapes chat templates (and OpenAI-compatible
servers) take them: OpenAI's message and tool dictionaries.

One function each, shared by every engine and upstream that renders a chat
template or sends a conversation on, so a conversation with images or tool
calls reads the same to every model. The standard library's json only: workers
import this in an engine's own environment (vLLM's), without the gateway's.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocol.types import ContentPart, Message, Tool


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: parsed JSON when it parses."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def part_dict(part: ContentPart) -> dict[str, Any]:
    """One content part as OpenAI writes it (a sound as OpenAI's `input_audio` or vLLM's
    `audio_url`, a video as vLLM's `video_url`, as it came), with its `detail` when it
    had one."""
    kind = part.type
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "input_audio":
        return {"type": kind, kind: {"data": part.data, "format": part.format}}
    if kind == "audio_url" or kind == "video_url":
        return {"type": kind, kind: {"url": part.url}}
    image: dict[str, Any] = {"url": part.url}
    if part.detail:
        image["detail"] = part.detail
    return {"type": "image_url", "image_url": image}


def message_dict(message: Message, *, parsed_arguments: bool = False) -> dict[str, Any]:
    """One message as OpenAI writes it. Content is a string, or a list of parts when
    the message holds images, sounds or videos: the client's parts in their order when
    it sent them (`parts`), else images first, then the text.
    Tool calls' arguments stay JSON text (OpenAI's shape) unless
    `parsed_arguments`, which chat templates such as Qwen's and Hermes' want; an
    assistant's reasoning is `reasoning` (vLLM's), and for them `reasoning_content` too,
    as vLLM hands it to a template."""
    content: Any = message.content
    if message.parts:
        content = [part_dict(part) for part in message.parts]
    elif message.images:
        content = [{"type": "image_url", "image_url": {"url": url}} for url in message.images]
        if message.content:
            content.append({"type": "text", "text": message.content})
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": _arguments(call.arguments) if parsed_arguments else call.arguments,
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    if message.reasoning:
        out["reasoning"] = message.reasoning
        if parsed_arguments:  # for a template: also by the name Qwen's templates read
            out["reasoning_content"] = message.reasoning
    return out


def tool_dict(tool: Tool) -> dict[str, Any]:
    """One tool as OpenAI writes it (`{"type": "function", "function": {...}}`)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = json.loads(tool.parameters)
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}
