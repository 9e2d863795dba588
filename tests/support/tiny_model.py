"""A tiny Llama (random weights) and a byte-level BPE tokenizer, made on the spot (or a
SentencePiece-like one: BPE pieces led by Metaspace's `▁`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

CONTEXT = 4096
FIRST = "aé中😀"  # the first vocabulary entries are its bytes, in order
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello from the fleet of workers",
    "a gateway in front of engines, streaming tokens",
    "café, naïve, 日本語, emoji 🔥 too",
]
#: More words for `metaspace_tokenizer`'s pieces: answers' usual first words.
WORDS = ["Sure, here is the answer.", "Hello there! How can I help you today?"]
SPECIALS = ["<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
#: A thinking model's markers (`build_tiny_model(thinking=True)`), after the others.
THINKING = ["<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('This model knows no tools.') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Qwen- and Hermes-like, for tests of tools: the tools in a system turn, calls (arguments
#: parsed) as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>You may call:{% for tool in tools %}\n{{ tool | tojson }}"
    '{% endfor %}\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tools_tokenizer(model: Path, into: Path) -> Path:
    """`model`'s tokenizer files copied into `into`, with `TOOLS_TEMPLATE` as their chat
    template: a gateway that tokenizes (`upstream: vllm-grpc`) renders tool turns with it."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).exists():
            shutil.copy(model / name, into / name)
    config = json.loads((into / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {byte: chr(code) for byte, code in chars.items()}


def metaspace_tokenizer() -> Tokenizer:
    """A BPE tokenizer trained on `SENTENCES` (and `WORDS`), words as `▁`-led pieces
    (Metaspace's pre-tokenizer and decoder, as SentencePiece's models: Llama-2, Mistral,
    Gemma): its decoder drops the first token's leading space, so a token reads as
    " Sure" after a prompt and as "Sure" alone; `SPECIALS` are special, last."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.train_from_iterator([*SENTENCES, *WORDS], trainer)
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def build_tokenizer(thinking: bool = False, metaspace: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences (any text round-trips), its ids
    reordered so the bytes of FIRST come first and the special tokens last. `thinking`:
    with `<think>` and `</think>` last (added tokens, not special ones, as DeepSeek-R1's),
    and a template whose answer begins in thought (DeepSeek-R1's way) unless its
    `enable_thinking` is false (Qwen3's variable), for vLLM's `deepseek_r1` reasoning
    parser. `metaspace`: `metaspace_tokenizer`'s instead, with the same template."""
    if metaspace:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=metaspace_tokenizer(),
            bos_token="<|bos|>",
            eos_token="<|end|>",
            pad_token="<|end|>",
            unk_token="<unk>",
        )
        fast.chat_template = CHAT_TEMPLATE
        return fast
    specials = [*SPECIALS, *THINKING] if thinking else SPECIALS
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(SENTENCES, trainer)
    bpe = json.loads(trained.to_str())["model"]
    byte_chars = _byte_chars()
    first = [byte_chars[b] for b in FIRST.encode()]
    merged = sorted((t for t in bpe["vocab"] if len(t) > 1), key=bpe["vocab"].get)
    rest = [c for c in byte_chars.values() if c not in first]
    vocab = {token: i for i, token in enumerate([*first, *rest, *merged, *specials])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in bpe["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    if thinking:  # added, not special, as DeepSeek-R1's: their text stays in the output
        tokenizer.add_tokens(THINKING)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|end|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    if thinking:
        thought = "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}"
        fast.chat_template = CHAT_TEMPLATE.replace(
            "<|assistant|>{%", "<|assistant|>" + thought + "{%"
        )
    return fast


def build_tiny_model(
    path: Path,
    *,
    ordered: bool = False,
    for_vllm: bool = False,
    size: tuple[int, int] = (256, 2),
    thinking: bool = False,
    metaspace: bool = False,
) -> Path:
    """Saves a Llama (random weights) and the tokenizer to `path`: 2 layers of hidden size
    32, or, `for_vllm`, the shapes vLLM's CPU kernels take (head size 64, bfloat16) at
    `size` (hidden size, layers; a benchmark wants a prefill that costs something);
    `thinking`, `metaspace`: the tokenizer's (`build_tokenizer`)."""
    tokenizer = build_tokenizer(thinking, metaspace)
    torch.manual_seed(0)
    config = _llama(tokenizer, size if for_vllm else None)
    model = LlamaForCausalLM(config)
    if for_vllm:
        model = model.to(torch.bfloat16)
    if ordered:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _llama(tokenizer: PreTrainedTokenizerFast, size: tuple[int, int] | None) -> LlamaConfig:
    """The tiny Llama's shape: 2 layers of hidden size 32, or, at a (hidden size, layers)
    `size`, the shapes vLLM's CPU kernels take (head size 64, bfloat16)."""
    hidden, layers = size or (32, 2)
    heads = max(4, hidden // 64) if size else 4
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if size:
        config.dtype = torch.bfloat16
    return config


def build_classifier(path: Path, labels: int) -> Path:
    """Saves the tiny Llama (random weights, vLLM's shapes) with a classification head of
    `labels` (seeded: a head left out of the checkpoint, as `--convert classify` leaves
    it, is vLLM's uninitialised memory, now and then NaN), and the tokenizer, to `path`.
    With one label it is a cross-encoder, which vLLM serves as a reranker (`--runner
    pooling`: `/rerank`, `/score`), scoring each pair by the sigmoid of its one logit;
    with more, a classifier (`/classify`)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = _llama(tokenizer, (256, 2))
    config.num_labels = labels
    model = LlamaForSequenceClassification(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_lora_adapter(path: Path, base: Path, seed: int, rank: int = 8) -> Path:
    """Saves a LoRA adapter of the model at `base` to `path` as PEFT writes one
    (`adapter_config.json`, `adapter_model.safetensors`): random weights of `rank` on
    every layer's query and value projections, seeded by `seed`, so that each adapter
    answers otherwise than its base and than another."""
    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head = hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(layers):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (rank, hidden)), ("lora_B", (out, rank))):
                tensor = torch.randn(shape, generator=generator).to(torch.bfloat16)
                weights[f"{name}.{part}.weight"] = tensor
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(outputs),
        "base_model_name_or_path": str(base),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    return path
