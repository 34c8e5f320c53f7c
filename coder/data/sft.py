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
"""
from coder.data import pretrain, sources
from coder.data import tokenizer as tokenizer_lib
from coder.data.pretrain import bad_doc


def validate_messages(messages) -> bool:
    """True for a list of {"role", "content": str} with known roles and an assistant turn."""
    if not isinstance(messages, list) or not messages:
        return False
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in tokenizer_lib.ROLES:
            return False
        if not isinstance(m.get("content"), str):
            return False
    return any(m["role"] == "assistant" for m in messages)


class SftTransform:
    """(source index, raw record) -> {"tokens", "loss_mask", "source", "bad", "truncated", "dropped"}."""

    def __init__(self, tokenizer, specs: list[dict], seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.formats = [(s["format"], s["text_field"]) for s in specs]

    def __call__(self, item) -> dict:
        source_index, raw = item
        fmt, field = self.formats[source_index]
        obj, bad = sources.parse_record(raw, fmt, field)
        if bad is not None:
            return bad_doc(source_index, bad)
        messages = obj[field]
        if not validate_messages(messages):
            return bad_doc(source_index, "invalid_conversation")
        try:
            ids, mask = self.tokenizer.render_conversation(messages)
        except UnicodeEncodeError:
            # Lone surrogates from JSON "\ud800" escapes.
            return bad_doc(source_index, "invalid_utf8")
        truncated = len(ids) > self.seq_len
        ids, mask = ids[: self.seq_len], mask[: self.seq_len]
        return {
            "source": source_index,
            "bad": -1,
            "tokens": ids,
            "loss_mask": mask,
            "truncated": truncated,
            # Index 0 is never a target (it has no predecessor), so it cannot carry the loss.
            "dropped": not mask[1:].any(),
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
) -> pretrain.DataIterator:
    """Packed SFT batches of this host. Keyword arguments as in make_pretrain_iterator.

    The held-out split is a hash of each conversation's index (config.data.heldout_fraction).
    """
    if num_epochs == -1:
        num_epochs = None if split == "train" else 1
    specs = normalize_data(data)
    return pretrain.build_iterator(
        config,
        specs,
        SftTransform(tokenizer, specs, seq_len or config.data.seq_len),
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

