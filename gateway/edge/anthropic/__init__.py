"""Anthropic's Messages API (`/v1/messages`), on the same request path as OpenAI's.

validation.py       a Messages body → our GenerateRequest, or a 400 naming the field
context_editing.py  `context_management`: what its edits clear, what the answer reports
compaction.py       compaction: the conversation summarized by the model, the turns it takes
tool_examples.py    a tool's `input_examples`: checked against its schema, shown to the model
mcp.py              the MCP connector: `mcp_servers`, their toolsets, the blocks sent back
                    (the servers and the answer's turns: gateway/edge/mcp)
encoding.py         the `message` object and Anthropic's named SSE events
errors.py           Anthropic's error shape and status codes, by one table from ours
count_tokens.py     /v1/messages/count_tokens, counted by the model's tokenizer
models.py           /v1/models in Anthropic's shape, for a request with `anthropic-version`
routes.py           the routes, in Anthropic's error shape
"""
