"""Repository-length documents (coder/data/repo_docs.py) and their place in the pretraining
pipeline (coder/data/pretrain.py): dependency order with an import cycle, local and fsspec
repositories, the held-out split, positions continuous within a document, the mixture weight."""
import numpy as np
import pytest

from coder.data import pretrain, repo_docs
from tests.data.repo_inputs import repo_config, write_repo
from tests.fakes import CharTokenizer

# A tiny repository: util <- pkg.d <- pkg.c (relative imports), a <-> b (a cycle), main -> a.
TINY = {
    "main.py": "import a\n\ndef run():\n    return a.go()\n",
    "a.py": "from b import helper\nimport util\n\ndef go():\n    return helper() + util.one()\n",
    "b.py": "import a\n\ndef helper():\n    return 2\n",
    "util.py": "def one():\n    return 1\n",
    "pkg/__init__.py": "",
    "pkg/c.py": "from . import d\n\ndef c():\n    return d.d()\n",
    "pkg/d.py": "from util import one\n\ndef d():\n    return one()\n",
    "notes.txt": "not python: not read\n",
}


def python_files():
    return {k: v for k, v in TINY.items() if k.endswith(".py")}


def test_dependency_order_breaks_the_cycle_deterministically():
    files = python_files()
    deps = repo_docs.dependencies(files)
    assert deps["a.py"] == {"b.py", "util.py"} and deps["b.py"] == {"a.py"}
    # `from . import d` imports the package (its __init__) and its module d
    assert deps["pkg/c.py"] == {"pkg/__init__.py", "pkg/d.py"} and deps["pkg/d.py"] == {"util.py"}
    order = repo_docs.dependency_order(files)
    # Kahn by path: pkg/__init__, util, pkg/d, pkg/c; then only the cycle a <-> b (and main after
    # it) is left: a and b each wait on one file, a goes first by path, then b, then main.
    assert order == ["pkg/__init__.py", "util.py", "pkg/d.py", "pkg/c.py", "a.py", "b.py", "main.py"]
    # every edge outside the cycle points backwards
    for path, ds in deps.items():
        for d in ds - ({"b.py"} if path == "a.py" else set()):
            assert order.index(d) < order.index(path), (path, d)
    # the order is a function of the files, not of the dict's order
    assert repo_docs.dependency_order(dict(reversed(list(files.items())))) == order


def test_repository_document_from_local_and_fsspec_dirs(tmp_path):
    write_repo(tmp_path / "r1", TINY)
    write_repo("memory://repos/r2", {"x.py": "import y\n", "y.py": "Y = 1\n"})
    write_repo("memory://repos/empty", {"README": "no python\n"})
    (dir1,) = repo_docs.repository_dirs([str(tmp_path / "r*")])
    assert repo_docs.repository_dirs(["memory://repos/*"]) == ["memory:///repos/r2"]  # fsspec spells it so
    text = repo_docs.repository_document(dir1)
    order = [line[len("# file: "):] for line in text.splitlines() if line.startswith("# file: ")]
    assert order == repo_docs.dependency_order(python_files())
    assert "not python" not in text and TINY["a.py"] in text
    source = repo_docs.RepoSource(["memory://repos/r2"])
    assert len(source) == 1 and source[0] == b"# file: y.py\nY = 1\n# file: x.py\nimport y\n"
    with pytest.raises(FileNotFoundError, match="config.data.repos"):
        repo_docs.repository_dirs(["memory://repos/empty"])


def test_parts_cut_a_repository_at_file_boundaries_in_dependency_order(tmp_path):
    write_repo(tmp_path / "r1", TINY)
    files = python_files()
    order = repo_docs.dependency_order(files)
    parts = repo_docs.plan_parts(str(tmp_path / "r1"), 60)
    assert [p for run in parts for p in run] == order and len(parts) > 1
    for run in parts:  # each run fits, or is one file too long to share a run
        size = sum(len(repo_docs.FILE_HEADER.format(path=p)) + len(files[p]) for p in run)
        assert size <= 60 or len(run) == 1
    source = repo_docs.RepoSource([str(tmp_path / "r1")], part_chars=60)
    assert len(source) == len(parts)
    assert b"".join(source[i] for i in range(len(source))) == repo_docs.repository_document(
        str(tmp_path / "r1")).encode()


