"""The model's own HF processor, loaded without torchvision when it can be: Qwen-VL-family
processors in transformers 5.x insist on a video processor (which needs torchvision), so
they are built image-only (`image_only`); image processors take the PIL backend when
torchvision is missing."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any


@functools.cache
def image_only(cls: type) -> type:
    """A subclass of the processor class `cls` without its video processor: transformers
    takes a processor's parts from its `__init__` signature, so the subclass's signature
    (image processor and tokenizer only) is what it checks, loads and saves."""
    takes_video = "video_processor" in inspect.signature(cls.__init__).parameters

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        if takes_video:
            kwargs["video_processor"] = None
        cls.__init__(self, image_processor=image_processor, tokenizer=tokenizer,
                     chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})


def load_processor(path: Path, trust_remote_code: bool = False) -> Any:
    """The folder's processor: AutoProcessor's, else (no torchvision for its video part)
    the same processor class built image-only. ValueError naming the folder when it has
    none."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ImportError, ValueError, AttributeError, TypeError) as first:
        cls = _processor_class(path)
        if cls is None:
            raise ValueError(f"model folder {str(path)!r} has no image processor batchgen "
                             f"can load ({type(first).__name__}: {first})") from first
        try:
            return image_only(cls).from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:  # transformers raises many kinds here
            raise ValueError(f"the processor of {str(path)!r} ({cls.__name__}) cannot be "
                             f"loaded without its video part: {e}") from first


def _processor_class(path: Path) -> type | None:
    """The processor class the folder names (processor_config.json or the tokenizer's
    config), or None."""
    import json

    import transformers

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        f = Path(path) / name
        if f.is_file():
            cls_name = json.loads(f.read_text()).get("processor_class")
            if cls_name and hasattr(transformers, cls_name):
                return getattr(transformers, cls_name)
    return None
