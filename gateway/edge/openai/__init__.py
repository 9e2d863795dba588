"""The OpenAI API (`/v1/...`).

body.py          reads a JSON body, bounded (413) and checked (400)
validation.py    an OpenAI body → our GenerateRequest, or a 400 naming the param
schema_limits.py OpenAI's bounds on a request's JSON Schemas (properties, nesting, names)
input_limits.py  the config's bounds on a request (messages, max_tokens caps)
output_limits.py n x max_tokens x logprobs: what one request may make, bounded
encoding.py      JSON answers and SSE chunks from pre-serialized templates
generation.py    /v1/chat/completions and /v1/completions
models.py        /v1/models
embeddings.py    /v1/embeddings
scoring.py       /v1/rerank and /v1/score: cosine similarities of a model's embeddings,
                 or a cross-encoder's own scores
classify.py      /classify: a classification model's classes, from its workers
tokenize.py      /tokenize and /detokenize: a prompt's ids, ids' text, by the model's tokenizer
audio.py         /v1/audio/transcriptions and /translations: speech to text, from a form"""
