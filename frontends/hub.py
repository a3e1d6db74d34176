"""A model named by its Hugging Face id (`org/name`) instead of a folder: resolved through huggingface_hub's cache,
downloading what pegainfer reads when online, as vLLM's --model does."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pegainfer.errors import ConfigError, PegainferError

# What pegainfer reads from a checkpoint (frontends/checkpoint.py, runtime/tokenizer.py, runtime/chat.py).
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json"]
_REPO_ID = re.compile(r"\w[\w.-]{0,95}/\w[\w.-]{0,95}")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a set flag


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's files are, and the hub id it came from (None for a local folder)."""
    folder: Path
    repo_id: str | None = None

    @property
    def name(self) -> str:
        """The served model name by default: the hub id as given, else the folder's name (vLLM's rule)."""
        return self.repo_id or self.folder.resolve().name


def looks_like_repo_id(model: str) -> bool:
    """`org/name` as the hub spells ids: one slash, word characters, '.' and '-', no '--' or '..'."""
    return bool(_REPO_ID.fullmatch(model)) and "--" not in model and ".." not in model \
        and not model.endswith((".", "-"))


def resolve_checkpoint(model: str | Path) -> Checkpoint:
    """An existing path is used as it is (load_model checks it); a missing one that reads as `org/name` is looked
    up in the hub cache and downloaded when HF_HUB_OFFLINE is not set."""
    text = str(model)
    if Path(text).exists() or not looks_like_repo_id(text):
        return Checkpoint(Path(text))
    return Checkpoint(download(text), text)


def hub_cache_dir() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub: read now, since huggingface_hub reads them
    once, at its import."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in _TRUE


def download(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the hub cache, with the files pegainfer reads."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors
    except ImportError:
        raise PegainferError(f"{repo_id}: not a local folder, and reading it from the Hugging Face Hub needs "
                             f"huggingface_hub (pip install huggingface_hub)") from None
    cache, offline = hub_cache_dir(), hub_offline()
    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub 1.x has none
    where = cache / f"models--{repo_id.replace('/', '--')}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, cache_dir=cache, local_files_only=offline))
    except incomplete as error:
        raise PegainferError(f"{repo_id}: the cached snapshot in {where} is incomplete: {_one_line(error)}") from None
    except errors.LocalEntryNotFoundError as error:
        if offline:
            raise PegainferError(f"{repo_id}: not a local folder, and not in the Hugging Face cache at {where}; "
                                 f"HF_HUB_OFFLINE is set, so it is not downloaded (unset it, or point "
                                 f"HF_HUB_CACHE at a cache that has it)") from None
        raise PegainferError(f"{repo_id}: not a local folder, not in the Hugging Face cache at {where}, and the "
                             f"Hub could not be reached to download it ({_one_line(error.__cause__ or error)})"
                             ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{repo_id}: not a local folder, and no model of that id on the Hugging Face Hub (or it is "
                          f"private or gated: log in with `hf auth login` or set HF_TOKEN)") from None
    except errors.HfHubHTTPError as error:
        raise PegainferError(f"{repo_id}: downloading from the Hugging Face Hub failed: {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
