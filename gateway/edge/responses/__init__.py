"""OpenAI's Responses API (`/v1/responses`), and its Conversations API (`/v1/conversations`).

params.py    a body → its checked options and input items, then our GenerateRequest
             (or a 400 naming the parameter)
encoding.py  the response object and its stream of events with sequence numbers
store.py     stored responses per team: Redis with `redis_url`, else bounded memory
routes.py    POST /v1/responses (the generation route with this API's parser and
             encoder), and GET/DELETE of stored responses and their input items
background.py  background mode: the POST answers `queued`, the run goes on in a task
             of its own; POST /v1/responses/{id}/cancel; a background stream resumed;
             and the routes, wired on one store (`responses_routes`)
replay.py    a streamed background response's events, kept (bounded) for resuming
shared_events.py  with `redis_url`, those events in Redis too (a Stream a response), so
             any replica sharing it resumes the stream
input_tokens.py  POST /v1/responses/input_tokens: a body's prompt counted, not answered
compact.py   POST /v1/responses/compact: a conversation's user messages and the model's
             summary of it, as a `compaction` item that stands for it when sent back
mcp.py       remote MCP servers as tools (`{"type": "mcp"}`): OpenAI's tool and items
             read, the calls approved (the servers and the turns: gateway/edge/mcp)
truncation.py  `truncation: "auto"`: items dropped from the conversation's beginning
             until the prompt fits the model's context, confirmed by counts
conversation_store.py  conversations and their items per team: Redis with `redis_url`,
             else bounded memory; appends in one step; `conversation_history`
conversations.py  /v1/conversations: create, retrieve, update, delete, and the items'
             list, add, retrieve, delete (a Responses turn's `conversation`: routes.py)
"""
