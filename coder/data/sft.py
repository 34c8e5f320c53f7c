"""SFT input pipeline: JSONL conversations -> chat template -> whole conversations packed in rows.

Entry point for the trainer (same iterator interface as coder.data.pretrain):

    it = make_sft_iterator(config, tokenizer, data="sft/*.jsonl", split="train",
                           process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)   # tokens, positions, segment_ids [rows, seq_len] int32; loss_mask float32

`data` is a path / glob / fsspec URL, or a list of source specs (see coder.data.sources) whose
`text_field` defaults to "messages". One conversation per line (docs/contracts.md):
`{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}`.

Each conversation is rendered by `Tokenizer.render_conversation` (the template the RL agent loop
uses, so SFT and RL see identical token sequences) and is one segment: positions restart at 0
and `loss_mask` is 1 exactly on assistant text tokens and their `<|end|>`.

Packing never splits a conversation: conversations are placed whole, first fit, in the rows of
a batch. A conversation longer than seq_len is truncated to its first seq_len tokens and
counted (`data/truncated`); if no assistant token survives the cut it is dropped and counted
(`data/dropped`). Malformed conversations (not a list of {role, content} dicts with a known role
and string content, or no assistant turn) are bad records of kind "invalid_conversation".

When nothing can make a batch the pipeline raises `SftDataError` (a ValueError) naming the key
to change instead of spinning forever: the split holds no record (`data.heldout_fraction`), or
every conversation read since the last usable one was dropped as too long (or bad) for a whole
pass over the data (a finite pass: all of it; the endless training stream: 4 x the records of
the largest source per its mixture share, + read-ahead). The message names `sft.seq_len`, how
many conversations were dropped, the longest one and the shortest `sft.seq_len` that keeps one.
"""
import math
import threading

import numpy as np

from coder.data import chat_template, pretrain, sources
from coder.data.pretrain import bad_doc


def validate_messages(messages) -> bool:
    """True for a list of {"role", "content": str} with known roles and an assistant turn."""
    if not isinstance(messages, list) or not messages:
        return False
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in chat_template.ROLES:
            return False
        if not isinstance(m.get("content"), str):
            return False
    return any(m["role"] == "assistant" for m in messages)


class SftDataError(ValueError):
    """The SFT data cannot make a batch (the message names the key to change)."""


class SftTransform:
    """(source index, raw record) -> {"tokens", "loss_mask", "source", "bad", "truncated", "dropped"}.

    `limit`: raise SftDataError when this many records in a row (since the last usable one)
    were dropped or bad (0 = never): the pipeline's packer would otherwise wait forever for a
    conversation that fits. Counters are per process (grain worker processes each count theirs).
    """

    def __init__(self, tokenizer, specs: list[dict], seq_len: int, limit: int = 0, exclude=None):
        self.tokenizer, self.seq_len, self.limit, self.exclude = tokenizer, seq_len, limit, exclude
        self.formats = [(s["format"], s["text_field"]) for s in specs]
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self._run = 0  # records read since the last usable conversation
        self._dropped, self._bad, self._heldout = set(), set(), set()  # the distinct records since then
        self._longest = 0  # tokens of the longest dropped conversation
        self._first_loss = None  # smallest seq_len that would keep one of them

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]  # grain worker processes get a copy of the transform
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @staticmethod
    def _key(source_index: int, raw) -> int:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raw = bytes(raw)
        elif not isinstance(raw, str):  # a Parquet cell: the messages themselves
            raw = repr(raw)
        return hash((source_index, raw))

    def _unusable(self, source_index: int, raw, n_tokens: int = 0, first_loss: int = 0, heldout: bool = False):
        """Count a dropped conversation (n_tokens > 0), one overlapping held-out code (`heldout`)
        or a bad record; raise past `limit`."""
        if not self.limit:
            return
        key = self._key(source_index, raw)
        with self._lock:
            self._run += 1
            if heldout:
                self._heldout.add(key)
            elif n_tokens:
                self._dropped.add(key)
                self._longest = max(self._longest, n_tokens)
                self._first_loss = min(first_loss, self._first_loss or first_loss)
            else:
                self._bad.add(key)
            if self._run >= self.limit:
                raise SftDataError(self._message())

    def _message(self) -> str:
        n = self.seq_len
        read = (f"none of the last {self._run} records read (a whole pass over the data) was "
                "usable")
        bad = (f"{len(self._bad)} records were bad (not conversations: the data/bad_* counters "
               "say which kind)")
        heldout = (f"{len(self._heldout)} conversations overlap the held-out tasks' code "
                   "(data.exclude_tasks, coder.data.decontaminate)")
        if not self._dropped:
            reasons = [r for r, seen in ((bad, self._bad), (heldout, self._heldout)) if seen]
            return f"SFT data cannot make a batch: {', '.join(reasons)}, and {read}."
        return (
            f"SFT data cannot make a batch: no conversation fits in sft.seq_len={n} tokens (the "
            f"sft stage's data.seq_len; 0 = data.seq_len): {len(self._dropped)} conversations "
            f"were dropped as too long (no assistant token in their first {n} tokens; the "
            f"longest has {self._longest} tokens; sft.seq_len >= {self._first_loss} keeps at "
            f"least one){', ' + bad if self._bad else ''}{', ' + heldout if self._heldout else ''}, and {read}. Raise sft.seq_len (and "
            "longctx.seq_len, so the model is trained at that length) or give shorter "
            "conversations."
        )

    def __call__(self, item) -> dict:
        source_index, raw = item
        fmt, field = self.formats[source_index]
        obj, bad = sources.parse_record(raw, fmt, field)
        if bad is not None:
            self._unusable(source_index, raw)
            return bad_doc(source_index, bad)
        messages = obj[field]
        if not validate_messages(messages):
            self._unusable(source_index, raw)
            return bad_doc(source_index, "invalid_conversation")
        if self.exclude is not None and self.exclude.contaminated("\n".join(m["content"] for m in messages)):
            self._unusable(source_index, raw, heldout=True)
            return pretrain.heldout_doc(source_index)
        try:
            ids, mask = self.tokenizer.render_conversation(messages)
        except UnicodeEncodeError:
            # Lone surrogates from JSON "\ud800" escapes.
            self._unusable(source_index, raw)
            return bad_doc(source_index, "invalid_utf8")
        n_tokens = len(ids)
        truncated = n_tokens > self.seq_len
        # Index 0 is never a target (it has no predecessor), so it cannot carry the loss.
        dropped = not mask[1 : self.seq_len].any()
        if dropped:
            loss_at = np.flatnonzero(mask[1:])  # the conversation needs 2 + its first one
            self._unusable(source_index, raw, n_tokens, int(loss_at[0]) + 2 if len(loss_at) else n_tokens)
        elif self.limit and self._run:
            with self._lock:
                self._reset()
        ids, mask = ids[: self.seq_len], mask[: self.seq_len]
        return {
            "source": source_index,
            "bad": -1,
            "tokens": ids,
            "loss_mask": mask,
            "truncated": truncated,
            "dropped": dropped,
        }


