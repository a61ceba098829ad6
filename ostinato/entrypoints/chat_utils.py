"""Checks of chat messages shared by the offline `LLM.chat` and the server (no heavy imports)."""

from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_unicode(text: str, where: str) -> None:
    """Raise ValueError naming `where` if `text` holds a lone UTF-16 surrogate ('\\ud800', or a JSON escape of
    one): not text that UTF-8, or any tokenizer, takes."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate at index {e.start})") from None


def check_role(role: object, where: str) -> None:
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role: unknown role {role!r} (allowed: {', '.join(CHAT_ROLES)})")


def check_conversation(messages: Any, where: str = "messages") -> None:
    """Raise ValueError naming the message and field unless `messages` is a non-empty list of
    {"role", "content"} dicts with a known role, and content a string or a list of OpenAI content parts
    (dicts with a "type", e.g. {"type": "text", "text": ...} or {"type": "image_url", "image_url": {...}})."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"{where}: expected a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: must not be empty")
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at}: expected a {{'role': ..., 'content': ...}} dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"{at}.role: missing")
        check_role(m["role"], at)
        if "content" not in m:
            raise ValueError(f"{at}.content: missing")
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ValueError(f"{at}.content[{j}]: expected a content part dict with a 'type'")
                if isinstance(part.get("text"), str):
                    check_unicode(part["text"], f"{at}.content[{j}].text")
        elif isinstance(content, str):
            check_unicode(content, f"{at}.content")
        else:
            raise ValueError(f"{at}.content: expected a string or a list of content parts, "
                             f"got {type(content).__name__}")
