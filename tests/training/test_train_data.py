"""examples/_train_data.py's image folder: what a real folder of images throws at it.

Symlinked class folders count (once, even in a loop); hidden files, folders with an image suffix and files that are
no image are left out and listed, not found mid-training; loose images beside class folders are left out (no wrong
label); 16-bit grey images are scaled to 8 bits, not clipped to white, and so are 32-bit int and float TIFFs by the
range their values use; EXIF orientation is applied; GIF and TIFF are read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from _train_data import ImageFolderDataset, ShapesDataset  # noqa: E402


def _images(folder: Path, count: int, colour=(200, 40, 40)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (12 + i, 10), colour).save(folder / f"{i}.png")


def test_symlinked_class_folders_count_and_odd_files_are_listed(tmp_path):
    root = tmp_path / "data"
    _images(root / "cats", 3)
    _images(tmp_path / "elsewhere" / "dogs", 2, (40, 40, 200))
    (root / "dogs").symlink_to(tmp_path / "elsewhere" / "dogs", target_is_directory=True)
    (root / "dogs_again").symlink_to(root / "dogs", target_is_directory=True)  # the same folder twice
    (root / "cats" / "loop").symlink_to(root, target_is_directory=True)  # a cycle: must not hang
    (root / "cats" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS resource fork
    (root / "cats" / "album.jpg").mkdir()  # a folder named like an image
    (root / "cats" / "notes.png").write_text("not an image")
    _images(root / ".ipynb_checkpoints", 1)  # hidden folder
    Image.new("RGB", (10, 10)).save(root / "loose.png")  # beside the class folders: no class of its own

    data = ImageFolderDataset(root, 8)

    assert data.class_names == ["cats", "dogs"]
    assert len(data) == 5 and sorted(data.labels) == [0, 0, 0, 1, 1]
    assert all(data.files[i].parent.name == data.class_names[label] for i, label in enumerate(data.labels))
    skipped = "\n".join(data.skipped)
    for name in ("._0.png", "notes.png", "loose.png"):
        assert name in skipped, skipped
    assert "album.jpg" not in skipped and ".ipynb_checkpoints" not in skipped
    for i in range(len(data)):  # every file kept loads
        image, _ = data[i]
        assert image.shape == (3, 8, 8)


def test_a_folder_of_only_unreadable_files_names_them(tmp_path):
    (tmp_path / "a.png").write_text("text")
    with pytest.raises(FileNotFoundError, match=r"no readable images.*a\.png"):
        ImageFolderDataset(tmp_path, 8)


def test_16_bit_grey_is_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 16 * 16).reshape(16, 16)
    Image.fromarray(ramp.astype(np.uint16)).save(tmp_path / "grey.png")
    assert Image.open(tmp_path / "grey.png").mode == "I;16"  # PIL keeps the 16 bits

    pixels, _ = ImageFolderDataset(tmp_path, 16)[0]

    expected = np.rint(ramp * 255 / 65535) / 127.5 - 1  # [-1, 1] as the dataset scales 8-bit values
    assert np.abs(pixels[0].numpy() - expected).max() < 0.1  # bicubic resize at the same size moves values little
    assert (pixels == 1).float().mean() < 0.05


@pytest.mark.parametrize(
    "mode,scale,offset",
    [("F", 1.0, 0.0), ("F", 255.0, 0.0), ("I", 255.0, 0.0), ("I", 65535.0, 0.0), ("F", 7.0, -3.0)],
)
def test_int32_and_float_grey_are_scaled_by_the_range_they_use(tmp_path, mode, scale, offset):
    """A float TIFF of [0, 1] values or a 32-bit int image of 8-bit values carries no bit depth: scaled by the range
    its values use (its own minimum and maximum outside the known ones), not clipped to black or white."""
    ramp = np.linspace(0, 1, 16 * 16).reshape(16, 16)
    values = ramp * scale + offset
    Image.fromarray(values.astype(np.float32 if mode == "F" else np.int32), mode).save(tmp_path / "grey.tiff")
    assert Image.open(tmp_path / "grey.tiff").mode == mode

    pixels, _ = ImageFolderDataset(tmp_path, 16)[0]

    expected = np.rint(ramp * 255) / 127.5 - 1
    assert np.abs(pixels[0].numpy() - expected).max() < 0.1


@pytest.mark.parametrize("resolution", [15, 17, 9, 16])
def test_shapes_at_any_resolution(resolution):
    """The procedural background's 8-pixel noise blocks cover sides that are no multiple of 8 (cropped), and even
    sides draw the same images as before (the same numbers from the generator)."""
    image, label = ShapesDataset(resolution, length=4, seed=3)[1]
    assert tuple(image.shape) == (3, resolution, resolution) and image.isfinite().all() and label >= 0


def test_exif_orientation_is_applied_and_gif_tiff_are_read(tmp_path):
    # Stored 16 wide x 8 high, left half red, tagged "rotate 90 clockwise to view" (orientation 6): the viewer's
    # image is 8 wide x 16 high with red on top.
    stored = Image.new("RGB", (16, 8), (30, 30, 200))
    stored.paste((220, 30, 30), (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    Image.new("P", (9, 9), 3).save(tmp_path / "frames.gif")
    Image.new("RGB", (9, 9), (40, 200, 40)).save(tmp_path / "scan.tif")

    data = ImageFolderDataset(tmp_path, 8)

    assert sorted(p.name for p in data.files) == ["frames.gif", "portrait.jpg", "scan.tif"] and not data.skipped
    portrait, _ = data[[p.name for p in data.files].index("portrait.jpg")]
    # Short side 8: the crop keeps the middle 8 rows of 16, the top 4 red and the bottom 4 blue.
    assert portrait[0, 1, 4] > 0.5 and portrait[2, 1, 4] < -0.5, portrait[:, :, 4]
    assert portrait[2, 6, 4] > 0.5 and portrait[0, 6, 4] < -0.5, portrait[:, :, 4]
    for name in ("frames.gif", "scan.tif"):
        image, _ = data[[p.name for p in data.files].index(name)]
        assert image.shape == (3, 8, 8) and image.isfinite().all()