def normalize_data(data) -> list[dict]:
    """A path / glob / URL, or a list of paths or spec dicts -> normalized specs."""
    items = [data] if isinstance(data, (str, dict)) else list(data)
    if not items:
        raise ValueError("SFT data is empty: give a JSONL path, glob or list of source specs")
    specs = []
    for item in items:
        spec = {"path": item} if isinstance(item, str) else dict(item)
        spec.setdefault("text_field", "messages")
        specs.append(sources.normalize_spec(spec))
    return specs


# Records the reader threads may process ahead of the packer (grain ReadOptions prefetch, with
# margin): a usable record can be read up to this many records out of stream order.
_READ_AHEAD = 512


def _unusable_limit(config, specs, split, process_index, process_count, num_epochs) -> int:
    """Unusable records in a row after which no conversation can ever fit (SftTransform.limit).

    Raises SftDataError when the split holds no record at all (grain would filter forever).
    Opens each source once more for its length (a JSONL file's lines are indexed again).
    """
    lengths = [len(sources.open_source(spec)) for spec in specs]
    heldout = float(config.data.heldout_fraction)

    def in_split(i, n, stop_at_first):
        count = 0
        for j in range(n):
            if sources.record_in_split(i, j, split, heldout):
                count += 1
                if stop_at_first:
                    break
        return count

    finite = num_epochs is not None
    in_splits = [in_split(i, n, stop_at_first=not finite) for i, n in enumerate(lengths)]
    if not any(in_splits):
        raise SftDataError(
            f"SFT data has no conversation in the {split!r} split: the {sum(lengths)} records of "
            f"{[s['name'] for s in specs]} are all held out (data.heldout_fraction={heldout}); "
            "lower data.heldout_fraction or give more conversations"
        )
    if finite:  # every record of this host's passes, exactly
        return len(range(process_index, sum(in_splits), process_count)) * int(num_epochs)
    # The endless stream: every record of source i comes round within n_i / share_i records (the
    # mixture's share; this host reads every process_count-th record of the stream). Four such
    # windows without a usable record mean, all but surely, that none exists.
    weights = [float(s["weight"]) for s in specs] if len(specs) > 1 else [1.0]
    total = sum(weights)
    window = max(math.ceil(n * total / w) for n, w in zip(lengths, weights) if w > 0)
    return 4 * window + _READ_AHEAD


def make_sft_iterator(
    config,
    tokenizer,
    data,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
    *,
    num_epochs: int | None = -1,
    seq_len: int | None = None,
    batch_size: int | None = None,
    exclude=None,
) -> pretrain.DataIterator:
    """Packed SFT batches of this host. Keyword arguments as in make_pretrain_iterator
    (`exclude`: conversations overlapping held-out code are left out).

    The held-out split is a hash of each conversation's index (config.data.heldout_fraction).
    """
    if num_epochs == -1:
        num_epochs = None if split == "train" else 1
    specs = normalize_data(data)
    limit = _unusable_limit(config, specs, split, process_index, process_count, num_epochs)
    return pretrain.build_iterator(
        config,
        specs,
        SftTransform(tokenizer, specs, seq_len or config.data.seq_len, limit, exclude),
        split=split,
        split_records=True,
        split_docs=False,
        process_index=process_index,
        process_count=process_count,
        num_epochs=num_epochs,
        shuffle=num_epochs != 1,
        seq_len=seq_len,
        batch_size=batch_size,
    )

