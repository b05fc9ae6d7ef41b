"""Images in rows: whatever form a row or a chat message gives an image in, one RGB ``PIL.Image``.

Rows carry images as a file path, raw bytes (JSONL/Parquet/``save_to_disk`` columns), a ``PIL.Image``
(``datasets``' Image feature decodes to one), a ``{"bytes": ..., "path": ...}`` dict (that feature's
undecoded form), or a data URL string; chat messages carry them as OpenAI-style content parts,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or transformers'
``{"type": "image", "image": ...}``. ``load_image`` accepts all of them, so the task adapters, the engine
and the endpoint share one decoder, and ``to_data_url`` writes the one form that is also JSON (what the
synthetic visual task stores and the endpoint receives).

A bad image is one clear error naming the row and the key (DESIGN.md: bad input is a one-line error
naming the row/key): unreadable bytes, a path that does not exist, a remote URL (tidal never downloads),
or an image with a zero-size side. The check runs at decode time, before the processor, whose own
errors on such input are about tensor shapes rather than the row.

Lives in ``utils`` (layer 0) rather than ``data`` (layer 3) because the row adapters in ``tasks`` and the
model code in ``models`` (layer 2) both read images.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

DATA_URL_PREFIX = "data:image/"


class ImageError(ValueError):
    """An image in a row or message that cannot be used; the message names where it came from."""


def load_image(value: Any, where: str = "image") -> Image.Image:
    """``value`` as an RGB image (fully decoded, so a truncated file fails here, not in the processor).

    ``where`` names the source in errors, e.g. ``"row 12, key 'image'"``."""
    if isinstance(value, dict):
        return load_image(_from_part(value, where), where)
    if isinstance(value, Image.Image):
        image = value
    else:
        data = _bytes_of(value, where)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except UnidentifiedImageError:
            raise ImageError(f"{where}: unreadable image ({len(data)} bytes): not an image format PIL reads") from None
        except (OSError, SyntaxError) as e:  # a known format, damaged or truncated
            raise ImageError(f"{where}: unreadable image ({len(data)} bytes): {e}") from None
    if image.width == 0 or image.height == 0:
        raise ImageError(f"{where}: zero-size image ({image.width}x{image.height})")
    return image if image.mode == "RGB" else image.convert("RGB")


def _from_part(part: dict, where: str) -> Any:
    """The image inside a content part or a ``datasets`` Image dict."""
    if part.get("type") == "image_url" or "image_url" in part:
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if "image" in part:
        return part["image"]
    if part.get("bytes") is not None:
        return part["bytes"]
    if part.get("path") is not None:
        return part["path"]
    raise ImageError(f"{where}: a dict with no image in it (keys {sorted(part)}); expected an 'image_url' "
                     "or 'image' content part, or {'bytes': ..., 'path': ...}")


def _bytes_of(value: Any, where: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and value.startswith("data:"):
        head, sep, payload = value.partition(",")
        if not sep or not head.startswith(DATA_URL_PREFIX) or not head.endswith(";base64"):
            raise ImageError(f"{where}: a data URL must look like 'data:image/<format>;base64,<data>', "
                             f"got {value[:40]!r}...")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{where}: bad base64 in data URL: {e}") from None
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise ImageError(f"{where}: {value[:60]!r} is a remote URL; tidal never downloads: pass a path, bytes "
                         "or a data URL")
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_file():
            raise ImageError(f"{where}: no image file at {str(path)!r}")
        return path.read_bytes()
    raise ImageError(f"{where}: expected an image (path, bytes, PIL image, data URL or image content part), "
                     f"got {type(value).__name__}")


def to_png_bytes(image: Image.Image) -> bytes:
    """PNG bytes of ``image`` (lossless, so decoding gives back the same pixels)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def to_data_url(image: Image.Image) -> str:
    """``data:image/png;base64,...``: the form an OpenAI ``image_url`` part carries, and JSON-safe."""
    return "data:image/png;base64," + base64.b64encode(to_png_bytes(image)).decode("ascii")


def image_part(image: Image.Image) -> dict:
    """An OpenAI-style ``image_url`` content part holding ``image`` as a data URL."""
    return {"type": "image_url", "image_url": {"url": to_data_url(image)}}


def as_data_url(value: Any, where: str = "image") -> str:
    """``value`` (any form ``load_image`` reads), decoded once to check it, as a data URL for a row's
    ``meta["images"]``. It keeps the source's own encoded bytes when there are some (a JPEG stays a JPEG:
    re-encoding a photo as PNG grows it several times, and the bytes, hence the hash split on them, stay what
    the file holds); a PIL image, or a format with no image MIME type, is written as PNG (``to_data_url``)."""
    if isinstance(value, dict):
        return as_data_url(_from_part(value, where), where)
    if isinstance(value, Image.Image):
        return to_data_url(load_image(value, where))
    data = _bytes_of(value, where)
    image = load_image(data, where)
    mime = Image.MIME.get(Image.open(io.BytesIO(data)).format or "", "")  # the header again: no decode
    if not mime.startswith("image/"):
        return to_data_url(image)
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
