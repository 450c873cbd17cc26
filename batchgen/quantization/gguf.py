"""GGUF sources: vLLM's `LLM("model.gguf", tokenizer=folder)`, or a folder that holds one .gguf
file and no config.json. transformers' GGUF reader makes the config from the file's metadata
and dequantizes its tensors at load."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from batchgen.log import logger

SUFFIX = ".gguf"


def gguf_source(model: object) -> tuple[Path, str] | None:
    """(folder, file name) when `model` is a .gguf file or a folder holding one without a
    config.json; None for anything else (an ordinary model folder or hub id). A folder with
    several .gguf files is a ValueError naming them (pass the one meant)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    path = Path(os.path.expanduser(os.fspath(model)))
    if path.suffix == SUFFIX:
        if not path.is_file():
            raise ValueError(f"model must be an existing .gguf file or a model folder, got "
                             f"{str(model)!r}")
        return path.parent, path.name
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p.name for p in path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ValueError(f"model folder {str(path)!r} holds {len(files)} .gguf files "
                         f"({', '.join(files)}): pass the path of the one to load")
    return (path, files[0]) if files else None


def check_gguf(folder: Path, name: str) -> None:
    """The file's header and tensor index read (the gguf package; no tensor is loaded); a
    ValueError naming the file otherwise."""
    import gguf

    try:
        gguf.GGUFReader(folder / name)
    except Exception as e:  # the reader raises its own types on a bad file
        raise ValueError(f"model weights {str(folder / name)!r} cannot be read as GGUF: "
                         f"{e}") from e


def load_gguf_config(folder: Path, name: str, trust_remote_code: bool = False):
    """The model config transformers makes from the file's metadata (ValueError when the
    gguf package that reads it is missing)."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model {name!r} is a GGUF file, which needs the 'gguf' package: "
                         "pip install 'batchgen[gguf]'")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, gguf_file=name,
                                      trust_remote_code=trust_remote_code)


def load_gguf_tokenizer(folder: Path, name: str):
    """The tokenizer transformers builds from the file's vocabulary, or None (with a log
    line) for a file that has none: pass `tokenizer=` then, or use token-id prompts."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers raises several types for a file without a vocabulary
        logger.info("no tokenizer in %s (%s): pass tokenizer= for text prompts", name, e)
        return None
