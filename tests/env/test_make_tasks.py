"""coder.env.make_tasks: one registry of sources, each naming the flags it cannot run without."""
import pytest

from coder.env import make_tasks
from coder.env.tasks import read_tasks


def test_every_source_is_in_the_registry_and_a_missing_flag_is_named(tmp_path, capsys):
    assert set(make_tasks.SOURCES) == {"stdlib", "toy", "swebench", "harbor", "releases", "mutants"}
    out = str(tmp_path / "t.jsonl")
    with pytest.raises(SystemExit):
        make_tasks.main(["--source", "mutants", "--packages", "a", "--out", out])
    assert "--source mutants needs --repos and --n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_tasks.main(["--source", "harbor", "--repos", str(tmp_path), "--out", out])
    assert "--source harbor needs DIR..." in capsys.readouterr().err
    assert make_tasks.main(["--source", "toy", "--n", "3", "--out", out]) == 0
    assert len(read_tasks(out)) == 3
