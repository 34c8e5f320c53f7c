"""Committed fits: the small fitted models several tests start from, stored in tests/data/fits.

A test that needs a model fitted to a toy format (the RL toys' SFT-ed policies, the serving
tests' greeter, the real-time learning test's number picker) loads the committed weights when
they were made by the same recipe, and fits otherwise. Fitting is tens of seconds of CPU per
model on the CI's 2 cores, paid again by every xdist worker that needs it; and with the weights
committed, every machine starts those tests from the same weights whatever its float rounding.

A fit is `{name}.npz` (the model's flat state, float32 as trained) and `{name}.json` (its key and
what the fit reported, e.g. the last loss). The key is a digest of the tokenizer's model and of
the recipe (the model config, the fit's arguments and source): change any of them and the test
warns and fits again, until `python -m tests.fits` refreshes the committed files.
"""
import hashlib
import importlib
import inspect
import json
import os
import warnings

import numpy as np

FITS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fits")

# name -> the module that owns the fit: its `fit_key(name)` is the current recipe's key and its
# `write_fit(directory, name)` fits and saves (`python -m tests.fits` runs them all)
OWNERS = {
    "toy_policy": "tests.rl_toy",
    "file_policy": "tests.rl_toy",
    "serve_greeter": "tests.serve.test_serve",
    "realtime_picker": "tests.rl.test_realtime_learning",
}


def key(tok, *fit_fns, **recipe) -> str:
    """sha256 of the tokenizer's model, the source of `fit_fns` (the fit and what it calls) and
    `recipe` (JSON-able values: a config dict, step counts, learning rates, seeds)."""
    h = hashlib.sha256(tok.model_proto)
    for fn in fit_fns:
        h.update(inspect.getsource(fn).encode())
    h.update(json.dumps(recipe, sort_keys=True, default=str).encode())
    return h.hexdigest()


def committed(name: str, fit_key: str) -> dict | None:
    """The committed fit's metadata when `tests/data/fits/{name}` exists and was made with
    `fit_key`; None otherwise (the caller fits), and always with CODER_TEST_REFIT=1."""
    path = os.path.join(FITS_DIR, f"{name}.json")
    if os.environ.get("CODER_TEST_REFIT") == "1" or not os.path.exists(path):
        return None
    with open(path) as f:
        meta = json.load(f)
    if meta["key"] != fit_key:
        warnings.warn(f"tests/data/fits/{name}: made by another recipe or tokenizer; fitting again "
                      "(python -m tests.fits refreshes the committed fits)")
        return None
    return meta


def save(directory: str, name: str, fit_key: str, state, **meta) -> dict:
    """Writes `state` (an nnx.State) and `meta` (+ the key) as `{name}.npz` / `{name}.json`."""
    from coder.train import checkpoint as ckpt_lib

    os.makedirs(directory, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in ckpt_lib.state_to_flat(state).items()}
    np.savez_compressed(os.path.join(directory, f"{name}.npz"), **flat)
    meta = dict(meta, key=fit_key)
    with open(os.path.join(directory, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load(directory: str, name: str, template):
    """`{name}.npz` in `directory` as a state shaped like `template` (an nnx.State); a weight the
    template lacks or has in another shape is an error (flat_to_state)."""
    import jax.numpy as jnp

    from coder.train import checkpoint as ckpt_lib

    flat = np.load(os.path.join(directory, f"{name}.npz"))
    return ckpt_lib.flat_to_state(template, {k: jnp.asarray(v) for k, v in flat.items()})


if __name__ == "__main__":  # refresh every committed fit: python -m tests.fits [name ...]
    import sys

    import tests.conftest  # noqa: F401  (the suite's XLA flags: the fits are made as the tests would)

    for fit_name in sys.argv[1:] or OWNERS:
        print(fit_name, importlib.import_module(OWNERS[fit_name]).write_fit(FITS_DIR, fit_name))
