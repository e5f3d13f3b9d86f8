"""Finding a reward function from its spec: a built-in name, `path/to/file.py:function_name`, or the URL of a
reward server (`http://host:port/path`, see remote.py).

A user file imported in this process (`reward.workers 0`) may change the working directory as it is imported:
the spec's path is made absolute before the import (`absolute_spec`), and the working directory is put back after
it, with a warning, so the run's relative paths (its output directory, data, the next reward file) still hold.

`python:NAME` names an object given in Python (`ds_rlhf.api`: a reward callable, an environment class) that
`register` put in this process's table; it is loaded from there, never imported, and no worker process has it."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from ds_rlhf.rewards.builtin import BUILTIN_REWARDS
from ds_rlhf.rewards.remote import RemoteReward, check_remote, check_scheme, is_remote

STYLES = ("sample", "batched", "trl", "verl", "openrlhf")
IN_PROCESS = "python:"
_REGISTERED: dict[str, object] = {}  # `python:NAME` -> an object given in Python


def register(name: str, obj) -> str:
    """The spec `python:NAME` that loads `obj` in this process (`NAME_2`, ... when another object holds NAME)."""
    spec, n = f"{IN_PROCESS}{name}", 1
    while _REGISTERED.get(spec, obj) is not obj:
        n += 1
        spec = f"{IN_PROCESS}{name}_{n}"
    _REGISTERED[spec] = obj
    return spec


def registered(spec: str):
    """The object `register` gave `spec`, else None."""
    return _REGISTERED.get(spec.strip())


def user_code_specs(spec: str) -> list[str]:
    """The entries of a (comma-separated) reward spec that run the user's code: not built-in rules, not reward
    servers (a URL is called from the trainer process), not callables given in Python (`python:NAME`, run in this
    process). These are what reward workers are for."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    return [p for p in parts if split_style(p)[0] not in BUILTIN_REWARDS and not is_remote(split_style(p)[0])
            and registered(split_style(p)[0]) is None]


def split_style(spec: str) -> tuple[str, str | None]:
    """`my.py:f@trl` -> (`my.py:f`, `trl`): an explicit calling convention overrides detection."""
    base, sep, style = spec.rpartition("@")
    return (base, style) if sep and style in STYLES else (spec, None)


def load_reward_fn(spec: str):
    """`gsm8k` / `format` / `math_shaped` / `math_verify`, `path/to/file.py:function_name`, or a reward server's
    URL (a RemoteReward with the default batch size and timeout) (one function; `ds_rlhf.rewards.load_reward_fn`
    also takes several, `reward_set.load_rewards`)."""
    check_scheme(spec)
    if is_remote(spec):
        return RemoteReward(spec)
    spec = split_style(spec)[0]
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if (given := registered(spec)) is not None:
        return given
    path, name = check_spec(spec)
    fn = getattr(load_module(path), name, None)
    if not callable(fn):
        raise AttributeError(f"{path} has no callable '{name}'")
    return fn


def check_spec(spec: str) -> tuple[str, str]:
    """(path, function name) of a `file.py:func` spec whose file exists; errors as load_reward_fn's, no import.
    A URL: (url, "") when a server answers there (`remote.check_remote`: one GET, a few seconds at most); a URL
    of another scheme than http(s) is a ValueError naming the scheme."""
    check_scheme(spec)
    if is_remote(spec):
        check_remote(spec)
        return spec.strip(), ""
    if registered(spec) is not None:
        return spec.strip(), spec.strip()[len(IN_PROCESS):]
    if ":" not in spec:
        raise ValueError(f"unknown reward function '{spec}': use one of {sorted(BUILTIN_REWARDS)} "
                         "or path/to/file.py:function_name")
    path, name = spec.rsplit(":", 1)
    if not Path(path).is_file():
        raise FileNotFoundError(f"reward function file not found: {path}")
    return path, name


def absolute_spec(spec: str) -> str:
    """`file.py:func[@style]` with the file's absolute path (a spec naming an existing file); others unchanged."""
    base, style = split_style(spec)
    if is_remote(base) or base in BUILTIN_REWARDS or ":" not in base or registered(base) is not None:
        return spec
    path, name = base.rsplit(":", 1)
    if not Path(path).is_file():
        return spec  # check_spec reports it
    return f"{Path(path).resolve()}:{name}" + (f"@{style}" if style else "")


def load_module(path: str):
    """Import a file by path (registered in sys.modules so dataclasses and pickle inside it work); the working
    directory is the same after the import as before it."""
    resolved = str(Path(path).resolve())
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:10]
    mod_name = f"ds_rlhf_user_reward_{Path(path).stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(mod_name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    cwd = os.getcwd()
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    finally:
        _restore_cwd(cwd, resolved)
    return module


def _restore_cwd(cwd: str, path: str) -> None:
    now = os.getcwd()
    if now != cwd:
        os.chdir(cwd)
        print(f"[reward] warning: importing {path} changed the working directory to {now}; changed back to {cwd} "
              "(the run's relative paths are relative to it; open the module's own files by absolute path, e.g. "
              "Path(__file__).parent / name)", file=sys.stderr, flush=True)
