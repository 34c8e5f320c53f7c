"""Tokenizers behind one interface (the chat / tool template: coder.data.chat_template).

Three kinds (`KINDS`, the `kind` of a checkpoint's tokenizer record):
  "sentencepiece"  coder's own (`Tokenizer`): trained by `train_tokenizer` on the corpus (the
                   quickstart), the special tokens at fixed ids (below);
  "hf_tokenizers"  a Hugging Face `tokenizers` model, `tokenizer.json` (DeepSeek-V3 ships one);
  "tiktoken"       a tiktoken BPE file, `tiktoken.model` (Kimi K2 ships one), encoded by tiktoken.
The last two (coder.data.pretrained_tokenizer: `PretrainedTokenizer`, `load_pretrained`) come
with a pretrained base model, the chat template's tokens configurable strings there
(`data.chat_tokens`). This module is the public entry point: the sentencepiece kind and its
training, and the dispatch between the kinds (`load`, `load_config`, `KINDS`, `to_record` /
`from_record`, `fingerprint`, `load_or_train`, `load_or_train_shared`).

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
import base64
import hashlib
import io
import json
import os
import random
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import sentencepiece as spm

from coder.data import corpus, sources
from coder.data.chat_template import SPECIAL_TOKENS, ChatTemplate
from coder.data.pretrained_tokenizer import (HFTokenizer, TiktokenTokenizer, load_pretrained,
                                             tokenizer_files_in)
import fsspec

PAD, UNK, BOS, EOS = 0, 1, 2, 3
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
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


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_type: str = "unigram",
                    symbols: Iterable[str] = ()) -> Tokenizer:
    """Trains a tokenizer on `texts` (the caller bounds their size: training time ~ text size).
    `symbols`: strings that are always one piece each (ids after the special tokens')."""
    proto = io.BytesIO()
    options = _trainer_options(vocab_size, model_type)
    # SentencePiece matches symbols in the text after it has escaped spaces as U+2581: a symbol
    # holding a plain space would never match
    symbols = [s.replace(" ", "\u2581") for s in symbols]
    options["user_defined_symbols"] += [s for s in symbols if s not in options["user_defined_symbols"]]
    spm.SentencePieceTrainer.train(sentence_iterator=_chunks(texts), model_writer=proto, **options)
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


# The agent text is ~12k characters for the quickstart's 36 toy tasks against a 3M-character corpus
# sample: repeated so its words (file names, the replies' phrases) weigh enough to get pieces.
_AGENT_TEXT_REPEATS = 20

# config -> (texts, symbols) of the agent's format, for data.tokenizer_agent_text: the env's
# (coder.env.transcripts.tokenizer_agent_text), passed in by the stages, as data sits below env
AgentText = Callable[..., tuple[list[str], list[str]]]


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "coder", "tokenizers")


def load_or_train(config, cache_dir: str | None = None, max_chars: int = 3_000_000,
                  agent_text: AgentText | None = None) -> ChatTemplate:
    """The tokenizer of `config.data`: the given file (`load`), or one trained once and cached.
    With data.tokenizer_agent_text, `agent_text(config)` gives the agent's texts (repeated into
    the sample) and symbols (one piece each); ValueError without it.

    The cache key is a hash of the training sample, the vocabulary size and the trainer version,
    so a changed corpus or vocabulary trains a new model. Two processes racing both train and
    both write the same bytes through an atomic rename; neither reads a partial file. Stages do
    not call this directly: coder.train.checkpoint.stage_tokenizer takes a checkpoint's
    tokenizer when there is one, and `load_or_train_shared` (process 0 only) otherwise.
    """
    if config.data.tokenizer:
        return load_config(config, config.data.tokenizer)
    texts, symbols = _corpus_sample(config, max_chars), []
    if config.data.tokenizer_agent_text:
        if agent_text is None:
            raise ValueError("data.tokenizer_agent_text: training a tokenizer on the agent's format needs "
                             "its text (agent_text=coder.env.transcripts.tokenizer_agent_text)")
        agent_texts, symbols = agent_text(config)
        texts += agent_texts * _AGENT_TEXT_REPEATS
    key = hashlib.sha256()
    key.update(f"v{_TRAINER_VERSION}:{config.data.tokenizer_vocab_size}:".encode())
    for text in texts:
        key.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    key.update(json.dumps(symbols).encode())
    path = os.path.join(cache_dir or default_cache_dir(), f"tokenizer-{key.hexdigest()[:16]}.model")
    what = "data.sources" if config.data.sources else f"corpus {config.data.corpus}"
    what += " and the agent's format" if symbols else ""
    source = f"trained on {what}, vocab {config.data.tokenizer_vocab_size} (cached at {path})"
    if os.path.exists(path):
        tokenizer = Tokenizer.load(path)
    else:
        tokenizer = train_tokenizer(texts, config.data.tokenizer_vocab_size, symbols=symbols)
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


def load_or_train_shared(config, cache_dir: str | None = None, agent_text: AgentText | None = None) -> ChatTemplate:
    """`load_or_train` on process 0 only; the other processes receive its files (broadcast), so
    every host uses the same tokenizer whatever its own Python or cache holds."""
    import jax  # heavy: jax (this module loads without it)

    if jax.process_count() == 1:
        return load_or_train(config, cache_dir, agent_text=agent_text)
    from jax.experimental import multihost_utils

    data = b""
    if jax.process_index() == 0:
        data = json.dumps(to_record(load_or_train(config, cache_dir, agent_text=agent_text))).encode()
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.frombuffer(data, np.uint8) if jax.process_index() == 0 else np.zeros(n, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8).tobytes()
    return from_record(json.loads(data), "process 0")
