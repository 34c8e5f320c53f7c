"""Tokenizers behind one interface (the chat / tool template: coder.data.chat_template).

Three kinds (`KINDS`, the `kind` of a checkpoint's tokenizer record):
  "sentencepiece"  coder's own (`Tokenizer`): trained by `train_tokenizer` on the corpus (the
                   quickstart), the special tokens at fixed ids (below);
  "hf_tokenizers"  a Hugging Face `tokenizers` model, `tokenizer.json` (DeepSeek-V3 ships one);
  "tiktoken"       a tiktoken BPE file, `tiktoken.model` (Kimi K2 ships one), encoded by tiktoken.
The last two (`PretrainedTokenizer`) come with a pretrained base model (`load_pretrained`): the
chat template's special tokens are configurable strings (`data.chat_tokens`, name -> string,
default SPECIAL_TOKENS): one the base tokenizer has as an added / special token is used, one it
lacks is added as a new id after every id the checkpoint's embedding holds, and the model's
embedding and output head grow by that many rows (coder.model.hf_import). Encoding splits the
text at the template's tokens (coder's own strings and the configured ones) and encodes the
rest with the base library, so `<tool_call>` written by coder.env.protocol is one id whatever the
base calls it; decoding writes coder's own strings back. `export_hf(directory)` writes files
transformers loads (`tokenizer.json` with the added tokens at their ids, `tokenizer_config.json`
with a chat template rendering coder's).

The sentencepiece kind, in detail.

Ids (fixed by `train_tokenizer`, checked on load):
  0 <pad>, 1 <unk>, 2 <s> (bos), 3 </s> (eos), then the special tokens of docs/contracts.md as
  user-defined symbols, one id each, in `SPECIAL_TOKENS` order (4 = <|system|>, ... 14 = </summary>),
  then 256 byte-fallback pieces, then the learned pieces.

Tuned for code: no normalisation (`identity`), no dummy-prefix space (so encoding a turn never
depends on what precedes it, which keeps token-in / token-out exact), whitespace and newlines kept
(runs of spaces are pieces: indentation costs one token), digits split, byte fallback (no <unk>
for any UTF-8 text). The special tokens are matched inside any text, so `<tool_call>` written by
`coder.env.protocol` is always one id. A consequence: a literal `<|end|>` inside user or tool
content also becomes the control token; content that may hold such strings (tool output, files)
should be encoded with `encode(text, allow_special=False)`, which keeps them ordinary text.

The tokenizer travels with the checkpoint: the trainer stores it in every checkpoint as a JSON
record (`to_record` / `from_record`): its kind (`KINDS` maps a kind to its loader: every kind
serves the same interface: `kind`, `files()`, `from_files`, `source`, encode / decode, the
special ids and the chat template), its files ({name: bytes}, base64: tokenizer.model;
tokenizer.json + coder_chat.json; tiktoken.model + coder_chat.json) and their sha256
(`fingerprint`). Which tokenizer a stage uses is decided by
coder.train.checkpoint.stage_tokenizer: the checkpoint's it resumes or starts from (or, from a
Hugging Face checkpoint, the one beside it, `load_pretrained`), so the ids mean what they meant
when the weights were trained whatever Python or corpus this host has; a run from scratch loads
`data.tokenizer` or trains one once (`load_or_train_shared`: on process 0, its files broadcast
to the other processes).
"""
import abc
import base64
import hashlib
import io
import json
import logging
import os
import random
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import sentencepiece as spm

from coder.data import corpus, sources
from coder.data.chat_template import ROLES, SPECIAL_TOKENS, ChatTemplate

PAD, UNK, BOS, EOS = 0, 1, 2, 3
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
# The keys of `data.chat_tokens`, one per SPECIAL_TOKENS entry (same order).
CHAT_TOKEN_NAMES = ("system", "user", "assistant", "tool", "end", "tool_call", "tool_call_end",
                    "tool_result", "tool_result_end", "summary", "summary_end")
