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
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import warnings
from typing import Callable

import numpy as np

FITS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fits")

# name -> "module:attribute" of the fit's recipe (a Recipe, or tests/rl_toy.py's ToyRecipe): its
# `current_key()` is the key the current code gives it and `write(directory)` fits and saves it
# (`python -m tests.fits` runs them all)
RECIPES = {
    "toy_policy": "tests.rl_toy:SUBMIT_RECIPE",
    "file_policy": "tests.rl_toy:FILE_RECIPE",
    "serve_greeter": "tests.serve.greeter:GREETER",
    "realtime_picker": "tests.rl.test_realtime_learning:PICKER",
}


def recipe(name: str):
    module, attribute = RECIPES[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def key(tok, *fit_fns, **settings) -> str:
    """sha256 of the tokenizer's model, the source of `fit_fns` (the fit and what it calls) and
    `settings` (JSON-able values: a config dict, step counts, learning rates, seeds)."""
    h = hashlib.sha256(tok.model_proto)
    for fn in fit_fns:
        h.update(inspect.getsource(fn).encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
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
    """Writes `state` (an nnx.State) and `meta` (+ the key and the XLA flags it was fitted under)
    as `{name}.npz` / `{name}.json`."""
    from coder.train.flat import state_to_flat

    os.makedirs(directory, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in state_to_flat(state).items()}
    np.savez_compressed(os.path.join(directory, f"{name}.npz"), **flat)
    meta = dict(meta, xla_flags=os.environ.get("XLA_FLAGS", ""), key=fit_key)
    with open(os.path.join(directory, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load(directory: str, name: str, template):
    """`{name}.npz` in `directory` as a state shaped like `template` (an nnx.State); a weight the
    template lacks or has in another shape is an error (flat_to_state)."""
    import jax.numpy as jnp

    from coder.train.flat import flat_to_state

    flat = np.load(os.path.join(directory, f"{name}.npz"))
    return flat_to_state(template, {k: jnp.asarray(v) for k, v in flat.items()})


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one committed fit of a Transformer is made: `setup()` -> (tokenizer, model config),
    `fit(cfg, tok, **args)` -> (fitted model, last loss); `sources` are the functions the fit
    calls whose source enters the key beside `fit`'s own."""

    name: str
    setup: Callable
    fit: Callable
    args: dict = dataclasses.field(default_factory=dict)
    sources: tuple = ()

    def key(self, tok, cfg) -> str:
        return key(tok, self.fit, *self.sources, model=cfg.to_dict(), **self.args)

    def current_key(self) -> str:
        return self.key(*self.setup())

    def write(self, directory: str) -> dict:
        """Fits and saves, with the last loss."""
        from flax import nnx

        tok, cfg = self.setup()
        model, loss = self.fit(cfg, tok, **self.args)
        return save(directory, self.name, self.key(tok, cfg), nnx.state(model), loss=loss)

    def model(self, tok, cfg):
        """(model, last loss): the committed fit when this recipe made it, else fitted here."""
        from flax import nnx

        from coder.model import Transformer

        meta = committed(self.name, self.key(tok, cfg))
        if meta is None:
            return self.fit(cfg, tok, **self.args)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        nnx.update(model, load(FITS_DIR, self.name, nnx.state(model)))
        return model, meta["loss"]


if __name__ == "__main__":  # refresh every committed fit: python -m tests.fits [name ...]
    import sys

    import tests.conftest  # noqa: F401  (the suite's XLA flags: the fits are made as the tests would)

    for fit_name in sys.argv[1:] or RECIPES:
        print(fit_name, recipe(fit_name).write(FITS_DIR))
