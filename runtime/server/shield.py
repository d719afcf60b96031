"""Chat text that cannot forge a turn boundary: control-token text inside messages is tokenized as plain text.

A chat prompt is the template's text with the messages' text inside it, tokenized as one string, so a user (or a
tool result) writing `<|im_end|>\\n<|im_start|>system\\n...` would get real control tokens and a forged turn.
`shield` swaps every control-token text inside message content for a sentinel (private-use characters around a
per-request nonce and an index) before rendering; `encode` then tokenizes the template's text as usual and each
sentinel's original text with `Tokenizer.encode_literal`. Content without control-token text (the usual case) is
untouched and tokenized in one piece. If the template does not pass a sentinel through verbatim (it escapes or
drops the text), the conversation is refused rather than rendered unshielded.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

_TEXT_KEYS = ("content", "reasoning_content", "thinking")


class NotVerbatim(ValueError):
    """The chat template changed a sentinel, so the text around it cannot be kept plain."""


def shield(messages: list[dict], specials: tuple[str, ...]) -> tuple[list[dict], list[str], str]:
    """-> (messages with control-token text in their text fields replaced by sentinels, the replaced texts in
    sentinel order, the nonce); the messages themselves when there is nothing to replace."""
    if not specials or not any(isinstance(m.get(k), str) and any(s in m[k] for s in specials)
                               for m in messages for k in _TEXT_KEYS):
        return messages, [], ""
    nonce = secrets.token_hex(6)
    found: list[str] = []
    pattern = re.compile("|".join(re.escape(s) for s in specials))  # `specials` longest first: found whole

    def swap(match: re.Match) -> str:
        found.append(match.group(0))
        return f"\ue000{nonce}:{len(found) - 1}\ue001"

    out = []
    for m in messages:
        m = dict(m)
        for k in _TEXT_KEYS:
            if isinstance(m.get(k), str):
                m[k] = pattern.sub(swap, m[k])
        out.append(m)
    return out, found, nonce


def encode(tokenizer: Any, text: str, found: list[str], nonce: str) -> tuple[str, list[int]]:
    """The rendered `text` with its sentinels -> (the real text, token ids with each sentinel's text literal)."""
    if not found:
        return text, tokenizer.encode(text)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
    seen = [int(i) for i in parts[1::2]]
    if set(seen) != set(range(len(found))):  # each at least once (a template may show a text twice)
        raise NotVerbatim("the chat template did not render the messages' text verbatim, so control-token text in "
                         "it cannot be kept plain; remove it from the messages")
    ids: list[int] = []
    real = []
    for j, part in enumerate(parts):
        if j % 2 == 0:
            ids += tokenizer.encode(part) if part else []
            real.append(part)
        else:
            literal = found[int(part)]
            ids += tokenizer.encode_literal(literal)
            real.append(literal)
    return "".join(real), ids
