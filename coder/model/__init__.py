"""DeepSeek-V3 / Kimi-K2 model in Flax NNX (see docs/contracts.md, "Model")."""
from coder.model.transformer import Transformer, count_params, init_cache

__all__ = ["Transformer", "count_params", "init_cache"]
