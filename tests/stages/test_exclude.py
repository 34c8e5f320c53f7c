"""The held-out repositories' code kept out of the training stages' data (coder/stages/exclude.py,
data.exclude_tasks): a suite of held-out tasks generated from tinypkg7's releases is the agent
eval's (rl.eval_tasks); a training repository that vendors the next release (the code the
feature task asks for, in no commit the task's workspace holds) and an SFT transcript that read
the package are left out of the stages' training data, and counted."""
import json

import numpy as np
import pytest

from coder.data import tokenizer as tokenizer_lib
from coder.env import heldout
from coder.env.sources import repo as repo_lib
from coder.env import suite
from coder.env import tasks as tasks_lib
from coder.stages import exclude, lm
from configs import base
from tests.conftest import TINY_RELEASES


@pytest.fixture
def config(generated_package_tasks, tmp_path):
    (feature, _), (bug, _) = generated_package_tasks
    held_out, _ = suite.build_suite([feature, bug], noisy=0, seed=0)
    tasks_lib.write_tasks(str(tmp_path / "suite.jsonl"), held_out)
    cfg = base.get_config()
    cfg.rl.update(dict(tasks="toy", eval_tasks=str(tmp_path / "suite.jsonl"), eval_num_tasks=2))
    cfg.data.update(dict(seq_len=64, batch_size=2, heldout_fraction=0.0))
    return cfg


def test_the_index_holds_the_next_release_the_workspace_does_not(generated_package_tasks):
    (feature, after), _ = generated_package_tasks
    workspace = repo_lib.checkout(feature.repo, feature.commit)
    assert all("def mean(" not in workspace.read(p).decode() for p in workspace.paths)
    assert any("def mean(" in text for text in heldout.code_texts([feature]))  # the mirror's next release


def test_stages_drop_what_vendors_or_reads_held_out_code(config, tmp_path):
    vendored = {f"vendor/{p}": text for p, text in TINY_RELEASES["1.1.0"].items() if p.endswith(".py")}
    own = {"app/main.py": "def main(argv):\n    for arg in argv:\n        print('argument', arg.upper())\n    return 0\n"}
    for name, files in (("vendoring", {**vendored, **own}), ("clean", own)):
        for path, text in files.items():
            (tmp_path / "repos" / name / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "repos" / name / path).write_text(text)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"note {i}: run the tests before a release"}) + "\n" for i in range(40)))
    config.data.update(dict(repos=(str(tmp_path / "repos" / "*"),), repo_weight=1.0,
                            sources=({"path": str(corpus), "name": "notes"},)))
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()] + list(vendored.values())
    tok = tokenizer_lib.train_tokenizer(texts * 4, 340)
    index = exclude.training_exclude(config)
    assert index is not None and len(index) > 0
    assert exclude.training_exclude(config) is index  # built once per process

    it = lm._pretrain_iterator(config, tok, "train")
    decoded = [tok.decode(row.tolist()) for _ in range(20) for row in next(it)["tokens"]]
    assert any("app.main" in t or "argument" in t for t in decoded)  # the clean repository is read
    assert not any("def mean(" in t or "def clamp(" in t for t in decoded)
    assert it.metrics()["data/heldout_dropped"] > 0 and it.counts()["repositories"]["heldout"] > 0
    # off: the vendoring repository is trained on
    config.data.exclude_tasks = ""
    it = lm._pretrain_iterator(config, tok, "train")
    assert any("def clamp(" in tok.decode(row.tolist()) for _ in range(20) for row in next(it)["tokens"])

    config.data.exclude_tasks = "eval"
    transcripts = tmp_path / "sft.jsonl"
    read = TINY_RELEASES["1.0.0"]["tinypkg7/__init__.py"] + TINY_RELEASES["1.0.0"]["tinypkg7/text.py"]
    convs = [[{"role": "user", "content": f"task {i}: print the arguments"},
              {"role": "assistant", "content": "Done."}] for i in range(5)]
    convs.append([{"role": "user", "content": "Add mean to tinypkg7."}, {"role": "tool", "content": read},
                  {"role": "assistant", "content": "Done."}])
    transcripts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    it = lm._sft_iterator(str(transcripts))(config, tok, "train")
    rows = [tok.decode(row.tolist()) for _ in range(6) for row in next(it)["tokens"]]
    assert it.metrics()["data/heldout_dropped"] > 0 and not any("def clamp(" in t for t in rows)
    assert np.isfinite(it.metrics()["data/records_seen"])


def test_toy_eval_tasks_exclude_nothing_and_bad_keys_are_named():
    cfg = base.get_config()
    assert cfg.rl.eval_tasks == "toy" and exclude.training_exclude(cfg) is None
    cfg.data.exclude_min_matches = 0
    with pytest.raises(ValueError, match="data.exclude_min_matches=0 must be >= 1"):
        lm.check_data(cfg)
    cfg = base.get_config()
    cfg.data.exclude_tasks = "/nowhere/*.jsonl"
    with pytest.raises(FileNotFoundError, match="data.exclude_tasks='/nowhere/"):
        exclude.training_exclude(cfg)
