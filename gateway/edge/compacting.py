"""A conversation summarized by its own model, so that it goes on from the summary:
the prompt that asks for the summary, and the message a conversation goes on from.
One wording for every API that compacts (Anthropic's compaction:
gateway/edge/anthropic/compaction.py; the Responses API's `/v1/responses/compact`:
gateway/edge/responses/compact.py), so that a summary reads the same to the model
whichever API made it.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.protocol.types import GenerateRequest, Message

#: What the model is asked after the conversation, unless the client gives its own.
SUMMARIZE = (
    "Stop here and write a summary of this whole conversation, in place of it, so that "
    "the work can go on from the summary alone: what the user asked for and still wants, "
    "the decisions taken and why, the state of the work (files, code, commands and their "
    "results that still matter, with the exact names and values), what failed and how it "
    "was fixed, and what is left to do next. Write only the summary."
)
#: How the summary opens the conversation that goes on from it.
SUMMARY_FRAME = "The conversation so far, summarized:\n\n"


def summary_message(summary: str) -> Message:
    """The user message a conversation goes on from, after its summary."""
    return Message("user", SUMMARY_FRAME + summary)


def summarizing(request: GenerateRequest, instructions: str = SUMMARIZE) -> GenerateRequest:
    """The turn that writes the summary: the prompt as it came and `instructions` after
    it (in the last user message, when that is text alone: the roles still alternate),
    so that the engine's prefix cache holds all but that message; no tool to call, no
    format nor stop string of the answer's."""
    messages = list(request.messages or ())
    last = messages[-1] if messages else None
    if last is not None and last.role == "user" and not last.images and not last.parts:
        messages[-1] = replace(last, content=f"{last.content}\n\n{instructions}")
    else:
        messages.append(Message("user", instructions))
    choice = "none" if request.tools else request.tool_choice
    return replace(
        request, messages=tuple(messages), tool_choice=choice, response_format=None, stop=()
    )
