"""`furnace-gateway bench`: a load generator for any OpenAI-compatible endpoint.

Modules, one job each: `http` (a cheap keep-alive HTTP/1.1 client), `client` (one
OpenAI request measured), `workload` (prompts, bodies, arrival times), `runner`
(sending them at a rate and concurrency), `stats` (the figures, as vLLM's `bench
serve` defines them), `report` (text and JSON), `progress` (stderr), `command`
(the options).
"""
