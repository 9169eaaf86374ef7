"""The chat message: one typed struct and one role set, for the API and the engines.

The API validates a request's messages once, into :class:`ChatMessage` s (``services.api.schemas``
turns OpenAI content parts into these: ``image_url`` parts become :class:`ImagePart` placeholders,
in the order of the request's images). They travel in ``GenerationJob.messages`` as plain maps of
the same shape (``to_wire``), which is what the engines render with their chat template; the
engines check roles against the same :data:`ROLES`.

Tool conversations (a model whose chat template renders tools, ``services.api.tool_parsers``): an
``assistant`` message may carry the ``tool_calls`` it made (OpenAI's shape, ``arguments`` as JSON
text), a ``tool`` message answers one of them (``tool_call_id``). The wire form has those keys only
when set, so a message without them is the ``{"role", "content"}`` map it always was.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.errors import InvalidRequest

#: The roles a chat message may have (OpenAI's chat roles; ``tool`` only where the model's chat
#: template renders tool calls - the API checks that).
ROLES: tuple[str, ...] = ("system", "user", "assistant", "developer", "tool")
Role = Literal["system", "user", "assistant", "developer", "tool"]
#: Roles the API renames: ``developer`` is OpenAI's newer name for ``system``, which every chat
#: template knows.
ROLE_ALIASES: dict[str, Role] = {"developer": "system"}


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag_field="type", tag="image"):
    """A placeholder for the request's next image (``GenerationJob.images``, in order)."""


class VideoPart(msgspec.Struct, frozen=True, tag_field="type", tag="video"):
    """A placeholder for the request's next video (``GenerationJob.images``, in order with the
    images: the media items of a request are one list, each with its kind)."""


Part = TextPart | ImagePart | VideoPart


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    #: the arguments as JSON text (OpenAI's form; the engines hand the template the parsed object)
    arguments: str


class ToolCall(msgspec.Struct, frozen=True):
    """A call an earlier ``assistant`` turn made (OpenAI ``ChatCompletionMessageToolCall``)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    content: str | list[Part] = ""
    #: ``assistant``: the calls it made
    tool_calls: tuple[ToolCall, ...] = ()
    #: ``tool``: the call it answers
    tool_call_id: str | None = None

    @property
    def uses_tools(self) -> bool:
        """A message of a tool conversation (a call or a tool's answer)."""
        return bool(self.tool_calls) or self.role == "tool"

    def to_wire(self) -> dict[str, Any]:
        """The plain map ``GenerationJob.messages`` carries: ``{"role", "content"}``, plus
        ``tool_calls`` / ``tool_call_id`` when set."""
        out: dict[str, Any] = {"role": self.role, "content": msgspec.to_builtins(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [msgspec.to_builtins(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def check_role(role: Any, where: str) -> Role:
    """``role`` with its alias resolved; InvalidRequest (param ``messages``) when it is not one of ROLES."""
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}", param="messages")
    return ROLE_ALIASES.get(role, role)
