"""An image's pixel count from its header, read before any decoding.

A 0.8 MB PNG can declare 30000 x 30000 pixels and cost gigabytes to decode:
on a 4 GB board with one decode worker per core that is the out-of-memory
killer, not an error message. So the header is read first (PNG IHDR, JPEG
SOF, BMP and TIFF headers, DICOM Rows/Columns/frames) and an image above
`max_pixels` is refused before a single pixel is decoded, wherever in the
file the size sits (JPEG segments and TIFF directories are followed to it).
For formats and headers not parsed here, OpenCV's own limit is the second
line (`limit_decoder_pixels`), and the decoded size is checked again, so no
oversized image reaches a shard. Only the standard library: `predict` on a
Pi uses this too.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO

# Default data.max_pixels, sized for a Raspberry Pi 4 with 4 GB and one decode worker per core:
#   ~3.3 GB usable by programs (the OS and the GPU split keep the rest) - ~0.5 GB for prepare's main process
#   = 2.8 GB for 4 workers = 700 MB each; minus ~200 MB a worker holds before decoding (Python, numpy,
#   OpenCV, pydicom: measured peak RSS after imports) = ~500 MB for one image's buffers. Peak growth per
#   decoded pixel, measured (ru_maxrss of a fresh worker decoding a 3000 x 3000 file): 8-bit PNG/JPEG
#   < 1 byte, 16-bit gray PNG 13.5, 16-bit RGB PNG 18.3, 16-bit windowed DICOM 30.9 bytes (float64 LUTs).
#   500 MB / 31 B = 16 M pixels: 4000 x 4000, above a 35 x 43 cm CR plate at 0.1 mm (3520 x 4280 = 15.1 M)
#   and every DR panel; it refuses the 16000 x 16000 and 30000 x 30000 bombs. Boards with 8 GB can take ~2x.
DEFAULT_MAX_PIXELS = 16_000_000
OPENCV_PIXEL_LIMIT = "OPENCV_IO_MAX_IMAGE_PIXELS"
_HEAD_BYTES = 64  # PNG, BMP and TIFF headers sit at the start; JPEG segments and TIFF IFDs are followed with seeks
_JPEG_MAX_SEGMENTS = 4096  # real files have a few dozen before the SOF; this bounds the walk through a crafted one
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class HeaderError(ValueError):
    """A header that declares no usable size: cut short, out of sync, or a size of 0."""


def _png(handle: BinaryIO, head: bytes) -> tuple[int, int] | None:
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return struct.unpack(">II", head[16:24])
    return None


def _jpeg(handle: BinaryIO, head: bytes) -> tuple[int, int] | None:
    """Width and height from the first SOF segment (baseline, progressive, lossless, arithmetic).

    Segments are followed by their lengths through the whole file, not just the first bytes: EXIF,
    ICC or padding segments can push the SOF anywhere, and a size the check does not find is a size
    only the decoder would see, after allocating it.
    """
    if head[:2] != b"\xff\xd8":
        return None
    at, fills = 2, 0
    for _ in range(_JPEG_MAX_SEGMENTS):
        handle.seek(at)
        marker = handle.read(4)
        if len(marker) < 2 or marker[0] != 0xFF:
            raise HeaderError("JPEG segments end or lose sync before a frame header")
        if marker[1] == 0xFF:  # fill byte
            at, fills = at + 1, fills + 1
            if fills > _JPEG_MAX_SEGMENTS:
                break
            continue
        if marker[1] in (0xD8, 0x01) or 0xD0 <= marker[1] <= 0xD7:  # markers without a length
            at += 2
            continue
        if marker[1] in (0xD9, 0xDA):  # end of image, or start of scan before any frame header
            raise HeaderError("JPEG without a frame header before its scan")
        if len(marker) < 4:
            raise HeaderError("JPEG cut short in a segment header")
        length = struct.unpack(">H", marker[2:4])[0]
        if marker[1] in _JPEG_SOF:
            frame = handle.read(5)
            if len(frame) < 5:
                raise HeaderError("JPEG cut short in its frame header")
            height, width = struct.unpack(">HH", frame[1:5])
            return width, height
        if length < 2:
            raise HeaderError("JPEG segment with a length below 2")
        at += 2 + length
    raise HeaderError(f"JPEG with more than {_JPEG_MAX_SEGMENTS} segments or fill bytes before its frame header")


def _bmp(handle: BinaryIO, head: bytes) -> tuple[int, int] | None:
    if head[:2] != b"BM" or len(head) < 26:
        return None
    if struct.unpack("<I", head[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
        return struct.unpack("<HH", head[18:22])
    width, height = struct.unpack("<ii", head[18:26])
    return abs(width), abs(height)  # a negative height means top-down rows


def _tiff(handle: BinaryIO, head: bytes) -> tuple[int, int] | None:
    """ImageWidth (256) and ImageLength (257) from the first IFD, wherever in the file it lies."""
    order = {b"II": "<", b"MM": ">"}.get(head[:2])
    if order is None or len(head) < 8 or struct.unpack(order + "H", head[2:4])[0] != 42:
        return None
    handle.seek(struct.unpack(order + "I", head[4:8])[0])
    count = handle.read(2)
    if len(count) < 2:
        raise HeaderError("TIFF whose first IFD lies beyond the end of the file")
    entries = handle.read(12 * struct.unpack(order + "H", count)[0])
    size: dict[int, int] = {}
    for at in range(0, len(entries) - 11, 12):
        tag, kind = struct.unpack(order + "HH", entries[at : at + 4])
        if tag in (256, 257):
            value = entries[at + 8 : at + 10] if kind == 3 else entries[at + 8 : at + 12]
            size[tag] = struct.unpack(order + ("H" if kind == 3 else "I"), value)[0]
    if len(size) != 2:
        raise HeaderError("TIFF whose first IFD gives no width and height")
    return size[256], size[257]


def _dicom(path: Path) -> tuple[int, int] | None:
    """Columns and Rows x frames x samples per pixel: everything pixel_array would allocate."""
    import pydicom

    try:
        dataset = pydicom.dcmread(str(path), stop_before_pixels=True, force=True)
        rows, columns = int(dataset.Rows), int(dataset.Columns)
        planes = int(dataset.get("NumberOfFrames", 1) or 1) * int(dataset.get("SamplesPerPixel", 1) or 1)
    except Exception:  # unreadable headers are the decoder's to report, with its own reason
        return None
    return columns, rows * planes


def declared_size(path: str | Path, dicom: bool = False) -> tuple[int, int] | None:
    """(width, height) the file's header declares (for DICOM, height counts every frame and sample), or None.

    None: not a format parsed here, or a PNG/JPEG/BMP/TIFF header that declares no usable size (cut short,
    out of sync), which the decoder then reports as unreadable, under OpenCV's own pixel limit
    (`limit_decoder_pixels`).
    """
    if dicom:
        return _dicom(Path(path))
    try:
        with open(path, "rb") as handle:
            head = handle.read(_HEAD_BYTES)
            for parse in (_png, _jpeg, _bmp, _tiff):
                size = parse(handle, head)
                if size is not None:
                    return size
    except (OSError, HeaderError, struct.error):  # unreadable, or a header cut short: the decoder's to report
        return None
    return None


def limit_decoder_pixels(max_pixels: int) -> bool:
    """Make OpenCV itself refuse images above `max_pixels` (OPENCV_IO_MAX_IMAGE_PIXELS), for formats or headers
    `declared_size` does not read. OpenCV reads the variable once, when cv2 is imported (a static in its
    imgcodecs), so this works only before that import, in this process and in processes started after it;
    returns whether it took effect here.
    """
    os.environ[OPENCV_PIXEL_LIMIT] = str(int(max_pixels))
    return "cv2" not in sys.modules
