"""Text ↔ token ids on the gateway's side, for engines that speak token ids
(vLLM's gRPC server; SGLang's scheduler protocol would reuse it as is):

    tokenizer.py    a model's tokenizer directory: `tokenizer.json` (Hugging Face
                    `tokenizers`, Rust), its special tokens, its chat template
                    rendered in a sandboxed Jinja; loaded once per directory
    pieces.py       a chat's ids for routing, encoded piece by piece between its added
                    tokens, recent prompts' pieces reused (the same ids, a fraction of
                    the CPU for a conversation's next turn)
    detokenize.py   token ids back to text as they stream, never splitting a character
                    (in Rust, tokenizers' DecodeStream, for a loaded tokenizer)

Pure functions over a loaded tokenizer: no I/O after the load, no event loop.
"""

from gateway.tokenization.detokenize import IncrementalDetokenizer, StreamDetokenizer
from gateway.tokenization.tokenizer import ModelTokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "ModelTokenizer", "StreamDetokenizer", "load_tokenizer"]
