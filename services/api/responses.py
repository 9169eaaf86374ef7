"""OpenAI response shapes of chat completions and completions (pure functions, no I/O).

Bodies and stream chunks of both endpoints, ``usage``, and logprobs from ``TokenChunk.logprobs``
(one ``TokenLogprob`` per token the client got: chunks dropped as a redelivered job's copies take
their logprobs with them, so logprobs stay aligned with the token ids that survive):

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.

Tool calls: a named ``tool_choice`` answers the completion's text as one call's arguments;
``tool_choice: "auto"`` reads the text with the model's tool parser (``services.api.tool_parsers``)
into ``content`` and ``tool_calls`` - streamed as ``delta.content`` then ``delta.tool_calls``
pieces - and its finish reason is ``tool_calls`` when calls were made and the completion stopped
(OpenAI's and vLLM's answer; ``length`` stays ``length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.api.params import Endpoint
from services.api.schemas import ParsedRequest
from services.api.tool_parsers import ToolCall, ToolStream, make_tool_call_id
from shared.protocol import FinalResult, TokenChunk, TokenLogprob

#: JSON has no -inf: a logprob below this is sent as this (vLLM does the same)
MIN_LOGPROB = -9999.0


@dataclass
class ChoiceResult:
    """What one choice produced: its chunks (as the client got them) and its end."""

    chunks: list[TokenChunk] = field(default_factory=list)
    final: FinalResult | None = None

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for chunk in self.chunks for lp in chunk.logprobs]


def _token(text: str, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _entry(text: str, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    token = _token(text, token_id, as_ids)
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(items: Sequence[TokenLogprob], *, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` of ``items`` (one entry per token, its alternatives most likely first)."""
    content = []
    for item in items:
        entry = _entry(item.token, item.token_id, item.logprob, as_ids)
        entry["top_logprobs"] = [_entry(text, tid, lp, as_ids) for tid, text, lp in item.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: Sequence[TokenLogprob], *, offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` of ``items``; ``offset``: where the first token's text starts
    in the choice's text (after an ``echo`` and the tokens already streamed)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in items:
        token = _token(item.token, item.token_id, as_ids)
        tokens.append(token)
        token_logprobs.append(_lp(item.logprob))
        alternatives = {_token(text, tid, as_ids): _lp(lp) for tid, text, lp in item.top}
        alternatives.setdefault(token, _lp(item.logprob))  # the chosen token too, as vLLM and OpenAI do
        top.append(alternatives)
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def tool_message(content: str, name: str, arguments: str) -> dict[str, Any]:
    """The assistant message of a named ``tool_choice`` (vLLM with a tool parser): ``content``
    (the echo, else ""), and one call of ``name`` whose ``arguments`` are the completion's text -
    none when that text is blank. The finish reason stays the completion's (``stop`` for a
    complete call), as OpenAI and vLLM answer a named choice."""
    calls = []
    if arguments.strip():
        calls.append(ToolCall(name, arguments).to_openai())
    return {"role": "assistant", "content": content, "tool_calls": calls}


def auto_tool_message(parsed: ParsedRequest, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message of ``tool_choice: "auto"`` and its finish reason: the parser's
    ``content`` (after the echo; null when empty and calls were made) and ``tool_calls`` (only the
    first with ``parallel_tool_calls: false``, as vLLM), ``tool_calls`` as the finish reason when
    there are calls and the completion stopped. Text without calls is the content, as always."""
    assert parsed.tool_parser is not None
    out = parsed.tool_parser.extract(text)
    calls = list(out.calls if parsed.parallel_tool_calls else out.calls[:1])
    if not calls:
        return {"role": "assistant", "content": parsed.echo_text + text}, finish_reason
    content = parsed.echo_text + (out.content or "")
    message = {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def usage(finals: Sequence[FinalResult]) -> dict[str, int]:
    """The request's usage: its prompt once, the completion tokens of every choice."""
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(
    request_id: str, parsed: ParsedRequest, results: Sequence[ChoiceResult], created: int
) -> dict[str, Any]:
    """The non-streaming body of either endpoint."""
    finals = [r.final for r in results if r.final is not None]
    choices = []
    for index, result in enumerate(results):
        final = result.final
        assert final is not None
        text = parsed.echo_text + final.text
        logprobs: dict[str, Any] | None = None
        choice: dict[str, Any]
        if parsed.endpoint == Endpoint.CHAT:
            if parsed.sampling.logprobs is not None:
                logprobs = chat_logprobs(result.logprobs, as_ids=parsed.tokens_as_ids)
            finish_reason = final.finish_reason
            if parsed.tool_name is not None:
                message = tool_message(parsed.echo_text, parsed.tool_name, final.text)
            elif parsed.tool_parser is not None:
                message, finish_reason = auto_tool_message(parsed, final.text, final.finish_reason)
            else:
                message = {"role": "assistant", "content": text}
            choice = {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            if parsed.sampling.logprobs is not None:
                logprobs = completion_logprobs(
                    result.logprobs, offset=len(parsed.echo_text), as_ids=parsed.tokens_as_ids
                )
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": final.finish_reason}
        if parsed.return_token_ids:
            choice["token_ids"] = list(final.token_ids)
        choices.append(choice)
    chat = parsed.endpoint == Endpoint.CHAT
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage(finals),
    }


class StreamShaper:
    """The stream chunks of one request, choice by choice (``index``): for chat the ``role`` (and
    ``echo``) chunk first, then deltas, then the ``finish_reason`` chunk; for completions the echo
    chunk, then text, then the ``finish_reason`` chunk; the ``usage`` chunk last."""

    def __init__(self, request_id: str, parsed: ParsedRequest, created: int):
        self.request_id = request_id
        self.parsed = parsed
        self.created = created
        self.chat = parsed.endpoint == Endpoint.CHAT
        #: completions: where each choice's next token text starts (``text_offset``)
        self.offsets = [len(parsed.echo_text)] * parsed.n
        #: a named tool choice: each choice's call id, once its first arguments delta was sent
        self.call_ids: list[str | None] = [None] * parsed.n
        #: ``tool_choice: "auto"``: each choice's tool-call parser state
        self.tool_streams: list[ToolStream] | None = (
            [parsed.tool_parser.streamer() for _ in range(parsed.n)]
            if self.chat and parsed.tool_parser is not None
            else None
        )

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.parsed.model,
            "choices": choices,
            **extra,
        }

    def _choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: Any = None,
        *,
        delta: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        if self.chat:
            if delta is None:
                delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        choice.update(extra)
        return self._body([choice])

    def opening(self) -> list[dict[str, Any]]:
        """The first chunks of every choice: chat's role, then the echoed text (if any)."""
        out = []
        for index in range(self.parsed.n):
            if self.chat:
                out.append(
                    self._body(
                        [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            if self.parsed.echo_text:
                out.append(self._choice(index, self.parsed.echo_text))
        return out

    def tokens(self, index: int, chunk: TokenChunk) -> dict[str, Any] | None:
        """The chunk of a ``TokenChunk`` (None when it carries nothing to send)."""
        extra: dict[str, Any] = {"token_ids": list(chunk.token_ids)} if self.parsed.return_token_ids else {}
        logprobs = None
        if self.parsed.sampling.logprobs is not None and chunk.logprobs:
            if self.chat:
                logprobs = chat_logprobs(chunk.logprobs, as_ids=self.parsed.tokens_as_ids)
            else:
                logprobs = completion_logprobs(
                    chunk.logprobs, offset=self.offsets[index], as_ids=self.parsed.tokens_as_ids
                )
        if not self.chat:
            self.offsets[index] += sum(len(lp.token) for lp in chunk.logprobs) if chunk.logprobs else len(chunk.text)
        if self.tool_streams is not None:
            delta = self._auto_delta(self.tool_streams[index].feed(chunk.text))
            if not (delta or extra or logprobs):
                return None
            return self._choice(index, None, logprobs=logprobs, delta=delta, **extra)
        if not (chunk.text or extra or logprobs):
            return None
        if self.chat and self.parsed.tool_name is not None:
            return self._choice(index, None, logprobs=logprobs, delta=self._tool_delta(index, chunk.text), **extra)
        return self._choice(index, chunk.text, logprobs=logprobs, **extra)

    def _tool_delta(self, index: int, arguments: str) -> dict[str, Any]:
        """A named tool choice's delta, as vLLM streams it: the first carries the call's ``id``,
        ``type`` and function ``name``; every delta carries the next piece of ``arguments``."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
        if self.call_ids[index] is None:
            self.call_ids[index] = call_id = make_tool_call_id()
            name = self.parsed.tool_name
            call = {"id": call_id, "type": "function", "index": 0, "function": {"name": name, "arguments": arguments}}
        return {"tool_calls": [call]}

    def _auto_delta(self, piece: Any) -> dict[str, Any]:
        """``tool_choice: "auto"``: the parser's content and ``tool_calls`` entries as a delta
        (only call 0's with ``parallel_tool_calls: false``)."""
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        calls = [c for c in piece.tool_calls if self.parsed.parallel_tool_calls or c["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish(self, index: int, final: FinalResult) -> dict[str, Any]:
        if self.tool_streams is not None:
            stream = self.tool_streams[index]
            delta = self._auto_delta(stream.finish())  # held-back text, when no call was made
            reason = "tool_calls" if stream.called and final.finish_reason == "stop" else final.finish_reason
            return self._choice(index, None, reason, delta=delta)
        return self._choice(index, None if self.chat else "", final.finish_reason)

    def usage(self, finals: Sequence[FinalResult]) -> dict[str, Any]:
        return self._body([], usage=usage(finals))
