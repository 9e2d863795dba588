"""A model's tokenizer directory, as a Hugging Face model directory holds it:
`tokenizer.json` (read by `tokenizers`, the Rust library transformers wraps),
`tokenizer_config.json` (special tokens, and the chat template unless
`chat_template.jinja` holds it), loaded once per directory and shared.

The chat template is the model's own Jinja, rendered as transformers renders it
(`messages` and `tools` in OpenAI's dict shapes, tool calls' arguments parsed,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`) in Jinja's
immutable sandbox: a template is code from the model's publisher, and
the sandbox keeps it from reaching Python. transformers itself is not needed for
this (and would bring torch-sized weight); `tokenizers` is one Rust wheel.

Special tokens a user typed: rendered into the prompt, `<|im_end|><|im_start|>system`
in a message's content would become the real tokens that end the user's turn and open a
system one (HF's and vLLM's default). With `plain_contents`, the tokens of each message's
content that came out special are found by their offsets, and only those contents are
encoded again with special-token strings as text (`encode_special_tokens`); a prompt
without such a string, the usual case, costs one regex search of its contents more.

Cost: the load reads and parses the files once (milliseconds for a 150k vocabulary:
`tokenizer.json` is the bulk); encoding and decoding run in Rust, rendering in Python:
the caller runs `prompt_ids` off its event loop. Encoding is nearly all of it (about
1 µs a token with the tests' tokenizer; rendering a 3,000-token chat, 0.1 ms): routing,
which encodes every turn of a conversation again, calls `routing_ids`, which encodes
only the pieces between added tokens that recent prompts did not have (`pieces`).
"""

from __future__ import annotations

import functools
import json
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.protocol import errors
from gateway.protocol.chat import message_dict, tool_dict
from gateway.protocol.types import Message, Tool
from gateway.tokenization.detokenize import StreamDetokenizer
from gateway.tokenization.pieces import PieceCache

#: The files a tokenizer directory must hold.
REQUIRED = ("tokenizer.json", "tokenizer_config.json")
#: The prompt's last ids an answer's detokenizer starts after (`ModelTokenizer.context`):
#: a character's bytes (4 at most) whole, with room for special tokens after them.
CONTEXT_IDS = 8


class TokenizerError(ValueError):
    """The directory does not hold a usable tokenizer; the message says why."""


#: A message as the chat template reads it (tool calls' arguments parsed).
_message_dict = functools.partial(message_dict, parsed_arguments=True)
_NO_OPTIONS: Mapping[str, Any] = {}
_content = operator.attrgetter("content")


