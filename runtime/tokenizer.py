"""Runtime tokenizer: `tokenizers` for ids, the chat template (`chat_template.py`), streaming detokenization.

Chat templates render as transformers' `apply_chat_template` does: message keys whose value is None dropped,
reasoning aliased under `reasoning_content`/`thinking`, and the tokenizer's special tokens passed as template
variables (`eos_token`, `pad_token`, ...); the environment they render in is `chat_template.py`'s.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HfTokenizer
from tokenizers import decoders

from ft.runtime.chat_template import ChatTemplate, ChatTemplateError, plain

# Template variables that name special tokens, in transformers' special_tokens_map order.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A `tokenizers` tokenizer plus its chat template and special tokens (`special`: bos/eos/pad/unk_token ...
    as in manifest.tokenizer or tokenizer_config.json; a token may be a string or an AddedToken dict)."""

    def __init__(self, tokenizer: _HfTokenizer, chat_template: str | None = None, special: dict | None = None):
        self._tok = tokenizer
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template) if chat_template is not None else None
        self._added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        self.special_token_ids = frozenset(i for i, t in self._added.items() if t.special)
        # the control tokens' texts, longest first (so a token that contains another is found whole)
        self.special_strings = tuple(sorted({t.content for t in self._added.values() if t.special}, key=len,
                                            reverse=True))
        self._literal: _HfTokenizer | None = None  # a twin that reads control-token text as plain text
        self.special_tokens_map: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            token = _token_text((special or {}).get(key))
            if token is None:
                continue
            if tokenizer.token_to_id(token) is None:
                raise ValueError(f"tokenizer special {key}={token!r} is not in the vocabulary")
            self.special_tokens_map[key] = token
        self.is_byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._unicode_to_byte = {c: b for b, c in enumerate(_byte_to_unicode())}
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_files(cls, tokenizer_json: Path, chat_template: str | Path | None = None,
                   special: dict | None = None) -> Tokenizer:
        """`chat_template` is the template text, or a Path to a .jinja file."""
        if isinstance(chat_template, Path):
            chat_template = chat_template.read_text(encoding="utf-8")
        return cls(_HfTokenizer.from_file(str(tokenizer_json)), chat_template, special)

    @classmethod
    def from_reader(cls, reader) -> Tokenizer:
        """Build from an FtwReader: manifest.tokenizer names the assets and the special tokens."""
        meta = reader.tokenizer
        if not meta.get("file"):
            raise ValueError("FTW manifest.tokenizer has no 'file' (the tokenizer.json asset name)")
        template = None
        if meta.get("chat_template"):
            template = reader.asset(meta["chat_template"]).decode("utf-8")
        # parsed from the checksummed bytes: a corrupted file is a checksum error, not a parse failure
        return cls(_HfTokenizer.from_str(reader.asset(meta["file"]).decode("utf-8")), template, meta)

    # ---- ids <-> text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens_map.get(key)
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; UnicodeEncodeError (saying where) for text with no UTF-8 form (a lone surrogate)."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            text.encode("utf-8")  # the tokenizer refuses such text with a bare TypeError: raise the cause instead
            raise

    def encode_literal(self, text: str) -> list[int]:
        """Token ids of `text` with any control-token text in it (`<|im_end|>`, say) encoded as plain text, never
        as the control token: what user-supplied text must be, so that it cannot forge a turn boundary."""
        if self._literal is None:  # a separate tokenizer: the flag is per object, and calls may be concurrent
            twin = _HfTokenizer.from_str(self._tok.to_str())
            twin.encode_special_tokens = True
            self._literal = twin
        return self._literal.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes a token contributes to decoded text (byte-level tokenizers only)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            data = self._added[token_id].content.encode("utf-8")
        else:
            token = self._tok.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            try:
                data = bytes(self._unicode_to_byte[c] for c in token)
            except KeyError:  # same rule as the ByteLevel decoder: a token with unmapped chars stays as is
                data = token.encode("utf-8")
        self._bytes_cache[token_id] = data
        return data

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain completion prompt instead")
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatTemplateError(f"message {i} must be a dict, got {type(message).__name__}")
            message = {k: plain(v) for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens_map, **{k: plain(v) for k, v in kwargs.items()}}
        return self._template.render(messages=chat, tools=plain(tools), documents=None,
                                     add_generation_prompt=add_generation_prompt, **variables)


class IncrementalDecoder:
    """Streams text deltas as token ids arrive; an incomplete UTF-8 sequence is held back until it completes.

    Byte-level BPE: the token bytes feed an incremental UTF-8 decoder (errors="replace"), so the concatenated deltas
    plus `flush()` equal `Tokenizer.decode` of all ids. Other decoders (e.g. SentencePiece/Metaspace) decode a
    sliding window and emit the growth once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, byte_level: bool | None = None):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._byte_level = tokenizer.is_byte_level if byte_level is None else byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start: text of ids[_prefix:_read] was already emitted
        self._read = 0

    def push(self, token_id: int) -> str:
        """Text that `token_id` completes ("" while a character is incomplete). An id the tokenizer does not know
        (a padding row of the embedding past the tokenizer: Qwen3.5/3.6 have 248,320 rows for 248,077 tokens, and
        sampling can pick one) adds no text, as in `Tokenizer.decode`."""
        if self._byte_level:
            if self._skip and token_id in self._tok.special_token_ids:
                return ""
            try:
                data = self._tok.token_bytes(token_id)
            except ValueError:  # unknown id
                return ""
            return self._utf8.decode(data)
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Text still held back (an unfinished sequence decodes to U+FFFD, as a full decode would)."""
        if self._byte_level:
            return self._utf8.decode(b"", final=True)
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(done):]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json may spell a token as an AddedToken dict
        value = value.get("content")
    return value if isinstance(value, str) else None


def _byte_to_unicode() -> list[str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the other 68 to chr(256 + n) in byte order."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        out.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return out
