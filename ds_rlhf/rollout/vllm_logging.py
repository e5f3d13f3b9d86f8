"""vLLM's log lines filtered where they are written: vLLM's own logging config with `QuietLogs` on its handler.

vLLM configures logging itself (`vllm.logger`: a `dictConfig` with one stream handler on the `vllm` logger) when
an engine starts, again in every process it starts for an engine, and with a file instead of its default when
`VLLM_LOGGING_CONFIG_PATH` names one. `quiet_vllm_logging` writes vLLM's default config with
`ds_rlhf.telemetry.log_filters.QuietLogs` added to its handlers to a file in the temp directory, points
`VLLM_LOGGING_CONFIG_PATH` at it (processes started later inherit it) and applies it in this process now. A filter
on the handler sees the records of every `vllm.*` logger; one on a single logger would not survive vLLM's
reconfiguration of its loggers' levels, nor reach a record of another module. Read in vLLM 0.26 and 0.32:
`DEFAULT_LOGGING_CONFIG`, `_configure_vllm_root_logger()` (reads `VLLM_LOGGING_CONFIG_PATH`) and
`VLLM_CONFIGURE_LOGGING` have these names in both.

A user's own `VLLM_LOGGING_CONFIG_PATH`, or `VLLM_CONFIGURE_LOGGING=0` (logging left to the application), is kept
as it is: then nothing here changes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

FILTER_NAME = "ds_rlhf_quiet"
FILTER_CLASS = "ds_rlhf.telemetry.log_filters.QuietLogs"
FILE_PREFIX = "ds_rlhf_vllm_logging_"

log = logging.getLogger(__name__)


def with_quiet_filter(config: dict) -> dict:
    """A copy of a `dictConfig` dict with `QuietLogs` on each of its handlers."""
    config = copy.deepcopy(config)
    config.setdefault("filters", {})[FILTER_NAME] = {"()": FILTER_CLASS}
    for handler in config.get("handlers", {}).values():
        filters = handler.setdefault("filters", [])
        if FILTER_NAME not in filters:
            filters.append(FILTER_NAME)
    return config


def _write_config(config: dict) -> Path:
    """The config as JSON in the temp directory, named by its content (written once, replaced atomically)."""
    text = json.dumps(config, indent=1, sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"{FILE_PREFIX}{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def quiet_vllm_logging() -> Path | None:
    """Filter vLLM's log lines (see the module's docstring) in this process and the ones it starts; call before an
    engine starts. Returns the config file, or None when the user's own logging settings are kept."""
    ours = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
    if (ours and not Path(ours).name.startswith(FILE_PREFIX)) or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return None
    import vllm.logger

    default = getattr(vllm.logger, "DEFAULT_LOGGING_CONFIG", None)
    configure = getattr(vllm.logger, "_configure_vllm_root_logger", None)
    if not isinstance(default, dict) or configure is None:
        return None
    try:
        path = _write_config(with_quiet_filter(default))
    except (OSError, TypeError, ValueError) as exc:  # a quieter log is never worth a failed run
        log.warning("vLLM's log lines are not filtered (its logging config could not be written: %s)", exc)
        return None
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    configure()
    return path
