"""A tiny Whisper (random weights, head size 64 as vLLM's CPU kernels take) with a
byte-level BPE tokenizer of a few words and Whisper's special tokens, made on the spot,
and a WAV file: what vLLM's CPU build serves on `/v1/audio/transcriptions`.

The decoder's last layer norm gives one vector whatever it reads (weight 0, bias the
embedding of `WORD`'s token, which the output projection shares, made the longest): the
model writes `WORD` again and again, so a transcript has text to compare, cut by
`max_completion_tokens`.
"""

from __future__ import annotations

import io
import math
import struct
import wave
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizerFast,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

#: The word the model writes, a token of its own.
WORD = " fox"
#: What the tokenizer is trained on.
TEXT = ["the quick brown fox jumps over the lazy dog", "hello from the fleet"]
EOT = "<|endoftext|>"
SPECIALS = [
    "<|startoftranscript|>",
    *(f"<|{code}|>" for code in LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
#: The sample rate Whisper reads.
RATE = 16_000


def byte_bpe(path: Path, text: list[str], first: str, specials: list[str]) -> None:
    """A byte-level BPE tokenizer trained on `text` (`first` its first token, then the
    `specials`), saved as `path`/tokenizer.json (made if need be)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[first],
    )
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(path / "tokenizer.json"))


def build_tiny_whisper(path: Path) -> Path:
    """The model, its tokenizer and its feature extractor, saved in `path`."""
    byte_bpe(path, TEXT, EOT, SPECIALS)
    fast = WhisperTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        unk_token=EOT,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
    )
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(), tokenizer=fast).save_pretrained(
        path
    )
    start = fast.convert_tokens_to_ids("<|startoftranscript|>")
    end = fast.convert_tokens_to_ids(EOT)
    config = WhisperConfig(
        vocab_size=len(fast),
        num_mel_bins=80,
        d_model=128,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=start,
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=end,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    (word,) = fast.encode(WORD, add_special_tokens=False)
    with torch.no_grad():
        embeddings = model.model.decoder.embed_tokens.weight
        embeddings[word] *= 4  # the longest: the one the constant vector picks
        norm = model.model.decoder.layer_norm
        norm.weight.zero_()
        norm.bias.copy_(embeddings[word] * 4)
    model.save_pretrained(path)
    generation = GenerationConfig(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=end, bos_token_id=end
    )
    generation.save_pretrained(path)
    return path


def wav(seconds: float = 1.5, hertz: float = 440.0) -> bytes:
    """A WAV file of a tone: 16-bit mono at `RATE`."""
    frames = b"".join(
        struct.pack("<h", int(9000 * math.sin(2 * math.pi * hertz * i / RATE)))
        for i in range(int(seconds * RATE))
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.writeframes(frames)
    return out.getvalue()
