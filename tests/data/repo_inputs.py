"""The repository-document tests' inputs (tests/data/test_repo_docs.py, test_decontaminate.py): a
repository's files written at a path or URL, the data config over repositories."""
import fsspec

from configs import base


def write_repo(root, files):
    fs, path = fsspec.core.url_to_fs(str(root))
    for rel, text in files.items():
        fs.makedirs(f"{path}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{path}/{rel}", text.encode())


def repo_config(tmp_path, seq_len, max_position, **data):
    cfg = base.get_config()
    cfg.data.update(dict(seq_len=seq_len, batch_size=2, heldout_fraction=0.0, **data))
    cfg.model.max_position_embeddings = max_position
    return cfg
