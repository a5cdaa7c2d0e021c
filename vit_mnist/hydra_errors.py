"""Hydra's errors while it composes a config, each as one line that says the fix.

Told apart by exception type, the attributes Hydra gives its errors (``override``,
``missing_cfg_file``, ``options``, an OmegaConf cause's ``full_key``) and what the project
itself checks (the settings schema, the config folders, a second composition), never by
the wording of a message: a Hydra release may reword its messages, not its types.
"""

from __future__ import annotations

import importlib.resources
import os


def hydra_error_line(
    error: Exception, command: str, config_name: str, argv: list[str]
) -> str | None:
    """One line for an error Hydra raised while composing the config, before the task began;
    None for anything else. Told apart as the module's docstring says, never by wording.

    Args:
        error: what ``@hydra.main`` raised.
        command: the entry point's name (a key of :data:`vit_mnist.settings.SETTINGS`).
        config_name: its config in ``configs/`` (``eval`` for ``evaluate``).
        argv: the command line's arguments after the program's name.
    """
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OverrideParseException):
        return _unreadable_override(error, argv)
    if isinstance(error, MissingConfigException):
        if error.missing_cfg_file is None:  # no configs/: the project is not installed
            return f"{text} Install the project first: pip install -e . (the quick start)"
        group, _, option = error.missing_cfg_file.rpartition("/")
        if group and error.options is not None:
            return (
                f"{group}={option} is not an option of {group}; choose one of "
                f"{list(error.options)} (the files in configs/{group}/)"
            )
        return text
    if isinstance(error, ConfigCompositionException):
        cause = error.__cause__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            return unknown_override(cause.full_key, argv, command)
        swept = _swept_hydra_setting(argv) if cause is None else None
        if swept is not None:
            return swept
        key = _added_but_set(config_name, argv) if cause is None else None
        if key is not None:
            value = _given(key, argv)
            return (
                f"{key} is a setting already: drop the + ({key}={value}), or write ++ to "
                f"set a key whether or not it exists (++{key}={value})"
            )
        return text
    if isinstance(error, OSError) and error.filename:
        return (
            f"cannot create the run dir {error.filename}: {error.strerror}; choose a folder "
            "you can write with hydra.run.dir=PATH (or hydra.sweep.dir=PATH with -m)"
        )
    if isinstance(error, HydraException):
        return text
    modes = [a for a in argv if a in _MODES]
    if isinstance(error, ValueError) and len({_MODES[m] for m in modes}) > 1:
        return _modes_line(modes)
    nulled = _group_set_to_null(argv)
    if isinstance(error, ValueError) and nulled is not None:
        # Hydra refuses `group=null` with a bare ValueError, before its own error types.
        key, options = nulled
        choose = f", or choose one of {options} ({key}=NAME)" if options else ""
        return (
            f"{key}=null: a config group cannot be set to null on the command line; leave "
            f"the group out with ~{key}{choose}"
        )
    return None


def _unreadable_override(error: Exception, argv: list[str]) -> str:
    """The line for an override Hydra's grammar cannot read (``OverrideParseException``)."""
    undecodable = next((a for a in argv if _not_utf8(a)), None)
    if undecodable is not None:
        # A file name of bytes that are not UTF-8: Python keeps them as surrogates,
        # which Hydra's grammar cannot read, quoted or not.
        shown = os.fsencode(undecodable).decode("utf-8", "backslashreplace")
        return (
            f"cannot read the override {shown}: it holds bytes that are not UTF-8 (a "
            "file name from another system?); rename the file, or link it under a "
            "UTF-8 name (ln -s), and give that name"
        )
    return (
        f"cannot read the override {error.override} (quote lists and values with spaces: "
        "'model.num_heads=[2,4]'; grammar: "
        "https://hydra.cc/docs/advanced/override_grammar/basic/)"
    )


def _modes_line(modes: list[str]) -> str:
    """Hydra's "Only one of --run, --multirun, --cfg, ..." (a bare ValueError) in a line."""
    return (
        f"{' and '.join(modes)} cannot go together: Hydra does one of them per command; "
        "to see a sweep's config, print one job's (drop -m and give each key one value: "
        "--cfg job), or run the sweep without --cfg"
    )


# Hydra's command-line modes, each flag by the mode it asks for: one per command.
_MODES = {
    "-m": "multirun",
    "--multirun": "multirun",
    "-r": "run",
    "--run": "run",
    "-c": "cfg",
    "--cfg": "cfg",
    "-i": "info",
    "--info": "info",
    "-sc": "shell_completion",
    "--shell-completion": "shell_completion",
}


