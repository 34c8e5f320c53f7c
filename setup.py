"""coder: a JAX/TPU-first training codebase for coding-agent language models."""
from setuptools import find_packages, setup

setup(
    name="coder",
    version="0.1.0",
    description="Pretraining, long-context extension, MTP, SFT, asynchronous GRPO and serving (in a bwrap "
    "sandboxed coding environment) of DeepSeek-V3/Kimi-K2 style coding agents in JAX.",
    packages=find_packages(include=["coder", "coder.*", "configs"]),
    # the GPU target configs stage compile compiles against (coder/train/aot/hardware.py)
    package_data={"coder.train.aot": ["gpu_specs/*.txtpb"]},
    python_requires=">=3.10",
    install_requires=[
        # Upper bounds: the newest minor each was tested with (jax 0.12 needs Python >= 3.12; on
        # 3.11 pip resolves jax 0.10.2, which CI runs; on Python 3.12.1 this range resolves jax
        # 0.12.0.1, flax 0.12.12, optax 0.2.8, orbax 0.12.8, grain 0.2.18: `-m "not slow"` passed
        # there, 575 tests, and the slow ones but the sync toy-learning test, whose margin is
        # still to be measured under 0.12's arithmetic, 2026-11-27); 0.11 stays admitted for the
        # GPU images that carry jax 0.11.2 with its CUDA plugin. The next minor of jax, flax and orbax has broken coder's
        # sharding / NNX / checkpoint calls before (0.12 dropped plgpu.load's index and XLA:CPU's
        # classic-emitters flag): raise a bound after a test run on it.
        "jax>=0.8,<0.13",
        # jax's dtype package (jax asks >= 0.5): 0.7.0's extension module costs 0.8-1.0 s of CPU
        # at import over 0.6.0 (measured: `import jax.numpy` + one array, 2.18 / 2.32 s against
        # 1.47 / 1.29 s, alternating), paid by every process that imports jax: the test suite
        # starts ~130 of them, a multi-host job one per host. Raise after 0.7's import is fixed.
        "ml_dtypes>=0.5,<0.7",
        "flax>=0.12,<0.13",  # NNX's Variable / Optimizer API changes between minors
        "optax>=0.2.5,<0.3",
        # the handler registry API of coder.train.checkpoint; from 0.11.30 (checked; 0.11.0 has
        # not) ArrayHandler takes min_slice_bytes_for_replica_parallel and type_handlers exports
        # supported_types
        "orbax-checkpoint>=0.11.30,<0.13",
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
        # the diagnostics tool, run by the sandbox's Python like ruff (coder/env/tools/diagnostics.py
        # says why these two); tested with mypy 2.4 and jedi 0.20
        "mypy>=2.4,<3",
        "jedi>=0.20,<0.21",
        # semantic_search's vector index (coder/env/tools/semantic_search.py says why faiss); tested with 1.15
        "faiss-cpu>=1.8,<2",
        "pytest>=8",  # the sandbox's tasks are scored with pytest
        "ray>=2.40,<3",  # RL orchestration: learner, actors and env workers (local or a cluster)
        "zstandard>=0.22",  # weight sync: zstd-compressed XOR deltas between versions
        "matplotlib>=3.9,<4",  # the run report's figures (coder/report.py, Agg canvas: no display); tested with 3.11
    ],
    extras_require={
        # transformers + CPU torch: reference implementation for the model-equivalence tests;
        # torch < 2.14: the newest CPU build the project's machines hold (2.13.0+cpu, pip's
        # find-links); PyPI's torch is a CUDA build the tests never use (measured in a new venv:
        # 32.7 s and 5.4 GB to install 2.14.1 with its CUDA libraries, 20.3 s and 0.9 GB for
        # 2.13.0+cpu; a fresh CI run installs it in a venv of its own);
        # pytest-xdist: the README's test command runs the tests in 2 worker processes (-n 2).
        # tokenizers + tiktoken: the pretrained tokenizers of tests/model/test_hf_init.py.
        # setuptools >= 70.1 builds wheels without the `wheel` package: the packaging test builds
        # coder with this environment's own tools (a new venv has setuptools 65 and no wheel);
        # filelock: the session-wide fitted toy policy of tests/conftest.py (one fit, both workers).
        # jax[cuda12-local]: the gpu-compile extra below, so CI compiles the GPU targets' tests.
        "test": ["setuptools>=70.1", "pytest>=8", "pytest-xdist>=3.5", "filelock>=3.12", "torch>=2.9,<2.14", "transformers>=4.57,<6",
                 "tokenizers>=0.20", "tiktoken>=0.7",
                 "openai>=1.40", "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27",
                 "jax[cuda12-local]>=0.8,<0.13"],
        # jax's own extra: the libtpu the installed jax was built against (0.0.42 for 0.10.2,
        # 0.0.50 for 0.12), which stage compile uses to compile for TPU topologies on a CPU.
        "tpu": ["jax[tpu]>=0.8,<0.13"],
        # Stage compile for GPU targets (compile.topology=h100, h100-8, h100-8x32, ...) on any host:
        # jax's own extra without NVIDIA libraries, the CUDA plugin matching the installed jaxlib
        # (jax-cuda12-plugin and jax-cuda12-pjrt, ~180 MB; 0.10.2 for jax 0.10.2), whose
        # compile-only devices XLA:GPU compiles for. No GPU and no CUDA runtime are needed. The test
        # extra holds it too (the GPU compile tests skip without it, naming this extra). Installed,
        # a process that starts jax on a machine without CUDA prints XLA's "Could not find cuda
        # drivers" lines to stderr (the plugin loading; measured: no CPU time to speak of, 1.0-1.1
        # s to import jax and make an array either way).
        "gpu-compile": ["jax[cuda12-local]>=0.8,<0.13"],
        # Starting from a Hugging Face checkpoint (init_from=DIR) and exporting to one: the
        # weights need no torch (safetensors' numpy framework); the tokenizer beside them is a
        # `tokenizers` tokenizer.json (DeepSeek-V3) or a tiktoken.model (Kimi K2).
        "hf": ["safetensors>=0.4", "huggingface_hub>=0.24", "tokenizers>=0.20", "tiktoken>=0.7"],
        # Stage serve: the OpenAI-compatible HTTP server over the engine.
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
        # Stores at s3:// URLs (the weight store's versions and deltas, task files, corpora): fsspec's
        # S3 filesystem. gs:// needs gcsfs, which install_requires holds; s3fs pins the fsspec it
        # was released with and pulls aiobotocore / botocore, so it is an extra.
        "s3": ["s3fs>=2024.6"],
        # The official SWE-bench harness, only for tests/env/scoring/test_grading.py's comparison of
        # coder's statuses and resolution with its parsers and grading on the same logs (skipped
        # without it). Not in `test`: its install pulls 35 packages (modal, docker, datasets,
        # pandas, pre-commit, virtualenv, ...; 5.0.2, 2026-12), and importing its parsers imports
        # docker, modal and datasets, so coder implements the rule itself (coder/env/scoring/grading.py).
        "swe": ["swebench>=5.0.2,<6"],
    },
)
