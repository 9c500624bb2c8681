"""``--model ORG/NAME``: a model's ``config.json`` from the local Hugging Face cache, never the network.

The cache layout and its location are huggingface_hub's (1.33, ``constants.py`` and ``file_download.py``):
the cache is ``HF_HUB_CACHE``, else the legacy ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, where
``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface`` (``~/.cache/huggingface``). A model lives in
``models--ORG--NAME/``: ``refs/<branch or tag>`` holds a commit hash, ``snapshots/<commit>/config.json``
the file (a link into ``blobs/``). Without a revision zeroplan takes ``refs/main``'s snapshot, else the
newest snapshot by modification time; ``ORG/NAME@REV`` (or ``--revision REV``) takes the snapshot of
the ref or commit ``REV``. Anything not in the cache is one line saying where zeroplan looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

#: ORG/NAME as the hub spells repository ids (huggingface_hub ``validate_repo_id``: letters, digits,
#: ``-``, ``_``, ``.``), with an optional ``@revision``.
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


def is_hub_name(name: str) -> bool:
    """``ORG/NAME`` or ``ORG/NAME@REV`` (not a path that exists, not a ``.json`` file)."""
    return bool(_REPO_ID.match(name)) and not name.endswith(".json") and not Path(name).exists()


def hub_cache_dir(environ: Optional[dict] = None) -> Path:
    """The hub cache huggingface_hub would use (module docstring), from ``environ`` (default os.environ)."""
    env = os.environ if environ is None else environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(os.path.expandvars(os.path.expanduser(env[key])))
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def with_revision(model: Optional[str], revision: Optional[str]) -> Optional[str]:
    """``--model`` with ``--revision`` folded in (``ORG/NAME@REV``); ValueError where it cannot apply."""
    if revision is None:
        return model
    if model is None or not is_hub_name(model) or "@" in model:
        raise ValueError(f"--revision {revision!r}: needs --model ORG/NAME (a model in the Hugging Face cache)")
    return f"{model}@{revision}"


def _snapshot(repo: Path, revision: Optional[str]) -> Optional[Path]:
    """The snapshot folder of ``revision`` (a ref or a commit), else of refs/main, else the newest one."""
    snapshots = repo / "snapshots"
    wanted = revision or "main"
    ref = repo / "refs" / wanted
    if ref.is_file():
        return snapshots / ref.read_text().strip()
    if revision is not None:
        return snapshots / revision if (snapshots / revision).is_dir() else None
    found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cached_config(name: str, environ: Optional[dict] = None) -> Path:
    """The cached ``config.json`` of ``ORG/NAME[@REV]``; ValueError (one line, naming where it looked)."""
    repo_id, _, revision = name.partition("@")
    cache = hub_cache_dir(environ)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _snapshot(repo, revision or None) if repo.is_dir() else None
    config = snapshot / "config.json" if snapshot is not None else None
    if config is None or not config.is_file():
        where = config if config is not None else repo / "snapshots" / (revision or "<refs/main or newest>")
        raise ValueError(
            f"model {name!r}: no config.json in the Hugging Face cache (looked in {where}; zeroplan never "
            f"downloads: fetch it with `hf download {repo_id} config.json`, or give the path of a config.json)"
        )
    return config