def _not_utf8(arg: str) -> bool:
    """Whether a command-line argument held bytes that are not UTF-8 (surrogate escapes)."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def split_overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """``(prefix, key, value)`` of each ``key=value`` override (prefix ``+``, ``++``, ``~``
    or empty)."""
    found = []
    for name, eq, value in (arg.partition("=") for arg in argv):
        key = name.lstrip("+~")
        if eq:
            found.append((name[: len(name) - len(key)], key, value))
    return found


def _given(key: str, argv: list[str]) -> str | None:
    """The value that the command line gives ``key`` (``key=v``, ``+key=v``, ``++key=v``)."""
    return next((v for _, k, v in split_overrides(argv) if k == key), None)


# Where an Optuna study's search space is kept in the config (configs/hparams_search/).
SEARCH_SPACE = "hydra.sweeper.params."


def _swept_hydra_setting(argv: list[str]) -> str | None:
    """The line for the first sweep (``interval``, ``choice``, ``a,b``) given to one of
    Hydra's own settings, which Hydra cannot sweep: a search-space entry goes by its key
    alone (``module.lr=interval(...)``). None without one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in argv:
        name, eq, value = arg.partition("=")
        if not (eq and name.lstrip("+~").startswith("hydra.")):
            continue
        (override,) = parser.parse_overrides([arg])
        if not override.is_sweep_override():
            continue
        key = name.lstrip("+~")
        if key.startswith(SEARCH_SPACE):
            entry = f"{key[len(SEARCH_SPACE) :]}={value}"
            return (
                f"{arg}: a search-space entry is given on the command line by its key "
                f"alone, '{entry}', and joins {SEARCH_SPACE[:-1]}"
            )
        return f"{arg}: Hydra's own settings take one value, not a sweep; give {key} one value"
    return None


def _added_but_set(config_name: str, argv: list[str]) -> str | None:
    """The first ``+key=value`` whose key the config sets already: the config composed
    again without the ``+`` overrides has it. None when there is none, or when the config
    does not compose without them either."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    added = [k for p, k, _ in split_overrides(argv) if p == "+"]
    plain = [a for a in argv if not (a.startswith("+") and not a.startswith("++"))]
    if not added:
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("vit_mnist.configs", version_base="1.3"):
            cfg = compose(config_name, overrides=plain)
    except Exception:  # noqa: BLE001 - another error: passed on as Hydra wrote it
        return None
    finally:
        GlobalHydra.instance().clear()
    absent = object()
    return next((k for k in added if OmegaConf.select(cfg, k, default=absent) is not absent), None)


def _group_set_to_null(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(group, its options)`` of the first ``group=null`` (or ``+group=null``), a group
    being a folder of ``configs/`` (options: its YAML files) or a path such as
    ``hydra/launcher`` (options not listed: Hydra's plugins add some); None without one."""
    configs = importlib.resources.files("vit_mnist.configs")
    for prefix, key, value in split_overrides(argv):
        if value.lower() != "null" or "~" in prefix:
            continue
        if "/" in key:
            return key, []
        if configs.joinpath(key).is_dir():
            options = configs.joinpath(key).iterdir()
            return key, sorted(f.name[:-5] for f in options if f.name.endswith(".yaml"))
    return None


def unknown_override(key: str, argv: list[str], command: str) -> str:
    """``model.num_head=4``: the nearest setting, or how to add an argument with ``+``."""
    from vit_mnist.settings import RETIRED, SETTINGS, known_keys, unknown_key

    schema = SETTINGS[command]
    value = _given(key, argv)
    section, _, name = key.rpartition(".")
    if key.startswith("hydra."):  # Hydra's own settings, and a sweeper's sampler and pruner
        return f"{key} is not in the config; add it with a +: +{key}={value or '...'}"
    if key not in RETIRED and name in known_keys(schema, section):
        # A setting that this config's YAML leaves out, or a null section (eval.py's data)
        # under which a key was given (data.batch_size=512).
        under = (f"{k}={v}" for _, k, v in split_overrides(argv) if k.startswith(f"{key}."))
        arg = f"{key}={value}" if value is not None else next(under, f"{key}=...")
        return f"{key} is not set by this config; add it with a +: +{arg}"
    return unknown_key(key, schema, "..." if value is None else value)
