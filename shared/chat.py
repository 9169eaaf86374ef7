"""The chat message: one typed struct and one role set, for the API and the engines.

The API validates a request's messages once, into :class:`ChatMessage` s (``services.api.schemas``
turns OpenAI content parts into these: ``image_url`` parts become :class:`ImagePart` placeholders,
in the order of the request's images). They travel in ``GenerationJob.messages`` as plain maps of
the same shape (``to_wire``), which is what the engines render with their chat template; the
engines check roles against the same :data:`ROLES`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.errors import InvalidRequest

#: The roles a chat message may have (OpenAI's chat roles; no tool calling).
ROLES: tuple[str, ...] = ("system", "user", "assistant", "developer")
Role = Literal["system", "user", "assistant", "developer"]
#: Roles the API renames: ``developer`` is OpenAI's newer name for ``system``, which every chat
#: template knows.
ROLE_ALIASES: dict[str, Role] = {"developer": "system"}


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag_field="type", tag="image"):
    """A placeholder for the request's next image (``GenerationJob.images``, in order)."""


Part = TextPart | ImagePart


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    content: str | list[Part] = ""

    def to_wire(self) -> dict[str, Any]:
        """The plain map ``GenerationJob.messages`` carries (``{"role", "content"}``)."""
        return msgspec.to_builtins(self)


def check_role(role: Any, where: str) -> Role:
    """``role`` with its alias resolved; InvalidRequest (param ``messages``) when it is not one of ROLES."""
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}", param="messages")
    return ROLE_ALIASES.get(role, role)
