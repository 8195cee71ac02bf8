"""A model named by its hub id (org/name) is read from the local Hugging Face cache; nothing is downloaded (this
engine runs where the hub may be unreachable), so a model not in the cache is one clear error."""
from __future__ import annotations

import os
import re

from kestrel.errors import ConfigError

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """org/name, not a path that exists here."""
    return bool(_HUB_ID.match(name)) and not name.startswith(".") and not os.path.exists(name)


def resolve_model_path(name: str, flag: str = "model", revision: str | None = None,
                       cache_dir: str | None = None) -> str:
    """A path as given when it exists; else the cached snapshot folder of the hub id ``name``."""
    if os.path.exists(name):
        return name
    if not is_hub_id(name):
        raise ConfigError(f"{flag} path {name!r} does not exist (give a checkpoint folder or a .gguf file)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = cache_dir or HF_HUB_CACHE  # huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/...
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        at = f" at revision {revision}" if revision else ""
        raise ConfigError(f"{flag} {name!r}{at} is not in the local Hugging Face cache ({cache_dir}) and the hub is "
                          f"not reachable from here: download it where it is (huggingface-cli download {name}) and "
                          f"pass its folder, or point --download-dir / $HF_HUB_CACHE at a cache that holds it")
