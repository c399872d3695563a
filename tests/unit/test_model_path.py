"""Model resolution order: argument, $LOCALLLM_MODEL, user config file, default package."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from localllm import model_path
from localllm.errors import ModelLoadError
from localllm.model_path import INSTALL_HINT, config_file, default_model_path, resolve_model

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"
FAKE_DEFAULT = Path("/opt/default/model.gguf")


def makefile_install() -> tuple[str, str]:
    """The options and the requirement `make setup` installs the default model with: its
    `$(PIP) ... $(DEFAULT_MODEL)` recipe line and its DEFAULT_MODEL value."""
    text = MAKEFILE.read_text()
    pins = re.findall(r"^DEFAULT_MODEL\s*:?=\s*(\S+)\s*$", text, re.M)
    recipes = re.findall(r"^\t\$\(PIP\)\s+(.*?)\s*\$\(DEFAULT_MODEL\)\s*$", text, re.M)
    assert len(pins) == 1 and len(recipes) == 1, f"{MAKEFILE}: {pins} {recipes}"
    return recipes[0], pins[0]


# the Makefile's command, less its interpreter path and the flags that only quiet pip
PIP = "pip install {} {}".format(*makefile_install())


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean environment: no $LOCALLLM_MODEL, config file at tmp, a fake default model."""
    path = tmp_path / "config.toml"
    monkeypatch.delenv(model_path.ENV_VAR, raising=False)
    monkeypatch.setattr(model_path, "config_file", lambda: path)
    monkeypatch.setattr(model_path, "default_model_path", lambda: FAKE_DEFAULT)
    return path


def test_install_hint_is_what_the_makefile_installs() -> None:
    # a drift between the Makefile's pin and the hint fails here; the hint's use in the
    # error is test_nothing_available_names_the_pip_command
    assert INSTALL_HINT == PIP
    name, pinned, version = makefile_install()[1].partition("==")
    assert pinned and re.fullmatch(r"\d+(\.\d+)+", version), "the Makefile pins no version"
    assert re.sub(r"[-_.]+", "_", name).lower() == model_path.DEFAULT_PACKAGE


def test_explicit_argument_wins(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_MODEL", "/env/model.gguf")
    cfg.write_text('model = "/config/model.gguf"\n')
    assert resolve_model("/arg/model.gguf") == Path("/arg/model.gguf")
    assert resolve_model(Path("/arg/p.gguf")) == Path("/arg/p.gguf")


def test_explicit_argument_expands_user(cfg: Path, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/m.gguf") == tmp_path / "m.gguf"


def test_env_var_beats_config_and_default(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_MODEL", "/env/model.gguf")
    cfg.write_text('model = "/config/model.gguf"\n')
    assert resolve_model() == Path("/env/model.gguf")
    assert resolve_model(None) == Path("/env/model.gguf")


def test_empty_env_var_is_ignored(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_MODEL", "")
    cfg.write_text('model = "/config/model.gguf"\n')
    assert resolve_model() == Path("/config/model.gguf")


def test_config_file_beats_default(cfg: Path) -> None:
    cfg.write_text('# my settings\nmodel = "/config/model.gguf"\n')
    assert resolve_model() == Path("/config/model.gguf")


def test_config_file_path_expands_user(cfg: Path, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg.write_text('model = "~/models/x.gguf"\n')
    assert resolve_model() == tmp_path / "models" / "x.gguf"


def test_config_without_model_key_falls_through(cfg: Path) -> None:
    cfg.write_text('other = 1\n[section]\nmodel = "/not/top/level.gguf"\n')
    assert resolve_model() == FAKE_DEFAULT


def test_missing_config_file_falls_through(cfg: Path) -> None:
    assert not cfg.exists()
    assert resolve_model() == FAKE_DEFAULT


def test_config_path_that_is_a_directory_falls_through(cfg: Path) -> None:
    cfg.mkdir()
    assert resolve_model() == FAKE_DEFAULT


def test_default_model_is_last(cfg: Path) -> None:
    assert resolve_model() == FAKE_DEFAULT
    assert resolve_model("") == FAKE_DEFAULT  # an empty --model means "not given"


@pytest.mark.parametrize("text", ['model = "unterminated\n', "model = \n", "[[[\n", "model ="])
def test_invalid_toml_is_a_one_line_error(cfg: Path, text: str) -> None:
    cfg.write_text(text)
    with pytest.raises(ModelLoadError) as info:
        resolve_model()
    msg = str(info.value)
    assert "\n" not in msg
    assert str(cfg) in msg
    assert "config file" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_non_string_model_is_an_error(cfg: Path) -> None:
    cfg.write_text("model = 5\n")
    with pytest.raises(ModelLoadError, match="'model' must be a string path") as info:
        resolve_model()
    assert str(cfg) in str(info.value)


def test_invalid_toml_is_ignored_when_env_var_is_set(cfg: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the config file is only read when it is needed
    cfg.write_text("[[[\n")
    monkeypatch.setenv("LOCALLLM_MODEL", "/env/model.gguf")
    assert resolve_model() == Path("/env/model.gguf")


def test_non_utf8_config_is_a_one_line_error(cfg: Path) -> None:
    cfg.write_bytes(b'model = "/m\xff\xfe.gguf"\n')
    with pytest.raises(ModelLoadError, match="config file"):
        resolve_model()


def test_nothing_available_names_the_pip_command(cfg: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_path, "default_model_path", lambda: None)
    with pytest.raises(ModelLoadError) as info:
        resolve_model()
    msg = str(info.value)
    assert PIP in msg
    assert "--model" in msg
    assert "\n" not in msg


def test_find_spec_none_means_no_default(cfg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args: object) -> object:
        return None if name == model_path.DEFAULT_PACKAGE else real(name, *args)  # type: ignore

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    # the fixture's fake default is replaced by the real lookup, which now finds no package
    monkeypatch.setattr(model_path, "default_model_path", default_model_path)
    assert default_model_path() is None
    with pytest.raises(ModelLoadError, match=re.escape(f"run `{PIP}` or pass --model")):
        resolve_model()


def test_default_package_without_the_file(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / model_path.DEFAULT_PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert default_model_path() is None
    (pkg / model_path.DEFAULT_FILE).write_bytes(b"GGUF")
    assert default_model_path() == pkg / model_path.DEFAULT_FILE
    assert model_path.DEFAULT_PACKAGE not in sys.modules


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_CONFIG_HOME is the Linux convention")
def test_config_file_follows_xdg_config_home(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("LOCALLLM_MODEL", raising=False)
    assert config_file() == tmp_path / "localllm" / "config.toml"
    (tmp_path / "localllm").mkdir()
    (tmp_path / "localllm" / "config.toml").write_text('model = "/xdg/model.gguf"\n')
    assert resolve_model() == Path("/xdg/model.gguf")
