"""Their server-sent events as our events, for `openai_http`: `_Stream` cuts the bytes
of a streamed completion into `data:` lines, parses each once and queues our events,
whichever way the bytes were read (httpx, or the raw connections). Kept apart as the
per-event hot path, and the one place that knows their chunks' shape.

A server sends most tokens as the same chunk but for its text: the id, the model,
the index and the nulls do not change within a stream. So the first plain text chunk
(one choice, text, nothing else that counts) is kept as a template, cut around its
text's JSON string; a line that is that head, one JSON string and that tail is the
same JSON with another text, and only the string is parsed. Any other line (a finish,
usage, logprobs, tool calls, another choice, another spelling) is parsed whole and may
become the next template. A reasoning model's thought (its server's `--reasoning-parser`)
comes first as such chunks with a delta of `reasoning` (`reasoning_content` before vLLM
0.11) alone: one of them is as good a template, its strings `Reasoning` events, until
the answer's first text chunk, parsed whole, takes its place (one template at a time:
a stream thinks, then answers). Per token that is two byte comparisons and the parse of a
short string instead of the parse of the whole chunk and the walk through its dicts:
with a fake engine, 32 streams, about a third of the gateway's CPU per token. A read
that is one such event whole, as an engine that sends a token a step gives them, is
matched before any line is cut: the gateway's CPU for parsing a read, in front of
fake_openai paced at 2 ms (each read a cold cache), about 17 -> 12 us. A read that
begins with several, whole, as an engine gives them faster than they are read, is cut
where one event ends and the next begins, and their texts parsed in C (bytecodes: 32
such events, 1,319 -> 148; 31 and the answer's end, 1,578 -> 665).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import orjson

from gateway.protocol import errors
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    Reasoning,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.upstreams.openai_http.translate import (
    _chat_logprobs,
    _completion_logprobs,
    error_from_event,
)

_REASONS = {r.value: r for r in FinishReason}
#: Finish reasons that are failures (vLLM's, as its gRPC server's in `vllm_grpc`).
_FINISH_ERRORS: dict[str, type[errors.GatewayError]] = {
    "abort": errors.Unavailable,  # aborted by the engine (shutdown, preemption)
    "error": errors.Failed,
}
#: The largest SSE line (one event) read from an upstream: past it the upstream is
#: failing, and reading on would only grow the gateway's memory.
MAX_EVENT_BYTES = 1024 * 1024
#: The longest stop string kept from an answer (the longest a request may send).
MAX_STOP_CHARS = 1024
_TOO_LARGE = "The upstream sent an event larger than the gateway takes."
#: Pieces of a choice that arrive together are merged up to this many characters (and
#: reading pauses while more than `connections._PAUSE_AT` events wait): a reader that
#: falls behind holds at most about 1 MiB of a stream.
_MERGE_CHARS = 16 * 1024
_QUOTED = b'"%b"'.__mod__  # bytes, in quotes
_loads = orjson.loads  # a template's string, a token: one lookup, not two
#: The keys of a thought's string in its delta, as a template's (`_Stream._learn`).
_REASONING = b'"reasoning":'
_REASONING_CONTENT = b'"reasoning_content":'
#: A chunk that may be the template, as `_Stream._choice` found it: the key of its one
#: string, the string, its choice, and the kind of event the string is.
_Found = tuple[bytes, str, int, type[Text] | type[Reasoning]]
#: vLLM's first choice of a chat, its role and no text: nothing to take (`_chunk` knows
#: it by one comparison, in C).
_ROLE_ONLY = {
    "index": 0,
    "delta": {"role": "assistant", "content": ""},
    "logprobs": None,
    "finish_reason": None,
}


class _Stream:
    """Reads their event stream, as our events: bytes in large reads are cut into
    `data:` lines in one pass, each parsed once, and the events appended to
    `ready`. Text and tool-call pieces of one choice that arrive in one read are
    merged into one event (the edge then writes one chunk for them).

    Tokens: a piece counts one token (vLLM sends one per chunk), or one per
    logprob when it has them. A call of n choices ends with n `Finished`, given
    out at `[DONE]`, when their usage is known: each choice has its own count
    where the server sent per-chunk usage (vLLM's `continuous_usage_stats`);
    else the total of the usage chunk goes on the last choice to finish and 0
    on the others; with no usage at all, each has the pieces counted. Every
    `Finished` carries the prompt's tokens (the same number, not a share).
    """

    # The state of a stream as it starts, read from the class until a stream sets its
    # own: set one by one for each stream, they were a third of its `__init__`.
    done = False
    _size = 0  # the unfinished line's bytes
    _prompt_tokens: int | None = None
    _cached_tokens: int | None = None  # their usage's prompt_tokens_details.cached_tokens
    _total: int | None = None
    # The template of a plain text chunk (or a thought's): the bytes before and after its
    # text's JSON string, cut inside its quotes (b"" while there is none), where that
    # string lies in such a line, its choice, and its kind.
    _head = b""
    _tail = b""
    _ending = b"\n\n"  # the tail and the blank line that ends an event
    _between = b""  # what lies between two such events' texts: `_ending` and `_head`
    _quoted = _string = slice(0)  # its text's string, quoted: in its line, in a read
    _template_index = 0
    _kind: type[Text] | type[Reasoning] = Text  # what its strings are
    #: `Started` may go out `HEAD_GRACE` after their head, before their first event.
    grace = True

    def __init__(self, chat: bool, n: int) -> None:
        self._chat = chat
        self.n = n  # choices
        self.ready: deque[Event] = deque()
        self._parts: list[bytes] = []  # an unfinished line, in the pieces it came in
        self._counted = [0] * n  # pieces' tokens per choice
        self._usages: dict[int, int] = {}  # per-chunk usage's completion tokens per choice
        self._reasons: dict[int, FinishReason] = {}  # in the order the choices finished
        self._stops: dict[int, str] = {}  # the stop string that ended a choice (vLLM says)
        self._key = b'"content":' if chat else b'"text":'  # the template's text's key

    def started(self) -> Started:
        """The call's `Started`: their stream says no prompt's size."""
        return Started(0)

    def feed(self, data: bytes) -> None:
        """Parses the complete lines of `data` (and of what came before it)."""
        head = self._head
        texts: list[str] = []  # the template's texts in a row, their events at the end
        if head and not self._parts and data.startswith(head):
            if self._between not in data:
                if data.endswith(self._ending):
                    # The read in front of an engine that sends a token a step: one
                    # template event, whole.
                    try:
                        text = _loads(data[self._string])
                    except orjson.JSONDecodeError:
                        pass  # not one string: cut into lines below
                    else:
                        if text:
                            self._put(text, self._template_index, self._kind)
                        return
            else:  # several: those it begins with taken at once, then its other lines
                data = self._templates(data, texts)
                if not data:
                    if texts:
                        self._texts(texts)
                    return
        if b"\n" not in data:
            if texts:  # the events the read began with go first
                self._texts(texts)
            self._parts.append(data)
            self._size += len(data)
            if self._size > MAX_EVENT_BYTES:
                raise errors.Failed(_TOO_LARGE)
            return
        if self._parts:
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts.clear()
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest:
            self._parts.append(rest)
        self._size = len(rest)
        head = self._head or b"\n"  # none yet: a head that no line starts with
        tail, quoted = self._tail, self._quoted
        for line in filter(None, lines):  # not the blank line after each event
            if line.startswith(head) and line.endswith(tail):
                try:
                    text = _loads(line[quoted])
                except orjson.JSONDecodeError:
                    pass  # not one string: parsed whole
                else:  # the template's chunk with this text
                    if text:
                        texts.append(text)
                    continue
            if not line.startswith(b"data:"):
                continue  # comments (keep-alives), event names, blank separators
            if texts:  # the run ends: its events go before this line's
                self._texts(texts)
            length = len(line)
            if length < 16 and line[5:].strip() == b"[DONE]":
                self._end()
                return
            if length > MAX_EVENT_BYTES:
                raise errors.Failed(_TOO_LARGE)
            try:
                payload = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                raise errors.Failed("The upstream sent an event that is not JSON.") from None
            if type(payload) is not dict:
                raise errors.Failed("The upstream sent an event that is not an object.")
            try:
                learned = self._chunk(payload, line)
            except (AttributeError, KeyError, TypeError, ValueError):
                raise errors.Failed("The upstream sent an event of an unknown shape.") from None
            if learned:
                head, tail, quoted = self._head, self._tail, self._quoted
        if texts:
            self._texts(texts)
        if self._size > MAX_EVENT_BYTES:
            raise errors.Failed(_TOO_LARGE)

    def _templates(self, data: bytes, texts: list[str]) -> bytes:
        """The template events, whole, that `data` (which begins with the template's
        head, and holds `_between`) begins with: their texts put in `texts` (empty
        until then; the empty texts count no token, as in the lines), and the rest of
        `data` returned; all of it where they cannot be told apart (then its lines
        tell).

        Cut where one event's ending meets the next one's head (`_between`), up to
        the first ending after the last such seam, every piece must be the inside of
        one JSON string: no such inside holds a quote or a line break, so none holds
        `_between` or an ending, and each of those events is one line, that head, a
        string and that tail. (The reads of an engine whose tokens come faster than
        they are read: in the lines, such an event cost about 30 bytecodes.)"""
        between, ending = self._between, self._ending
        seam = data.rfind(between)  # before the last of them
        end = data.find(ending, seam + len(between))
        if end < 0:  # the last not whole: the events up to the seam before it
            end = seam
        pieces = data[len(self._head) : end].split(between)
        try:  # each piece quoted and parsed, in C
            texts += filter(None, map(orjson.loads, map(_QUOTED, pieces)))
        except orjson.JSONDecodeError:
            texts.clear()
            return data
        return data[end + len(ending) :]

    def _texts(self, texts: list[str]) -> None:
        """The template's strings in a row, a token each (and emptied): one event; in the
        rare run that reaches `_MERGE_CHARS`, one each time the strings since the last
        reach it (measured here, not string by string as they come)."""
        text = "".join(texts)
        if len(text) < _MERGE_CHARS:
            self._put(text, self._template_index, self._kind, len(texts))
        else:
            index, kind = self._template_index, self._kind
            first = size = 0
            for i, piece in enumerate(texts, 1):
                size += len(piece)
                if size >= _MERGE_CHARS or i == len(texts):
                    self._put("".join(texts[first:i]), index, kind, i - first)
                    first, size = i, 0
        texts.clear()

    def _learn(self, line: bytes, found: _Found) -> bool:
        """Keeps `line` (a plain chunk, as `_choice` found it: its one effect is a text,
        or a thought; b"" where the chunk cannot be one) as the template if the key of
        that string is once in the line and the string is spelled as orjson would."""
        key, text, index, kind = found
        if line.count(key) != 1:
            return False
        at = line.index(key) + len(key)
        spelled = orjson.dumps(text)
        if not line.startswith(spelled, at):  # as a server spells it, mostly
            while line[at : at + 1] == b" ":
                at += 1
            if not line.startswith(spelled, at):
                return False
        # Cut inside the string's quotes: what is between them then parses as a string
        # or not at all (no other JSON value starts and ends with a quote).
        end = at + len(spelled)
        head = self._head = line[: at + 1]
        tail = self._tail = line[end - 1 :]
        ending = self._ending = tail + b"\n\n"
        self._between = ending + head
        cut = end - len(line)
        self._quoted = slice(at, cut)  # the string, quoted
        self._string = slice(at, cut - 2)  # in the read of that line alone
        self._template_index = index
        self._kind = kind
        return True

    def _chunk(self, payload: dict[str, Any], line: bytes) -> bool:
        """Takes one chunk (`line`, parsed); whether it is now the template (`_learn`):
        one choice whose only effect is its text, or its thought (no finish, logprobs,
        tool calls or usage)."""
        if "error" in payload or payload.get("object") == "error":
            raise error_from_event(payload)
        choices = payload.get("choices")
        usage = payload.get("usage")
        if usage and type(usage) is dict:
            self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
            details = usage.get("prompt_tokens_details")  # vLLM's only where enabled
            if details and type(details) is dict and type(details.get("cached_tokens")) is int:
                self._cached_tokens = details["cached_tokens"]
            if not choices:
                self._total = usage.get("completion_tokens", self._total)
            else:
                line = b""  # not a template: its usage would be taken once
                if len(choices) == 1 and "completion_tokens" in usage:  # per-chunk usage
                    self._usages[choices[0].get("index") or 0] = usage["completion_tokens"]
        if not choices:
            return False
        if len(choices) != 1:
            for choice in choices:  # a list: anything else fails on its items
                self._choice(choice, b"")
            return False
        choice = choices[0]
        if choice == _ROLE_ONLY:
            return False
        return self._choice(choice, line)

    def _choice(self, choice: dict[str, Any], line: bytes) -> bool:
        """Takes one choice of a chunk (`line`; b"" where it cannot be the template);
        whether it is now the template (`_learn`): its text (not empty) all it holds, or
        its thought alone in its delta."""
        index = choice.get("index") or 0
        if index and not 0 < index < self.n:  # 0 always is one
            raise errors.Failed(f"The upstream sent choice {index} of {self.n}.")
        given = choice.get("logprobs")
        reason = choice.get("finish_reason")
        thought = None
        if self._chat:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            calls = delta.get("tool_calls")
            if len(delta) > 1 or text is None:  # more than a text: reasoning, maybe
                thought = delta.get("reasoning") or delta.get("reasoning_content")
        else:
            text = choice.get("text")
            calls = None
        if not given and not calls and reason is None and not thought:
            # most choices: a text (its token), or nothing (vLLM's first, of the role)
            if not text:
                return False
            self._text(text, 1, index)
            return type(text) is str and self._learn(line, (self._key, text, index, Text))
        if self._chat:
            logprobs = _chat_logprobs(given) if given else None
        else:
            logprobs = _completion_logprobs(given) if given else None
        tokens = 1 if logprobs is None else len(logprobs)
        if thought:  # before the text: a chunk that holds both ends the reasoning
            if type(thought) is not str:
                raise errors.Failed("The upstream sent a reasoning that is not a string.")
            self._put(thought, index, Reasoning, tokens)
            tokens = 0
        if text or logprobs:
            self._text(text or "", tokens, index, logprobs)
            tokens = 0
        if calls:
            for call in calls:
                self._tool_call(index, call, tokens)
                tokens = 0
        if reason is None:  # with logprobs, tool calls or a thought: not a text alone
            # A thought alone (a chat's) is the template while it thinks: nothing else in
            # its delta, where an empty thought would leave a text or the other name's
            # (the vLLMs that send both names, the same string twice, are parsed whole).
            if thought and not given and len(delta) == 1:
                key = _REASONING if "reasoning" in delta else _REASONING_CONTENT
                return self._learn(line, (key, thought, index, Reasoning))
            return False
        if index not in self._reasons:
            failure = _FINISH_ERRORS.get(reason)
            if failure is not None:
                raise failure(f"The upstream ended choice {index} with `{reason}`.")
            self._reasons[index] = _REASONS.get(reason, FinishReason.STOP)
            stop = choice.get("stop_reason")  # vLLM's: the stop string, or a stop token id
            if reason == "stop" and isinstance(stop, str):
                self._stops[index] = stop[:MAX_STOP_CHARS]
        return False

    def _text(
        self,
        text: str,
        tokens: int,
        index: int,
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        """A piece of choice `index`'s text, its tokens counted; merged into the last
        event when that is the same choice's text (both with logprobs, or neither)."""
        self._counted[index] += tokens
        ready = self.ready
        if ready:
            last = ready[-1]
            if type(last) is Text and last.index == index and len(last.text) < _MERGE_CHARS:
                if last.logprobs is None and logprobs is None:
                    ready[-1] = Text(last.text + text, last.tokens + tokens, index)
                    return
                if last.logprobs is not None and logprobs is not None:
                    logprobs = last.logprobs + logprobs
                    ready[-1] = Text(last.text + text, last.tokens + tokens, index, logprobs)
                    return
        ready.append(Text(text, tokens, index, logprobs))

    def _put(
        self, text: str, index: int, kind: type[Text] | type[Reasoning], tokens: int = 1
    ) -> None:
        """A piece of choice `index`'s reasoning, or of its text without logprobs
        (`kind`), its tokens counted; merged into the last event when that is the same
        choice's, of that kind (a text without logprobs). The template's strings come
        here, a lone one in as many steps as `_text` took: `kind` is an argument, as
        `self._kind(...)` (an instance's attribute, called) is a lookup that 3.11 does
        not specialize."""
        self._counted[index] += tokens
        ready = self.ready
        if ready:
            last = ready[-1]
            if kind is Text:
                if (
                    type(last) is Text
                    and last.index == index
                    and len(last.text) < _MERGE_CHARS
                    and last.logprobs is None
                ):
                    ready[-1] = Text(last.text + text, last.tokens + tokens, index)
                    return
            elif type(last) is Reasoning and last.index == index and len(last.text) < _MERGE_CHARS:
                ready[-1] = Reasoning(last.text + text, last.tokens + tokens, index)
                return
        ready.append(kind(text, tokens, index))

    def _tool_call(self, index: int, call: dict[str, Any], tokens: int) -> None:
        """A piece of a tool call of choice `index`, its tokens counted; merged into
        the last event when that is more of the same call's arguments."""
        self._counted[index] += tokens
        function = call.get("function") or {}
        call_index = call.get("index") or 0
        call_id = call.get("id") or ""
        name = function.get("name") or ""
        arguments = function.get("arguments") or ""
        if not call_id and not name and not arguments:
            return  # an empty piece (its token is counted on the choice)
        ready = self.ready
        if ready and not call_id and not name:
            last = ready[-1]
            if (
                type(last) is ToolCallDelta
                and (last.index, last.call_index) == (index, call_index)
                and len(last.arguments) < _MERGE_CHARS
            ):
                ready[-1] = last._replace(
                    arguments=last.arguments + arguments, tokens=last.tokens + tokens
                )
                return
        ready.append(ToolCallDelta(index, call_index, call_id, name, arguments, tokens))

    def _end(self) -> None:
        """`[DONE]`: every choice's `Finished`, its tokens divided as the class says."""
        self.done = True
        reasons, usages, total = self._reasons, self._usages, self._total
        if self.n == 1 and not usages:  # most calls: the count below, without its walk
            count = self._counted[0] if total is None else max(0, total - sum(usages.values()))
            self.ready.append(self._finished(0, count))
            return
        order = [*reasons]
        if len(order) < self.n:
            order += [i for i in range(self.n) if i not in reasons]
        last = -1  # the choice that the usage chunk's total goes on
        if total is not None:
            for i in reversed(order):
                if i not in usages:
                    last = i
                    break
        for i in order:
            if i in usages:
                count = usages[i]
            elif total is None:
                count = self._counted[i]
            elif i == last:
                count = max(0, total - sum(usages.values()))
            else:
                count = 0
            self.ready.append(self._finished(i, count))

    def _finished(self, index: int, count: int) -> Finished:
        """Choice `index`'s `Finished`, of `count` tokens, with the usage's prompt counts."""
        reason = self._reasons.get(index, FinishReason.STOP)
        stop = self._stops.get(index, "")
        return Finished(reason, count, self._prompt_tokens, index, stop, self._cached_tokens)


class IdsStream(_Stream):
    """The stream of a request that asked for token ids (vLLM's `return_token_ids`):
    every line parsed whole (no template: the fast path stays the plain requests'), the
    prompt's ids read from the first chunk (a chat's top level; a completion's choice)
    for `Started`, which waits for their first event (no `grace`), and each chunk's
    `token_ids` put on the first event it made, or, where it made none (a finish, an
    end of sequence), on that choice's next one or its `Finished`, in order: a choice's
    events' ids joined are theirs."""

    grace = False

    def __init__(self, chat: bool, n: int) -> None:
        super().__init__(chat, n)
        self._prompt_ids: tuple[int, ...] | None = None
        self._loose: dict[int, list[int]] = {}  # ids on no event yet, per choice

    def started(self) -> Started:
        return Started(0, 0, self._prompt_ids)

    def _learn(self, line: bytes, found: _Found) -> bool:
        return False

    def _chunk(self, payload: dict[str, Any], line: bytes) -> bool:
        if self._prompt_ids is None:
            self._prompt_of(payload)  # a chat's
        return super()._chunk(payload, line)

    def _prompt_of(self, holder: dict[str, Any]) -> None:
        ids = holder.get("prompt_token_ids")
        if type(ids) is list and all(type(i) is int for i in ids):
            self._prompt_ids = tuple(ids)

    def _choice(self, choice: dict[str, Any], line: bytes) -> bool:
        if self._prompt_ids is None and not self._chat:
            self._prompt_of(choice)
        ids = choice.get("token_ids")
        if type(ids) is not list or not all(type(i) is int for i in ids):
            ids = []
        ready = self.ready
        before = len(ready)
        last = ready[-1] if ready else None
        super()._choice(choice, b"")
        index = choice.get("index") or 0
        loose = self._loose.pop(index, [])
        if len(ready) > before:  # its first new event takes them
            first = ready[before]
            ready[before] = first._replace(token_ids=(*loose, *ids))  # type: ignore[call-arg]
        elif ready and ready[-1] is not last:  # merged into the last (of this choice)
            merged = ready[-1]
            held = (last.token_ids or ()) if last is not None else ()  # type: ignore[union-attr]
            ready[-1] = merged._replace(token_ids=(*held, *loose, *ids))  # type: ignore[call-arg]
        else:
            self._loose[index] = loose + ids
        return False

    def _finished(self, index: int, count: int) -> Finished:
        return super()._finished(index, count)._replace(token_ids=tuple(self._loose.pop(index, ())))