DEFAULT_CHAT_TOKENS = dict(zip(CHAT_TOKEN_NAMES, SPECIAL_TOKENS))
# Kimi K2's pre-tokenizer (its tokenization_kimi.py `pat_str`), the default of
# `data.tiktoken_pattern`: a tiktoken.model file holds the ranks, not the pattern.
KIMI_K2_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Bump when the trainer options below change, so cached tokenizers are retrained.
_TRAINER_VERSION = 1
# SentencePiece skips training "sentences" longer than this many bytes; chunks stay below it.
_MAX_SENTENCE_BYTES = 8192
_CHUNK_CHARS = 2048


class Tokenizer(ChatTemplate):
    """A loaded SentencePiece model with the template's special tokens.

    `source` says where it came from (a path, a cache file, a checkpoint); informational only.
    """

    kind = "sentencepiece"
    MODEL_FILE = "tokenizer.model"

    def __init__(self, model_proto: bytes, source: str = ""):
        self.model_proto = model_proto
        self.source = source
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._special = {tok: self._sp.piece_to_id(tok) for tok in SPECIAL_TOKENS}
        expected = {tok: 4 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        fixed = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if self._special != expected or fixed != (PAD, UNK, BOS, EOS):
            raise ValueError(
                "tokenizer model does not have coder's special-token layout "
                f"(pad/unk/bos/eos={fixed}, specials={self._special}); train it with "
                "coder.data.tokenizer.train_tokenizer"
            )

    def __getstate__(self):
        # The SentencePiece processor is not picklable; grain workers rebuild it from the proto.
        return {"model_proto": self.model_proto, "source": self.source}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state.get("source", ""))

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Loads a .model file from a local path or any fsspec URL."""
        import fsspec

        with fsspec.open(path, "rb") as f:
            return cls(f.read(), source=path)

    def files(self) -> dict[str, bytes]:
        """The files that define this tokenizer ({name: bytes}), as checkpoints store them."""
        return {self.MODEL_FILE: self.model_proto}

    @classmethod
    def from_files(cls, files: dict[str, bytes], source: str = "") -> "Tokenizer":
        """Inverse of `files`."""
        return cls(files[cls.MODEL_FILE], source=source)

    def save(self, path: str) -> None:
        """Writes the model atomically (temp file + rename), safe against concurrent writers."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tokenizer-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(self.model_proto)
        os.replace(tmp, path)

    # --- plain text -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of pieces; ids are in [0, vocab_size)."""
        return self._sp.get_piece_size()

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 128 (the model's embedding rows)."""
        return -(-self.vocab_size // 128) * 128

    pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. allow_special=False encodes special-token strings in the text
        (e.g. a file the agent read that contains "<|end|>") as ordinary text pieces."""
        if allow_special or not _SPECIAL_RE.search(text):
            return self._sp.encode(text)
        ids = []
        for i, part in enumerate(_SPECIAL_RE.split(text)):
            if i % 2 == 0:
                ids += self._sp.encode(part)
            else:
                # Encoded in two halves, neither of which is a whole special token.
                ids += self._sp.encode(part[:2]) + self._sp.encode(part[2:])
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


# --- tokenizers of pretrained models: Hugging Face `tokenizers`, tiktoken -----------------------
CHAT_FILE = "coder_chat.json"  # the chat tokens' ids and strings, bos / eos, the kind's settings
_RESERVED = "<|coder_reserved_{}|>"  # fills id gaps when exporting (no checkpoint row is unnamed)


class PretrainedTokenizer(ChatTemplate, abc.ABC):
    """A pretrained base tokenizer (subclasses: `HFTokenizer`, `TiktokenTokenizer`) plus the chat
    template's tokens, as `load_pretrained` resolved them.

    The base files are kept byte for byte; `CHAT_FILE` ({"chat": {SPECIAL_TOKENS string:
    {"name", "string", "id", "added"}}, "bos_id", "eos_id", "unk_id", "first_new_id", ...})
    says which id each template token has (a base token, or an added one) and is stored with them,
    so a checkpoint's record rebuilds exactly this tokenizer. Ids of added tokens start at
    `first_new_id` (the row count of the checkpoint's embedding), so no row the base model trained
    changes meaning; the model needs `vocab_size` rows (`padded_vocab_size`: not rounded, the
    base model fixes its own row count).
    """

    kind = ""
    BASE_FILES: tuple = ()
    pad_id = PAD  # batches pad with 0 whatever the tokenizer (docs/contracts.md); never a target

    def __init__(self, files: dict[str, bytes], source: str = ""):
        missing = [n for n in self.BASE_FILES + (CHAT_FILE,) if n not in files]
        if missing:
            raise ValueError(f"{self.kind} tokenizer ({source}): files {missing} missing")
        self._files = dict(files)
        self.source = source
        self.meta = json.loads(files[CHAT_FILE])
        self._load_base()
        chat = self.meta["chat"]
        if set(chat) != set(SPECIAL_TOKENS):
            raise ValueError(f"{CHAT_FILE} names {sorted(chat)}, expected {SPECIAL_TOKENS}")
        self._special = {tok: int(chat[tok]["id"]) for tok in SPECIAL_TOKENS}
        self._canonical = {i: tok for tok, i in self._special.items()}
        # what `encode` matches as a template token: coder's strings and the configured ones
        self._by_string = dict(self._special)
        for tok in SPECIAL_TOKENS:
            self._by_string.setdefault(chat[tok]["string"], self._special[tok])
        alternatives = sorted(self._by_string, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")
        self.bos_id = int(self.meta["bos_id"])
        self.eos_id = int(self.meta["eos_id"])
        unk = self.meta.get("unk_id")
        self.unk_id = None if unk is None else int(unk)

    # --- the base library (subclasses) ------------------------------------------------------------
    @abc.abstractmethod
    def _load_base(self):
        ...

    @abc.abstractmethod
    def _encode_base(self, text: str, specials: bool) -> list[int]:
        """The base library's ids of `text` (its own special tokens matched when `specials`)."""
        ...

    @abc.abstractmethod
    def _decode_base(self, ids: list[int]) -> str:
        ...

    @abc.abstractmethod
    def _base_size(self) -> int:
        """Ids the base tokenizer defines: [0, _base_size())."""
        ...

    @abc.abstractmethod
    def _base_piece(self, i: int) -> str | None:
        ...

    @abc.abstractmethod
    def _base_tokenizer_json(self) -> str:
        """A Hugging Face tokenizer.json of the base alone (for export_hf)."""
        ...

    # --- the interface ----------------------------------------------------------------------------
    def __getstate__(self):  # the libraries' objects are rebuilt from the files (grain workers)
        return {"files": self._files, "source": self.source}

    def __setstate__(self, state):
        self.__init__(state["files"], state.get("source", ""))

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    @classmethod
    def from_files(cls, files: dict[str, bytes], source: str = "") -> "PretrainedTokenizer":
        return cls(files, source=source)

    @property
    def vocab_size(self) -> int:
        """Ids are in [0, vocab_size): the base's and the added template tokens'."""
        return max(self._base_size(), max(self._special.values()) + 1)

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows the model needs for these ids (not rounded: the base model fixes its
        own row count; a model may have more rows, e.g. the checkpoint's unused ones)."""
        return self.vocab_size

    @property
    def added_tokens(self) -> dict[str, int]:
        """{template token: id} of the tokens added to the base (new embedding rows)."""
        chat = self.meta["chat"]
        return {tok: self._special[tok] for tok in SPECIAL_TOKENS if chat[tok]["added"]}

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`: the template's tokens (coder's strings or the configured ones)
        are single ids, the rest is the base library's encoding. allow_special=False encodes
        every special string (the template's and the base's own) as ordinary text."""
        if not allow_special:
            return self._encode_base(text, specials=False)
        ids: list[int] = []
        for i, part in enumerate(self._split_re.split(text)):
            if i % 2:
                ids.append(self._by_string[part])
            elif part:
                ids += self._encode_base(part, specials=True)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; template tokens decode to coder's strings (SPECIAL_TOKENS), ids the
        tokenizer does not define (padding rows) to nothing."""
        out, run = [], []
        size = self._base_size()
        for i in ids:
            i = int(i)
            if i in self._canonical:
                if run:
                    out.append(self._decode_base(run))
                    run = []
                out.append(self._canonical[i])
            elif 0 <= i < size:
                run.append(i)
        if run:
            out.append(self._decode_base(run))
        return "".join(out)

    def id_to_piece(self, i: int) -> str:
        i = int(i)
        if i in self._canonical:
            return self._canonical[i]
        piece = self._base_piece(i) if 0 <= i < self._base_size() else None
        return "" if piece is None else piece

    # --- back to the ecosystem ------------------------------------------------------------------
    def export_hf(self, directory: str) -> list[str]:
        """Write files transformers' AutoTokenizer loads into `directory`: tokenizer.json (the
        base with the added template tokens at their ids, gaps filled by reserved tokens),
        tokenizer_config.json (bos / eos, and a chat template rendering coder's), the base's own
        files and CHAT_FILE. Returns the file names written."""
        from etils import epath
        from tokenizers import AddedToken, Tokenizer as HFTok

        tok = HFTok.from_str(self._base_tokenizer_json())
        chat = self.meta["chat"]
        by_id = {self._special[t]: chat[t]["string"] for t in SPECIAL_TOKENS if chat[t]["added"]}
        size = tok.get_vocab_size(with_added_tokens=True)
        for i in range(size, max(by_id, default=size - 1) + 1):
            content = by_id.get(i, _RESERVED.format(i))
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            got = tok.token_to_id(content)
            if got != i:
                raise ValueError(f"export_hf: {content!r} got id {got}, expected {i}")
        strings = {t: chat[t]["string"] for t in SPECIAL_TOKENS}
        roles = {role: strings[f"<|{role}|>"] for role in ROLES}
        template = (
            "{%- set roles = " + json.dumps(roles) + " -%}"
            "{%- for message in messages -%}"
            "{{ roles[message['role']] + message['content'] + " + json.dumps(strings["<|end|>"]) + " }}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ " + json.dumps(roles["assistant"]) + " }}{%- endif -%}"
        )
        piece = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": piece(self.bos_id),
            "eos_token": piece(self.eos_id),
            "unk_token": piece(self.unk_id),
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": template,
            "coder_tokenizer_kind": self.kind,
        }
        out = {**self._files,  # the base's own (its tokenizer.json replaced by the one below)
               "tokenizer.json": tok.to_str().encode(),
               "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode()}
        d = epath.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name, data in out.items():
            (d / name).write_bytes(data)
        return sorted(out)


class HFTokenizer(PretrainedTokenizer):
    """A Hugging Face `tokenizers` model (`tokenizer.json`, as DeepSeek-V3 ships)."""

    kind = "hf_tokenizers"
    BASE_FILES = ("tokenizer.json",)

    def _load_base(self):
        from tokenizers import Tokenizer as HFTok

        text = self._files["tokenizer.json"].decode("utf-8")
        self._tok = HFTok.from_str(text)
        self._tok_plain = HFTok.from_str(text)  # the base's special strings as ordinary text
        self._tok_plain.encode_special_tokens = True

    def _encode_base(self, text, specials):
        return (self._tok if specials else self._tok_plain).encode(text, add_special_tokens=False).ids

    def _decode_base(self, ids):
        return self._tok.decode(ids, skip_special_tokens=False)

    def _base_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _base_piece(self, i):
        return self._tok.id_to_token(i)

    def _base_tokenizer_json(self):
        return self._files["tokenizer.json"].decode("utf-8")

    @staticmethod
    def base_tokens(files: dict[str, bytes]) -> tuple[dict[str, int], int]:
        """({added / special token string: id}, id count) of a tokenizer.json."""
        from tokenizers import Tokenizer as HFTok

        tok = HFTok.from_str(files["tokenizer.json"].decode("utf-8"))
        added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        return added, tok.get_vocab_size(with_added_tokens=True)


def _read_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """A tiktoken BPE file (one `base64(token) rank` per line) -> {token bytes: rank}."""
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (tokenizers' ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges that rebuild tiktoken's ranks, in rank order: each multi-byte token is the
    merge of the two parts the ranks below its own produce (as tiktoken's BPE does)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"tiktoken rank {rank}: {token!r} is not the merge of two lower ranks")
        merges.append((parts[0], parts[1]))
    return merges


class TiktokenTokenizer(PretrainedTokenizer):
    """A tiktoken BPE (`tiktoken.model`, as Kimi K2 ships) encoded by tiktoken; CHAT_FILE also
    holds the pre-tokenizer `pattern` and the base's `special_tokens` {string: id}."""

    kind = "tiktoken"
    BASE_FILES = ("tiktoken.model",)

    def _load_base(self):
        import tiktoken

        self._ranks = _read_tiktoken_ranks(self._files["tiktoken.model"])
        specials = {k: int(v) for k, v in self.meta.get("special_tokens", {}).items()}
        self._enc = tiktoken.Encoding(name="coder", pat_str=self.meta["pattern"],
                                      mergeable_ranks=self._ranks, special_tokens=specials)
        self._valid = set(self._ranks.values()) | set(specials.values())

    def _encode_base(self, text, specials):
        if specials:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def _decode_base(self, ids):
        return self._enc.decode_bytes([i for i in ids if i in self._valid]).decode("utf-8", "replace")

    def _base_size(self):
        return self._enc.max_token_value + 1

    def _base_piece(self, i):
        if i not in self._valid:
            return None
        return self._enc.decode_single_token_bytes(i).decode("utf-8", "replace")

    def _base_tokenizer_json(self):
        """tiktoken's ranks as a byte-level BPE (vocab + merges, ignore_merges like tiktoken),
        its pattern as the pre-tokenizer's split and its special tokens as added tokens."""
        from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers

        b2u = _bytes_to_unicode()
        text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
        vocab = {text(t): r for t, r in self._ranks.items()}
        merges = [(text(a), text(b)) for a, b in _tiktoken_merges(self._ranks)]
        tok = HFTok(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(self.meta["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        specials = sorted(self.meta.get("special_tokens", {}).items(), key=lambda kv: kv[1])
        for content, i in specials:
            for j in range(tok.get_vocab_size(with_added_tokens=True), int(i)):
                tok.add_special_tokens([AddedToken(_RESERVED.format(j), special=True, normalized=False)])
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        return tok.to_str()

    @staticmethod
    def base_tokens(files: dict[str, bytes], special_tokens: dict[str, int]) -> tuple[dict[str, int], int]:
        size = len(_read_tiktoken_ranks(files["tiktoken.model"]))
        return dict(special_tokens), max([size - 1, *special_tokens.values()]) + 1


def _token_content(value) -> str | None:
    """A tokenizer_config.json token entry (a string or {"content": ...}) -> its string."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_optional_json(directory, name: str) -> dict:
    from etils import epath

    f = epath.Path(directory) / name
    return json.loads(f.read_text()) if f.exists() else {}


def tokenizer_files_in(directory: str) -> str | None:
    """The kind of pretrained tokenizer a directory holds ("hf_tokenizers" | "tiktoken"), or None."""
    from etils import epath

    d = epath.Path(directory)
    if (d / "tokenizer.json").exists():
        return "hf_tokenizers"
    if (d / "tiktoken.model").exists():
        return "tiktoken"
    return None


def load_pretrained(path: str, chat_tokens: dict | None = None, *, first_new_id: int = 0,
                    pattern: str = "", model_config: dict | None = None,
                    log: Callable[..., None] | None = None) -> PretrainedTokenizer:
    """The tokenizer a pretrained model ships, with coder's chat template.

    path: a directory (local or fsspec URL) holding `tokenizer.json` (kind hf_tokenizers) or
      `tiktoken.model` (kind tiktoken), with the `tokenizer_config.json` beside it when there is
      one (bos / eos / unk, and a tiktoken model's special tokens: `added_tokens_decoder`); or
      one of those files.
    chat_tokens: `data.chat_tokens` ({name in CHAT_TOKEN_NAMES: string}; missing names default
      to coder's SPECIAL_TOKENS). A string the base has as an added / special token is used as
      is; any other is added with a new id.
    first_new_id: the first id an added token may take (the checkpoint's embedding rows), so
      the ids the base model trained keep their meaning.
    pattern: the pre-tokenizer regex of a tiktoken file ("" = Kimi K2's, KIMI_K2_PATTERN).
    model_config: the checkpoint's config.json ({bos,eos}_token_id when tokenizer_config.json
      names none).
    """
    import fsspec
    from etils import epath

    log = log or logging.info
    p = epath.Path(path)
    directory = p if p.is_dir() else p.parent
    kind = tokenizer_files_in(directory) if p.is_dir() else (
        "hf_tokenizers" if p.name.endswith(".json") else "tiktoken")
    if kind is None:
        raise FileNotFoundError(f"{path}: no tokenizer.json (Hugging Face tokenizers) or "
                                "tiktoken.model (tiktoken) in it; set data.tokenizer to the "
                                "directory or file of the base model's tokenizer")
    name = "tokenizer.json" if kind == "hf_tokenizers" else "tiktoken.model"
    base_file = p / name if p.is_dir() else p
    with fsspec.open(os.fspath(base_file), "rb") as f:
        files = {name: f.read()}
    tcfg = _read_optional_json(directory, "tokenizer_config.json")
    model_config = model_config or {}
    meta: dict = {"first_new_id": int(first_new_id)}
    if kind == "tiktoken":
        specials = {}
        for i, entry in (tcfg.get("added_tokens_decoder") or {}).items():
            content = _token_content(entry)
            if content is not None:
                specials[content] = int(i)
        n_ranks = len(_read_tiktoken_ranks(files[name]))
        if specials:  # Kimi: 256 reserved ids after the ranks, unnamed ones reserved tokens
            for j in range(n_ranks, max(specials.values())):
                if j not in specials.values():
                    specials[f"<|reserved_token_{j}|>"] = j
        meta.update(pattern=pattern or KIMI_K2_PATTERN, special_tokens=specials)
        base_special, base_size = TiktokenTokenizer.base_tokens(files, specials)
    else:
        base_special, base_size = HFTokenizer.base_tokens(files)

    def token_id(key: str, id_key: str):
        content = _token_content(tcfg.get(key))
        if content is not None and content in base_special:
            return base_special[content]
        value = model_config.get(id_key)
        return int(value) if isinstance(value, int) else None

    # the template's tokens: the base's own where it has the (configured) string, else new ids
    names = dict(DEFAULT_CHAT_TOKENS)
    unknown = set(chat_tokens or {}) - set(names)
    if unknown:
        raise ValueError(f"data.chat_tokens: unknown names {sorted(unknown)}; names: {CHAT_TOKEN_NAMES}")
    names.update({k: str(v) for k, v in (chat_tokens or {}).items() if v})
    next_id = max(base_size, int(first_new_id))
    chat, found, added = {}, [], []
    for key, canonical in DEFAULT_CHAT_TOKENS.items():
        string = names[key]
        if string in base_special:
            i, new = base_special[string], False
            found.append(f"{key}={string!r}:{i}")
        else:
            i, new = next_id, True
            next_id += 1
            added.append(f"{key}={string!r}:{i}")
        chat[canonical] = {"name": key, "string": string, "id": i, "added": new}
    ids = [c["id"] for c in chat.values()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"data.chat_tokens map two template tokens to one id: {chat}")
    end = chat["<|end|>"]["id"]
    eos = token_id("eos_token", "eos_token_id")
    bos = token_id("bos_token", "bos_token_id")
    meta.update(
        chat=chat,
        eos_id=end if eos is None else eos,
        bos_id=(end if eos is None else eos) if bos is None else bos,
        unk_id=token_id("unk_token", "unk_token_id"),
    )
    files[CHAT_FILE] = json.dumps(meta, sort_keys=True, ensure_ascii=False).encode()
    cls = HFTokenizer if kind == "hf_tokenizers" else TiktokenTokenizer
    tok = cls(files, source=f"{path} ({kind})")
    log("tokenizer %s: %s, %d ids; chat tokens of the base: %s; added (new ids from %d): %s",
        path, kind, base_size, ", ".join(found) or "none", max(base_size, int(first_new_id)),
        ", ".join(added) or "none")
    if eos is None or bos is None:
        log("tokenizer %s names no %s: %s is used", path,
            " / ".join(n for n, v in (("bos", bos), ("eos", eos)) if v is None), "<|end|>'s id" if eos is None else "eos")
    return tok


# --- training ---------------------------------------------------------------------------------
def _chunks(texts: Iterable[str]) -> Iterator[str]:
    """Splits texts at line boundaries into training "sentences" of <= _CHUNK_CHARS characters.

    SentencePiece learns pieces within a sentence; passing multi-line chunks (rather than one
    line per sentence, its file-reading default) lets it learn pieces that hold newlines.
    """
    for text in texts:
        chunk = ""
        for line in text.splitlines(keepends=True):
            line = line[:_CHUNK_CHARS]
            if len(chunk) + len(line) > _CHUNK_CHARS and chunk:
                yield chunk
                chunk = ""
            chunk += line
        if chunk:
            yield chunk


def _trainer_options(vocab_size: int, model_type: str) -> dict:
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,  # unigram: trains ~10 s on 3 MB, encodes ~6x faster than bpe here
        user_defined_symbols=list(SPECIAL_TOKENS),
        pad_id=PAD,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        max_sentence_length=_MAX_SENTENCE_BYTES,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_type: str = "unigram") -> Tokenizer:
    """Trains a tokenizer on `texts` (the caller bounds their size: training time ~ text size)."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(texts),
        model_writer=proto,
        **_trainer_options(vocab_size, model_type),
    )
    return Tokenizer(proto.getvalue())


def sample_texts(texts: Iterable[str], max_chars: int) -> list[str]:
    """The first texts of `texts` totalling at most about `max_chars` characters."""
    out, total = [], 0
    for text in texts:
        if total >= max_chars:
            break
        text = text[: max_chars - total]
        out.append(text)
        total += len(text)
    return out


def _corpus_sample(config, max_chars: int) -> list[str]:
    """Training text for a tokenizer: the configured sources, or the stdlib corpus's train split."""
    if config.data.sources:
        texts = sources.iterate_texts(config.data.sources, config.data.heldout_fraction)
        return sample_texts(texts, max_chars)
    docs = [d["text"] for d in corpus.documents("train", config.data.heldout_fraction)]
    # A fixed shuffle so the sample spans the whole library, not just the first packages.
    random.Random(0).shuffle(docs)
    return sample_texts(docs, max_chars)


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "coder", "tokenizers")


def load_or_train(config, cache_dir: str | None = None, max_chars: int = 3_000_000) -> ChatTemplate:
    """The tokenizer of `config.data`: the given file (`load`), or one trained once and cached.

    The cache key is a hash of the training sample, the vocabulary size and the trainer version,
    so a changed corpus or vocabulary trains a new model. Two processes racing both train and
    both write the same bytes through an atomic rename; neither reads a partial file. Stages do
    not call this directly: coder.train.checkpoint.stage_tokenizer takes a checkpoint's
    tokenizer when there is one, and `load_or_train_shared` (process 0 only) otherwise.
    """
    if config.data.tokenizer:
        return load_config(config, config.data.tokenizer)
    texts = _corpus_sample(config, max_chars)
    key = hashlib.sha256()
    key.update(f"v{_TRAINER_VERSION}:{config.data.tokenizer_vocab_size}:".encode())
    for text in texts:
        key.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    path = os.path.join(cache_dir or default_cache_dir(), f"tokenizer-{key.hexdigest()[:16]}.model")
    what = "data.sources" if config.data.sources else f"corpus {config.data.corpus}"
    source = f"trained on {what}, vocab {config.data.tokenizer_vocab_size} (cached at {path})"
    if os.path.exists(path):
        tokenizer = Tokenizer.load(path)
    else:
        tokenizer = train_tokenizer(texts, config.data.tokenizer_vocab_size)
        tokenizer.save(path)
    tokenizer.source = source
    return tokenizer


# --- tokenizers in checkpoints, and shared between processes ----------------------------------------------
# kind -> loader of a tokenizer from its files ({name: bytes}) and a source description.
KINDS: dict[str, Callable[..., ChatTemplate]] = {
    "sentencepiece": Tokenizer.from_files,
    HFTokenizer.kind: HFTokenizer.from_files,
    TiktokenTokenizer.kind: TiktokenTokenizer.from_files,
}


def load(path: str, chat_tokens: dict | None = None, pattern: str = ""):
    """The tokenizer at `path` (`data.tokenizer`), local or fsspec: coder's sentencepiece .model
    file, or a pretrained one (`load_pretrained`: a directory holding tokenizer.json or
    tiktoken.model, or one of those files, with the chat tokens `chat_tokens`)."""
    from etils import epath

    p = epath.Path(path)
    if p.name.endswith(".json") or p.name == "tiktoken.model" or (p.is_dir() and tokenizer_files_in(p)):
        return load_pretrained(path, chat_tokens, pattern=pattern)
    return Tokenizer.load(path)


def load_config(config, path: str):
    """`load(path)` with the config's chat tokens and tiktoken pattern (`config.data`)."""
    return load(path, chat_tokens=dict(config.data.chat_tokens), pattern=config.data.tiktoken_pattern)


def _files_sha256(kind: str, files: dict[str, bytes]) -> str:
    h = hashlib.sha256(kind.encode() + b"\0")
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "big") + files[name])
    return h.hexdigest()


def fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's kind and files: equal fingerprints, equal ids for every text."""
    return _files_sha256(tokenizer.kind, tokenizer.files())


def to_record(tokenizer) -> dict:
    """The JSON record a checkpoint stores: {"kind", "files": {name: base64}, "sha256", "source"}."""
    files = tokenizer.files()
    return {
        "kind": tokenizer.kind,
        "files": {name: base64.b64encode(data).decode("ascii") for name, data in files.items()},
        "sha256": _files_sha256(tokenizer.kind, files),
        "source": getattr(tokenizer, "source", ""),
    }


def from_record(record: dict, where: str = "") -> ChatTemplate:
    """The tokenizer of a `to_record` record (`where`: the checkpoint it came from, for errors)."""
    kind = record.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where or 'tokenizer record'}: unknown tokenizer kind {kind!r}; known: {sorted(KINDS)}")
    files = {name: base64.b64decode(data) for name, data in record["files"].items()}
    digest = _files_sha256(kind, files)
    if record.get("sha256") not in (None, digest):
        raise ValueError(f"{where or 'tokenizer record'}: the tokenizer files do not match their "
                         f"sha256 {record['sha256'][:16]} (got {digest[:16]}): the item is corrupt")
    return KINDS[kind](files, source=record.get("source") or where)


def load_or_train_shared(config, cache_dir: str | None = None) -> ChatTemplate:
    """`load_or_train` on process 0 only; the other processes receive its files (broadcast), so
    every host uses the same tokenizer whatever its own Python or cache holds."""
    import jax

    if jax.process_count() == 1:
        return load_or_train(config, cache_dir)
    from jax.experimental import multihost_utils

    data = b""
    if jax.process_index() == 0:
        data = json.dumps(to_record(load_or_train(config, cache_dir))).encode()
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.frombuffer(data, np.uint8) if jax.process_index() == 0 else np.zeros(n, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8).tobytes()
    return from_record(json.loads(data), "process 0")
