"""The user's images, as vLLM takes them, checked and read before any work: a PIL image, a
numpy or torch array (H x W x C, C x H x W or H x W), a local path, a `file://` URL or a
`data:image/...;base64,` URL; from a dataset also an image file's bytes or datasets' `Image`
struct ({"bytes", "path"}). An http(s) URL is refused: batchgen never downloads. Also the
OpenAI chat content parts that carry images (`image_url`, `image_pil`, `image`)."""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

# the keys a prompt's multi_modal_data may hold (the modalities batchgen serves)
MODALITIES = ("image",)
# OpenAI / vLLM chat content parts that carry an image
IMAGE_PARTS = ("image_url", "image_pil", "image")


def as_list(value: Any) -> list[Any]:
    """One item or a list/tuple of them as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_image(value: Any, name: str) -> Any:
    """The image `value` as the processor takes it: a PIL image (paths and URLs read and
    decoded now, so an unreadable file fails here) or an array as given. ValueError naming
    `name` otherwise."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image
        data = value.get("bytes")
        return _open(bytes(data), name) if data else load_image(value.get("path"), name)
    if isinstance(value, (bytes, bytearray)):  # an encoded file's bytes (an image column)
        return _open(bytes(value), name)
    if isinstance(value, (str, os.PathLike)):
        return _open(_source(value, name), name)
    if _is_array(value):
        shape = tuple(value.shape)
        if len(shape) not in (2, 3) or min(shape) < 1:
            raise ValueError(f"{name} must be an image array of H x W, H x W x C or C x H x "
                             f"W, got shape {shape}")
        return value
    raise ValueError(f"{name} must be a PIL image, a numpy or torch array, a local path, a "
                     f"file:// or a data: URL, or an image file's bytes, got "
                     f"{type(value).__name__}")


def _is_array(value: Any) -> bool:
    """A numpy array or a torch tensor (without importing either for other values)."""
    kind = type(value).__module__.split(".")[0]
    return kind in ("numpy", "torch") and hasattr(value, "shape")


def _source(value: str | os.PathLike, name: str) -> Path | bytes:
    """A path, or the bytes of a data: URL; remote URLs are refused."""
    text = os.fspath(value)
    scheme = urlparse(text).scheme.lower() if isinstance(text, str) else ""
    if scheme in ("http", "https", "ftp", "s3", "gs"):
        raise ValueError(f"{name} is a remote URL ({text[:80]!r}): batchgen never downloads; "
                         "fetch the image first and pass a PIL image, a path or a data: URL")
    if scheme == "data":
        head, _, payload = text.partition(",")
        if not head.startswith("data:image/") or ";base64" not in head:
            raise ValueError(f"{name} must be a data:image/...;base64, URL, got "
                             f"{head[:40]!r}")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"{name} is a data: URL whose base64 does not decode: {e}") from e
    if scheme == "file":
        return Path(unquote(urlparse(text).path))
    if scheme and len(scheme) > 1:  # (a Windows drive letter is one character)
        raise ValueError(f"{name} must be a local path, a file:// or a data: URL, got the "
                         f"scheme {scheme!r}")
    return Path(os.path.expanduser(text))


def _open(source: Path | bytes, name: str) -> Any:
    """Open and decode an image file or bytes (fully, so a broken one fails now)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Path) and not source.is_file():
        raise ValueError(f"{name}: no image file at {str(source)!r}")
    try:
        image = Image.open(source if isinstance(source, Path) else io.BytesIO(source))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        where = str(source) if isinstance(source, Path) else "the image bytes"
        raise ValueError(f"{name}: {where} is not a readable image ({e})") from e
    return image


def chat_images(conversation: list[dict[str, Any]], name: str
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation with each image part replaced by `{"type": "image"}` (what chat
    templates expand into the model's placeholder) and its images in order, read now."""
    images: list[Any] = []
    messages = []
    for m, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                images.append(load_image(_part_image(part, kind),
                                         f"{name}[{m}]['content'][{p}]"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({**message, "content": parts})
    return messages, images


def _part_image(part: dict[str, Any], kind: str) -> Any:
    """The image a content part carries: image_url's url, image_pil's object."""
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get(kind)
