"""utils/images.py: every form a row or a message gives an image in decodes to the same RGB pixels, and each bad
image is one error naming where it came from."""

import base64
import re

import numpy as np
import pytest
from PIL import Image

from tidal.utils.images import ImageError, image_part, load_image, to_data_url, to_png_bytes


@pytest.fixture
def image():
    pixels = np.arange(12 * 10 * 3, dtype=np.uint8).reshape(10, 12, 3)  # 12 wide, 10 high, every pixel distinct
    return Image.fromarray(pixels)


def test_every_form_gives_the_same_pixels(image, tmp_path):
    png = to_png_bytes(image)
    (tmp_path / "a.png").write_bytes(png)
    url = to_data_url(image)
    assert url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == png
    forms = [image, image.convert("RGBA"), png, bytearray(png), str(tmp_path / "a.png"), tmp_path / "a.png", url,
             image_part(image), {"type": "image_url", "image_url": url}, {"type": "image", "image": png},
             {"bytes": png, "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")}]
    for form in forms:
        got = load_image(form)
        assert got.mode == "RGB" and got.size == (12, 10), type(form)
        assert np.array_equal(np.asarray(got), np.asarray(image)), type(form)


@pytest.mark.parametrize("value, message", [
    (b"\x89PNG not really", "row 3, key 'image': unreadable image (15 bytes)"),
    (Image.new("RGB", (0, 4)), "row 3, key 'image': zero-size image (0x4)"),
    ("/no/such/file.png", "row 3, key 'image': no image file at '/no/such/file.png'"),
    ("https://example.com/cat.png", "row 3, key 'image': 'https://example.com/cat.png' is a remote URL"),
    ("data:text/plain;base64,aGk=", "row 3, key 'image': a data URL must look like"),
    ("data:image/png;base64,@@@", "row 3, key 'image': bad base64 in data URL"),
    (42, "row 3, key 'image': expected an image (path, bytes, PIL image, data URL or image content part), got int"),
    ({"type": "text", "text": "hi"}, "row 3, key 'image': a dict with no image in it"),
])
def test_bad_images_are_one_error_naming_the_row_and_key(value, message):
    with pytest.raises(ImageError, match=re.escape(message)):
        load_image(value, "row 3, key 'image'")


def test_truncated_file_fails_at_decode(image):
    png = to_png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageError, match="unreadable image"):
        load_image(png[: len(png) // 2], "row 0, key 'image'")
