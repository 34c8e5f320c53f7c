"""The committed fits (tests/fits.py) are the current recipes' and load into their models.

A change to a fit's recipe (its model config, tokenizer texts, arguments or source) makes the
tests that use it fit again, silently slower by tens of seconds per process; this fails instead,
naming the fit to refresh with `python -m tests.fits NAME`."""
import json
import os
import warnings

import pytest

from tests import fits


@pytest.mark.parametrize("name", sorted(fits.RECIPES))
def test_committed_fit_is_the_current_recipes(name):
    recipe = fits.recipe(name)
    assert recipe.current_key() == fits.recipe(name).current_key()  # deterministic
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # committed() warns when the key differs
        meta = fits.committed(name, recipe.current_key())
    assert meta is not None, f"tests/data/fits/{name} is missing: python -m tests.fits {name}"
    assert os.path.exists(os.path.join(fits.FITS_DIR, f"{name}.npz"))


def test_another_recipe_is_refused_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(fits, "FITS_DIR", str(tmp_path))
    with open(tmp_path / "m.json", "w") as f:
        json.dump({"key": "a", "loss": 0.5}, f)
    assert fits.committed("m", "a") == {"key": "a", "loss": 0.5}
    with pytest.warns(UserWarning, match="another recipe"):
        assert fits.committed("m", "b") is None
    monkeypatch.setenv("CODER_TEST_REFIT", "1")
    assert fits.committed("m", "a") is None
    assert fits.committed("absent", "a") is None
