"""OpenAI's Batch API and the files it reads and writes: a team uploads a JSONL file
of requests, makes a batch of it, and the gateway runs each request through its own
route for the batch's endpoint, at a low priority, writing the answers to an output
file (and the errors to an error file) the team downloads.

    store.py    BatchStore: files and batches per team, in memory or in Redis (shared
                by the replicas), a line recorded and a status changed in one step
    lines.py    read_lines: a batch's input file into its requests, or the errors
                that fail it
    runner.py   BatchRunner: the runs: lines sent through the routes in process,
                retried when refused for "later", cancel, expiry, resumed by another
                replica when the one running a batch stops
    routes.py   the /v1/files and /v1/batches routes
    anthropic.py  Anthropic's Message Batches (/v1/messages/batches) on the same runs:
                its requests a hidden input file, its results in Anthropic's shapes
"""