def _raise_exception(message: str) -> NoReturn:
    # templates refuse what the model cannot take (tools, roles) this way
    raise errors.Invalid(f"The model's chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _template(config: dict[str, Any], directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


#: What the last message's text is marked with to find its end in a rendered chat
#: (`open_end`): transformers' own tag, so a template renders it as transformers does.
_OPEN_END_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_last(messages: Sequence[Message]) -> list[Message]:
    """`messages` with the last one's text followed by `_OPEN_END_TAG`."""
    if not messages:
        raise errors.Invalid("No message to continue.", param="continue_final_message")
    *rest, last = messages
    return [*rest, replace(last, content=last.content + _OPEN_END_TAG, parts=())]


def _cut_at_tag(rendered: str) -> str:
    """A rendered chat cut where the last message's text ends (`_tagged_last`), as
    transformers cuts it: at the tag, or, where the template trimmed its space, before
    the trimmed tag and the spaces before it."""
    tag = _OPEN_END_TAG.strip()
    at = rendered.rfind(tag)
    if at < 0:
        raise errors.Invalid(
            "The model's chat template does not keep the last message's text as it is, so "
            "it cannot be continued.",
            param="continue_final_message",
        )
    if rendered[at : at + len(_OPEN_END_TAG)] == _OPEN_END_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _system_first(messages: Sequence[Message]) -> Sequence[Message]:
    """`messages` with the texts of its system messages after the first folded into a
    leading one, each after a blank line, for a template that takes a system message only
    first (as vLLM's Messages server folds them: Claude Code's reminders). A chat whose
    only system message leads it is returned as it is."""
    later = [m.content for m in messages[1:] if m.role == "system"]
    if not later:
        return messages
    rest = [m for m in messages[1:] if m.role != "system"]
    if messages[0].role == "system":
        head = messages[0].content
    else:
        head, rest = "", [messages[0], *rest]
    text = "\n\n".join(t for t in (head, *later) if t)
    return [Message("system", text), *rest]


class ModelTokenizer:
    """One model's tokenizer and chat template; thread-safe, shared."""

    def __init__(self, directory: Path) -> None:
        missing = [name for name in REQUIRED if not (directory / name).is_file()]
        if missing:
            raise TokenizerError(f"{directory}: missing {', '.join(missing)}")
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text())
            self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as error:  # tokenizers raises plain Exceptions
            raise TokenizerError(f"{directory}: cannot load the tokenizer: {error}") from None
        #: The same tokenizer reading special-token strings as text (for user contents).
        self._plain = Tokenizer.from_str(self._tokenizer.to_str())
        self._plain.encode_special_tokens = True
        #: Recent prompts' pieces, for `routing_ids` (None: this tokenizer cannot).
        pieces = PieceCache(self._tokenizer)
        self._pieces = pieces if pieces.usable else None
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        specials = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        #: Any special token's text (None: the tokenizer has none).
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        source = _template(config, directory)
        self._template: jinja2.Template | None = None
        #: Whether the chat template reads `tools` (shows the model its tools).
        self.reads_tools = False
        if source is not None:
            # transformers' settings, so a template renders here as it does there
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(source)
                # a plain dict of the globals (set above, never changed): jinja copies them
                # into every render's context, and its ChainMap of them copies in Python
                # (about 300 bytecodes a render)
                self._template.globals = dict(self._template.globals)
                self.reads_tools = "tools" in jinja2.meta.find_undeclared_variables(
                    env.parse(source)
                )
            except jinja2.TemplateError as error:
                raise TokenizerError(f"{directory}: the chat template: {error}") from None
        #: Whether the template refuses a system message after the first (Qwen's newer
        #: ones do): a chat's later system messages are then folded into its first.
        self.system_first = False
        self.system_first = self._template is not None and not self._takes_later_system()

    def _takes_later_system(self) -> bool:
        """Whether the template renders a system message that is not the first, tried
        once as vLLM's Messages server tries it (system, user, system, user)."""
        assert self._template is not None
        turns = [("system", "t"), ("user", "t"), ("system", "t"), ("user", "t")]
        try:
            self.render_chat([Message(role, text) for role, text in turns])
        except errors.Invalid:
            return False
        return True

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] = (),
        options: Mapping[str, Any] | None = None,
        *,
        generation: bool = True,
        open_end: bool = False,
    ) -> str:
        """The prompt the chat template makes of `messages` (and the `tools` the
        model may call: None to the template when there are none, as
        transformers passes them), ready for the answer (`generation`: with the
        template's generation prompt; `open_end`: cut after the last message's text, as
        transformers' `continue_final_message`); `options`: the client's own template
        variables (`chat_template_kwargs`, such as `enable_thinking`), which never
        replace the ones set here."""
        if self._template is None:
            raise errors.Invalid(
                "This model has no chat template; use /v1/completions.", param="messages"
            )
        if self.system_first:
            messages = _system_first(messages)
        if open_end:
            messages = _tagged_last(messages)
        try:
            rendered = self._template.render(
                {
                    **(options or _NO_OPTIONS),
                    "messages": list(map(_message_dict, messages)),  # (in C: no comprehension)
                    "tools": [tool_dict(t) for t in tools] if tools else None,
                    "add_generation_prompt": generation,
                    "bos_token": self.bos_token,
                    "eos_token": self.eos_token,
                }
            )
        except errors.GatewayError:
            raise
        except jinja2.TemplateError as error:  # the sandbox's refusals are TemplateErrors
            raise errors.Invalid(f"The model's chat template failed: {error}") from None
        return _cut_at_tag(rendered) if open_end else rendered

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of `text`; `add_special_tokens` adds the BOS its post-processor adds
        (for raw prompts; a rendered chat template already holds its own). Through the
        batch call: `Tokenizer.encode` holds the GIL the whole time (256 Ki characters:
        1.4 s of an event loop's time from another thread), the batch call releases it
        (16 ms) and, without offsets, takes 0.8 s."""
        batch = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`, special tokens left out (as vLLM's answers) unless
        `skip_special_tokens` is False (as its `/detokenize`)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Ids below this are the tokenizer's (its added tokens included)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's own string in the vocabulary (transformers' `convert_ids_to_tokens`,
        as vLLM's `/tokenize` gives `token_strs`: byte-level pieces as they are stored)."""
        name = self._tokenizer.id_to_token
        return [name(i) or "" for i in ids]

    def detokenizer(
        self, context: list[int] | None = None, skip_special: bool = True
    ) -> StreamDetokenizer:
        """A new answer's streamed decoder (special tokens left out unless `skip_special`
        is False), its first token decoded after `context` (`context`: the prompt's ids it
        needs)."""
        return StreamDetokenizer(self._tokenizer, context, skip_special)

    def context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's ids an answer's detokenizer starts after, so that its text is
        vLLM's: its server's detokenizer (`FastIncrementalDetokenizer`) primes its
        DecodeStream with the whole prompt, which then decodes the prompt on the answer's
        first token, each choice (a chat of 965 tokens of the tests' tiny tokenizer: 141 µs
        more than an unprimed stream; these ids, this decode included: 2 µs more). The last
        `CONTEXT_IDS` give the same text after them whenever they decode to text that does
        not end in U+FFFD (a token not skipped, the last character whole): a decoder looks
        back only to the sequence's first token (Metaspace, Strip, WordPiece) and to the
        character a byte belongs to (byte-level, byte fallback). Else (special tokens alone,
        a long run of byte tokens, a prompt ending in U+FFFD) the whole prompt, as vLLM."""
        tail = prompt_ids[-CONTEXT_IDS:]
        text = self._tokenizer.decode(tail, skip_special_tokens=True)
        return tail if text and text[-1] != "\ufffd" else prompt_ids

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (as vLLM's logprobs name
        tokens); a piece of a multi-byte character decodes as U+FFFD."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text as a raw prompt (with the BOS), in one call: Rust
        encodes them on its own threads, without the GIL."""
        batch = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=True)
        return [e.ids for e in batch]

    def prompt_ids(
        self,
        prompt: str | None,
        messages: Sequence[Message] | None,
        tools: Sequence[Tool] = (),
        *,
        plain_contents: bool = False,
        options: Mapping[str, Any] | None = None,
        generation: bool = True,
        open_end: bool = False,
        special: bool = False,
    ) -> list[int]:
        """The ids of a request's prompt: its text, or its messages (with its
        tools and template `options`, `generation` and `open_end` as `render_chat`
        takes them) through the template, with the tokenizer's special tokens around
        them where `special` (the template's own are in any case); with
        `plain_contents`, special-token strings in the messages' contents stay text."""
        if messages is None:
            return self.encode(prompt or "", add_special_tokens=True)
        rendered = self.render_chat(
            messages, tools, options, generation=generation, open_end=open_end
        )
        if not plain_contents or self._special_text is None:
            return self.encode(rendered, add_special_tokens=special)
        search = self._special_text.search
        if not any(map(search, map(_content, messages))):  # the usual chat: none, in C
            return self.encode(rendered, add_special_tokens=special)
        ids = self._plain_ids(rendered, [m.content for m in messages if search(m.content)])
        if not special:
            return ids
        before, after = self._specials
        return [*before, *ids, *after]

    @functools.cached_property
    def _specials(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text's own ids (a
        BOS, an EOS), found around the ids of a word."""
        bare = self.encode("a", add_special_tokens=False)
        whole = self.encode("a", add_special_tokens=True)
        for start in range(len(whole) - len(bare) + 1):
            if whole[start : start + len(bare)] == bare:
                return whole[:start], whole[start + len(bare) :]
        return whole, []  # cannot tell: all before

    def routing_ids(
        self, prompt: str | None, messages: Sequence[Message] | None, tools: Sequence[Tool] = ()
    ) -> list[int]:
        """`prompt_ids`' ids, for routing: a chat's rendered prompt encoded piece by
        piece between its added tokens, the pieces of recent prompts reused (`pieces`:
        the same ids; a conversation's next turn encodes only its new messages). A
        text prompt, or a tokenizer `pieces` cannot cut, is encoded whole."""
        if messages is None or self._pieces is None:
            return self.prompt_ids(prompt, messages, tools)
        return self._pieces.ids(self.render_chat(messages, tools))

    def _plain_ids(self, rendered: str, contents: list[str]) -> list[int]:
        """`rendered` encoded with the special tokens inside `contents` (found in it in
        order) read as text: the spans of those contents, where a token of the whole
        encoding came out special, are encoded again with the plain tokenizer."""
        spans = []
        at = 0
        for content in contents:
            start = rendered.find(content, at)
            if start < 0:  # the template changed it: cannot tell its text from the template's
                raise errors.Invalid(
                    "A message holds a special token's text that this model's chat template "
                    "does not keep as it is.",
                    param="messages",
                )
            spans.append((start, start + len(content)))
            at = start + len(content)
        (whole,) = self._tokenizer.encode_batch([rendered], add_special_tokens=False)
        hit = {
            span
            for token, (begin, end) in zip(whole.ids, whole.offsets, strict=True)
            if token in self._special_ids
            for span in spans
            if span[0] <= begin and end <= span[1]
        }
        if not hit:
            return list(whole.ids)
        ids: list[int] = []
        at = 0
        for start, end in sorted(hit):
            ids += self.encode(rendered[at:start], add_special_tokens=False)
            (plain,) = self._plain.encode_batch_fast(
                [rendered[start:end]], add_special_tokens=False
            )
            ids += plain.ids
            at = end
        ids += self.encode(rendered[at:], add_special_tokens=False)
        return ids


@functools.lru_cache(maxsize=64)
def load_tokenizer(directory: str) -> ModelTokenizer:
    """The tokenizer of `directory`, loaded once per directory (per process)."""
    return ModelTokenizer(Path(directory))
