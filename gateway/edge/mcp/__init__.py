"""Remote MCP servers that a request lets the model call, and the answer's turns around
the calls, for the APIs that serve them (the Responses API's `mcp` tools; Anthropic's
MCP connector).

servers.py   a server and what may be done with it; its tools listed and called through
             the MCP SDK (imported on first use), bounded; the operator's allowed URLs
turns.py     an answer of several turns of the model with the calls between them, as
             one call for the route's event pump; the plan made before the first turn
routes.py    what a generation route does before such an answer: the plan, in its slot
"""
