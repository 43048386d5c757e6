"""An image's pixel count from its header, read before any decoding.

A 0.8 MB PNG can declare 30000 x 30000 pixels and cost gigabytes to decode:
on a 4 GB board with one decode worker per core that is the out-of-memory
killer, not an error message. So the header is read first (PNG IHDR, JPEG
SOF, BMP and TIFF headers, DICOM Rows/Columns/frames) and an image above
`max_pixels` is refused before a single pixel is decoded. Formats not parsed
here are checked right after decoding, so no oversized image reaches a shard.
Only the standard library: `predict` on a Pi uses this too.
"""

from __future__ import annotations

import struct
from pathlib import Path

# Default data.max_pixels, sized for a Raspberry Pi 4 with 4 GB and one decode worker per core:
#   ~3.3 GB usable by programs (the OS and the GPU split keep the rest) - ~0.5 GB for prepare's main process
#   = 2.8 GB for 4 workers = 700 MB each; minus ~200 MB a worker holds before decoding (Python, numpy,
#   OpenCV, pydicom: measured peak RSS after imports) = ~500 MB for one image's buffers. Peak growth per
#   decoded pixel, measured (ru_maxrss of a fresh worker decoding a 3000 x 3000 file): 8-bit PNG/JPEG
#   < 1 byte, 16-bit gray PNG 13.5, 16-bit RGB PNG 18.3, 16-bit windowed DICOM 30.9 bytes (float64 LUTs).
#   500 MB / 31 B = 16 M pixels: 4000 x 4000, above a 35 x 43 cm CR plate at 0.1 mm (3520 x 4280 = 15.1 M)
#   and every DR panel; it refuses the 16000 x 16000 and 30000 x 30000 bombs. Boards with 8 GB can take ~2x.
DEFAULT_MAX_PIXELS = 16_000_000
_HEAD_BYTES = 64 << 10  # JPEG puts its SOF after EXIF/ICC segments, which can be tens of kB


def _png(head: bytes) -> tuple[int, int] | None:
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return struct.unpack(">II", head[16:24])
    return None


def _jpeg(head: bytes) -> tuple[int, int] | None:
    """Width and height from the first SOF segment (baseline, progressive, lossless, arithmetic)."""
    if head[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 <= len(head):
        if head[at] != 0xFF:
            return None  # lost sync: not a well-formed JPEG header
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            at += 2
            continue
        length = struct.unpack(">H", head[at + 2 : at + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            height, width = struct.unpack(">HH", head[at + 5 : at + 9])
            return width, height
        if marker == 0xDA:  # start of scan before any frame header
            return None
        at += 2 + length
    return None


def _bmp(head: bytes) -> tuple[int, int] | None:
    if head[:2] != b"BM" or len(head) < 26:
        return None
    if struct.unpack("<I", head[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
        return struct.unpack("<HH", head[18:22])
    width, height = struct.unpack("<ii", head[18:26])
    return abs(width), abs(height)  # a negative height means top-down rows


def _tiff(head: bytes) -> tuple[int, int] | None:
    """ImageWidth (256) and ImageLength (257) from the first IFD, when it lies within the bytes read."""
    order = {b"II": "<", b"MM": ">"}.get(head[:2])
    if order is None or struct.unpack(order + "H", head[2:4])[0] != 42:
        return None
    ifd = struct.unpack(order + "I", head[4:8])[0]
    if ifd + 2 > len(head):
        return None
    size: dict[int, int] = {}
    for n in range(struct.unpack(order + "H", head[ifd : ifd + 2])[0]):
        entry = head[ifd + 2 + 12 * n : ifd + 14 + 12 * n]
        if len(entry) < 12:
            break
        tag, kind = struct.unpack(order + "HH", entry[:4])
        if tag in (256, 257):
            size[tag] = struct.unpack(order + ("H" if kind == 3 else "I"), entry[8:10] if kind == 3 else entry[8:12])[0]
    return (size[256], size[257]) if len(size) == 2 else None


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
    """(width, height) the file's header declares (for DICOM, height counts every frame and sample), or None."""
    if dicom:
        return _dicom(Path(path))
    try:
        with open(path, "rb") as handle:
            head = handle.read(_HEAD_BYTES)
    except OSError:
        return None
    for parse in (_png, _jpeg, _bmp, _tiff):
        try:
            size = parse(head)
        except struct.error:  # a header cut short
            size = None
        if size is not None:
            return size
    return None
