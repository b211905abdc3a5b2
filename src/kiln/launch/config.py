"""`kiln.Config`: the run's configuration with attribute access, from a file or a dict."""

from __future__ import annotations

import json
import runpy
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Config", "load_config"]


class Config(dict):
    """A dict whose keys are also attributes; nested dicts become Configs.

    Built from a ``.py`` file (its module-level names, leaving out dunders, modules and classes,
    as Colossal-AI does), a ``.yaml``/``.yml`` or ``.json`` file, or a dict.

    Example::

        cfg = kiln.Config({"BATCH_SIZE": 128, "fp16": {"mode": "torch"}})
        cfg.BATCH_SIZE, cfg.fp16.mode
    """

    def __init__(self, data: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__()
        for key, value in {**(data or {}), **kwargs}.items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, dict) and not isinstance(value, Config):
            value = Config(value)
        super().__setitem__(key, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}; keys: {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist (expected a .py, .yaml or .json file)")
        suffix = path.suffix.lower()
        if suffix == ".py":
            names = runpy.run_path(str(path))
            return cls({k: v for k, v in names.items() if _is_config_value(k, v)})
        if suffix in (".yaml", ".yml"):
            import yaml  # imported here: most runs never read YAML through this path

            data = yaml.safe_load(path.read_text()) or {}
        elif suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ValueError(f"config file {str(path)!r} has suffix {suffix!r}; expected .py, .yaml, .yml or .json")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} holds a {type(data).__name__}; expected a mapping at the top")
        return cls(data)


def _is_config_value(name: str, value: Any) -> bool:
    return not (name.startswith("__") or isinstance(value, (types.ModuleType, type)))


def load_config(config: Config | Mapping[str, Any] | str | Path | None) -> Config:
    """Turn whatever the user passed as ``config=`` into a Config."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config(dict(config))
    if isinstance(config, (str, Path)):
        return Config.from_file(config)
    raise TypeError(f"config must be a dict, a kiln.Config or a file path; got {type(config).__name__}")
