"""A tiny Qwen2-Audio (random weights: a one-layer Whisper-like encoder before a
one-layer Qwen2, head size 64 as vLLM's CPU kernels take) with a byte-level BPE
tokenizer of a few words and the model's special tokens, made on the spot: an audio
LLM that vLLM's CPU build serves on `/v1/chat/completions`, where a message's
`input_audio` or `audio_url` part becomes the model's audio tokens (about 25 a second
of sound, so a chat's `usage.prompt_tokens` shows whether its sound reached the
model). Its answers are noise, the same for the same chat (greedy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
)

from tests.support.tiny_whisper import byte_bpe

PAD = "<|endoftext|>"
END = "<|im_end|>"
AUDIO = "<|AUDIO|>"
SPECIALS = ["<|im_start|>", END, "<|audio_bos|>", AUDIO, "<|audio_eos|>"]
TEXT = ["the quick brown fox jumps over the lazy dog", "what do you hear in this sound"]
#: ChatML, a sound as Qwen2-Audio's template writes it (vLLM puts a sound's placeholder
#: into the text itself for this model, so a string content is the usual case).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_audio_lm(path: Path) -> Path:
    """The model, its tokenizer and its processor, saved in `path`."""
    byte_bpe(path, TEXT, PAD, SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), eos_token=END, pad_token=PAD, unk_token=PAD
    )
    fast.chat_template = TEMPLATE
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=fast,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(path)
    end = fast.convert_tokens_to_ids(END)
    text = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "vocab_size": len(fast),
        "max_position_embeddings": 4096,
        "eos_token_id": end,
        "tie_word_embeddings": False,
    }
    audio = {
        "d_model": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 256,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    }
    config = Qwen2AudioConfig(
        audio_config=audio,
        text_config=text,
        audio_token_index=fast.convert_tokens_to_ids(AUDIO),
    )
    torch.manual_seed(0)
    Qwen2AudioForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    # transformers writes the language model's weights one `model.` deeper than the
    # checkpoints vLLM loads (Qwen's own): written back as those are
    weights = path / "model.safetensors"
    named = {
        name.replace("language_model.model.model.", "language_model.model."): tensor
        for name, tensor in load_file(str(weights)).items()
    }
    save_file(named, str(weights), metadata={"format": "pt"})
    pad = fast.convert_tokens_to_ids(PAD)
    GenerationConfig(eos_token_id=end, pad_token_id=pad).save_pretrained(path)
    return path
