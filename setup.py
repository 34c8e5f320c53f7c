"""coder: a JAX/TPU-first training codebase for coding-agent language models."""
from setuptools import find_packages, setup

setup(
    name="coder",
    version="0.1.0",
    description="Pretraining, long-context extension, MTP, SFT, asynchronous GRPO and serving (in a bwrap "
    "sandboxed coding environment) of DeepSeek-V3/Kimi-K2 style coding agents in JAX.",
    packages=find_packages(include=["coder", "coder.*", "configs"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.8,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "grain>=0.2.12,<0.3",
        "sentencepiece>=0.2,<0.3",
        "tensorstore>=0.1.70",
        "fsspec>=2024.6",
        "gcsfs>=2024.6",
        "pyarrow>=15",
        "array-record>=0.7",
        "absl-py>=2.1",
        "ml_collections>=1.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tensorboardX>=2.6",
        "ruff>=0.6",
        "pytest>=8",  # the sandbox's tasks are scored with pytest
        "ray>=2.40,<3",  # RL orchestration: learner, actors and env workers (local or a cluster)
        "zstandard>=0.22",  # weight sync: zstd-compressed XOR deltas between versions
    ],
    extras_require={
        # transformers + CPU torch: reference implementation for the model-equivalence tests;
        # pytest-xdist: the README's test command runs the tests in 2 worker processes (-n 2).
        # tokenizers + tiktoken: the pretrained tokenizers of tests/test_hf_init.py.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "torch>=2.9,<=2.14.1", "transformers>=4.57,<6",
                 "tokenizers>=0.20", "tiktoken>=0.7",
                 "openai>=1.40", "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27"],
        "tpu": ["libtpu==0.0.42.*"],  # the libtpu jax 0.10.2 was built against (jax[tpu])
        # Starting from a Hugging Face checkpoint (init_from=DIR) and exporting to one: the
        # weights need no torch (safetensors' numpy framework); the tokenizer beside them is a
        # `tokenizers` tokenizer.json (DeepSeek-V3) or a tiktoken.model (Kimi K2).
        "hf": ["safetensors>=0.4", "huggingface_hub>=0.24", "tokenizers>=0.20", "tiktoken>=0.7"],
        # Stage serve: the OpenAI-compatible HTTP server over the engine.
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
    },
)
