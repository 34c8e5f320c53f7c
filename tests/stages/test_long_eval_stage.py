"""The stages' side of repository documents and the long-context eval (coder/stages/lm.py,
coder/stages/__init__.py): only longctx reads repositories at longctx.repo_weight, the keys are
checked at start-up naming them, the eval's rows come from the held-out repositories, and the
summary row shows the long-context figures."""
import json

import pytest

from coder import stages
from coder.stages import lm
from configs import base
from tests.fakes import CharTokenizer


def repos(tmp_path, n):
    for i in range(n):
        d = tmp_path / f"repo{i}"
        d.mkdir()
        (d / "util.py").write_text("def one():\n    return 1\n" + "".join(f"X{k} = {k}\n" for k in range(200)))
        (d / "other.py").write_text("".join(f"Y{k} = {k}\n" for k in range(100)))  # filler
        (d / "main.py").write_text("import util\n\n\ndef run():\n    a = util.one()\n    return a + 1\n")
    return (str(tmp_path / "repo*"),)


def config(tmp_path, n_repos=3):
    c = base.get_config()
    c.stages = ("pretrain", "longctx", "eval")
    c.data.repos = repos(tmp_path, n_repos) if n_repos else ()
    c.data.heldout_fraction = 0.3
    c.longctx.repo_weight = 0.1
    return c


def test_only_longctx_reads_repositories(tmp_path):
    c = config(tmp_path)
    assert stages.stage_config("pretrain", c).data.repo_weight == 0.0
    assert stages.stage_config("longctx", c).data.repo_weight == 0.1


def test_repo_and_long_eval_keys_fail_at_start_up_naming_them(tmp_path):
    c = config(tmp_path, n_repos=0)
    with pytest.raises(ValueError, match="config.data.repo_weight=0.1 .* config.data.repos is empty"):
        stages.validate(c, n_devices=1, check_tools=False)
    c = config(tmp_path)
    c.eval.long_buckets = 0
    with pytest.raises(ValueError, match="eval.long_buckets=0 must be >= 1"):
        stages.validate(c, n_devices=1, check_tools=False)
    c.eval.long_buckets, c.eval.retrieval_examples = 4, -1
    with pytest.raises(ValueError, match="eval.retrieval_examples=-1 must be >= 0"):
        stages.validate(c, n_devices=1, check_tools=False)


def test_long_eval_rows_come_from_the_heldout_repositories(tmp_path, caplog):
    c = config(tmp_path)
    c.eval.long_rows, c.eval.retrieval_examples = 3, 2
    rows = lm.long_eval_rows(c, CharTokenizer(), 256)
    assert rows["windows"].shape == (3, 256) and rows["with"].shape == (1, 256)  # run() of the one repo
    c.data.repos = ()
    assert lm.long_eval_rows(c, CharTokenizer(), 256) is None
    (tmp_path / "one").mkdir()
    c.data.repos = repos(tmp_path / "one", 1)  # one repository: none can be held out
    assert lm.long_eval_rows(c, CharTokenizer(), 256) is None
    assert "holds no held-out repository" in caplog.text


def test_summary_row_shows_far_loss_and_retrieval_gain(tmp_path):
    records = [{"step": 0, "heldout_loss": 6.0, "long/loss_far": 6.5, "long/retrieval_gain": 0.01},
               {"step": 40, "loss": 5.0, "heldout_loss": 5.5, "long/loss_far": 5.2, "long/retrieval_gain": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = stages.summarize("longctx", str(tmp_path), 1.0, "ckpt")
    assert row["measures"]["far loss"] == (6.5, 5.2)
    assert row["measures"]["retrieval gain"] == (0.01, 0.2)
