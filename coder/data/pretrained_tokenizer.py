"""Tokenizers of pretrained models: Hugging Face `tokenizers`, tiktoken (the kinds
"hf_tokenizers" and "tiktoken" of coder.data.tokenizer's `KINDS`).

  "hf_tokenizers"  a Hugging Face `tokenizers` model, `tokenizer.json` (DeepSeek-V3 ships one);
  "tiktoken"       a tiktoken BPE file, `tiktoken.model` (Kimi K2 ships one), encoded by tiktoken.
Both (`PretrainedTokenizer`) come with a pretrained base model (`load_pretrained`): the
chat template's special tokens are configurable strings (`data.chat_tokens`, name -> string,
default SPECIAL_TOKENS): one the base tokenizer has as an added / special token is used, one it
lacks is added as a new id after every id the checkpoint's embedding holds, and the model's
embedding and output head grow by that many rows (coder.model.hf_import). Encoding splits the
text at the template's tokens (coder's own strings and the configured ones) and encodes the
rest with the base library, so `<tool_call>` written by coder.env.protocol is one id whatever the
base calls it; decoding writes coder's own strings back. `export_hf(directory)` writes files
transformers loads (`tokenizer.json` with the added tokens at their ids, `tokenizer_config.json`
with a chat template rendering coder's).

coder.data.tokenizer (the public entry point: `load`, `KINDS`, `to_record` / `from_record`)
chooses between these and its own sentencepiece kind; this module does not import it.
"""
import abc
import base64
import json
import logging
import os
import re
from collections.abc import Callable, Iterable

from coder.data.chat_template import (CHAT_TOKEN_NAMES, DEFAULT_CHAT_TOKENS, ROLES, SPECIAL_TOKENS,
                                      ChatTemplate)

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
    pad_id = 0  # batches pad with 0 whatever the tokenizer (docs/contracts.md); never a target

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
        from tokenizers import AddedToken, Tokenizer as HFTok  # optional: the hf extra

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
        from tokenizers import Tokenizer as HFTok  # optional: the hf extra

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
        from tokenizers import Tokenizer as HFTok  # optional: the hf extra

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
        import tiktoken  # optional: the hf extra

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
        # optional: the hf extra
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