def test_heldout_repositories_are_disjoint_and_at_least_one():
    urls = [f"/r/{name}" for name in "abcdefghij"]
    held = repo_docs.split_repositories(urls, "heldout", 0.05)
    train = repo_docs.split_repositories(urls, "train", 0.05)
    assert len(held) == 1 and sorted(held + train) == urls
    assert len(repo_docs.split_repositories(urls, "heldout", 0.3)) == 3
    assert repo_docs.split_repositories(urls[:1], "heldout", 0.5) == []
    assert repo_docs.split_repositories(urls, "train", 0.0) == urls


def test_positions_continue_within_a_document_up_to_max_position(tmp_path):
    write_repo(tmp_path / "r1", TINY)
    cfg = repo_config(tmp_path, seq_len=32, max_position=128, repos=(str(tmp_path / "r1"),),
                      repo_weight=1.0, sources=({"path": str(tmp_path / "r1" / "notes.txt")},))
    assert len(repo_docs.repository_document(str(tmp_path / "r1"))) > 128  # some piece restarts
    it = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train")
    # Rows hold the document stream in order: a piece not starting with bos continues the
    # document of the piece before it, at the offset counted so far.
    offset, continued, restarted = 0, 0, 0
    for _ in range(12):
        b = next(it)
        for tokens, pos, seg in zip(b["tokens"], b["positions"], b["segment_ids"]):
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                if tokens[where[0]] == CharTokenizer.bos_id:
                    offset = 0
                p = pos[where]
                np.testing.assert_array_equal(np.diff(p), 1)  # consecutive inside a piece
                if offset + len(p) <= 128:
                    assert p[0] == offset
                    continued += offset > 0
                else:
                    assert p[0] == 0
                    restarted += 1
                offset += len(p)
    assert continued > 0 and restarted > 0


def test_mixture_weight_sets_the_share_of_repository_documents(tmp_path):
    for i in range(4):
        write_repo(tmp_path / f"r{i}", {"m.py": f"X = {i}\n" * 3})
    short = tmp_path / "short.jsonl"
    short.write_text("".join(f'{{"text": "short {i}"}}\n' for i in range(50)))
    shares = {}
    for weight in (0.25, 1.0):
        cfg = repo_config(tmp_path, seq_len=64, max_position=64, repos=(str(tmp_path / "r*"),),
                          repo_weight=weight, sources=({"path": str(short), "name": "short"},))
        it = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train")
        for _ in range(20):
            next(it)
        counts = it.counts()
        seen = counts["repositories"]["seen"], counts["short"]["seen"]
        shares[weight] = seen[0] / sum(seen)
    assert shares[0.25] == pytest.approx(0.2, abs=0.03) and shares[1.0] == pytest.approx(0.5, abs=0.03)


def test_repo_keys_are_validated_naming_them(tmp_path):
    cfg = repo_config(tmp_path, seq_len=32, max_position=32, repo_weight=0.5)
    with pytest.raises(ValueError, match="config.data.repos is empty"):
        pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train")
    cfg.data.repo_weight = -1.0
    with pytest.raises(ValueError, match="config.data.repo_weight=-1.0 must be >= 0"):
        pretrain.check_repos(cfg)
    cfg.data.repo_weight, cfg.data.repo_part_chars = 1.0, -5
    with pytest.raises(ValueError, match="config.data.repo_part_chars=-5 must be >= 0"):
        pretrain.check_repos(cfg)
    cfg.data.repo_part_chars = 0
    write_repo(tmp_path / "only", {"m.py": "X = 1\n"})
    cfg.data.update(dict(repos=(str(tmp_path / "only"),), repo_weight=1.0, heldout_fraction=0.1))
    with pytest.raises(ValueError, match="no repository in split 'heldout'"):
        pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "heldout")
