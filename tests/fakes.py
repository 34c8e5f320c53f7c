"""Small fakes the data and eval tests share."""


class CharTokenizer:
    """One token per character (ids 3 .. 3 + modulus - 1), bos 1, eos 2: what the packer and the
    long-context eval need of a tokenizer. `modulus` bounds the ids (a model's small vocabulary)."""
    bos_id, eos_id = 1, 2

    def __init__(self, modulus: int = 250):
        self.modulus = modulus

    def encode(self, text):
        return [3 + ord(c) % self.modulus for c in text]
