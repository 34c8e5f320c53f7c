"""coder's run configs: `get_config()` of each module returns an ml_collections.ConfigDict.

Installed with the package, so `from configs.base import model_config` works from anywhere;
`python main.py --config=configs/NAME.py` reads a config by path.
"""
