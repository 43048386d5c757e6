"""Harmonisation: take away what tells one collection's films from another's, keep the lungs (`data.harmonise`).

A model trained on a merge of public collections can learn which collection a
film came from instead of the disease (docs/datasets.md, "Source bias"):
collections differ in their frame (black scanner margins, white padding of a
journal figure), in what is burnt in (R/L markers, arrows, captions) and in
their intensity processing (window, gamma, edge enhancement). `trim-inpaint-equalise`
removes those three, in this order, on the decoded gray image before it is
resized to the model's input:

1. the image is brought to one working size (long side max(WORK_SIDE, the
   model's input size)), up or down: the collections' resolutions stop
   differing before anything else looks at them, and every step costs the
   same for a 3000 px CR as for a 224 px JPEG;
2. trim: rows and columns at the edges whose gray levels span at most
   FLAT_SPREAD are frame and cut away (never below half the side);
3. inpaint: burnt-in text and markers are small, compact marks far brighter
   (or darker) than what is around them: a white (black) top-hat of
   OVERLAY_KERNEL px above OVERLAY_CONTRAST on a bright (dark) pixel, in
   connected regions of at most OVERLAY_MAX_AREA of the image and
   OVERLAY_MAX_EXTENT of its side each way. They are filled from their
   surroundings (Telea). Ribs, the heart and the lung fields are wider than
   the kernel; long thin lines (ECG leads, tubes) exceed the extent and stay;
4. equalise: the histogram is equalised to a uniform one (exposure, window
   and gamma stop differing), then contrast-limited adaptive equalisation
   (CLAHE) sets local contrast to one level whatever edge enhancement the
   scanner applied.

The same function makes the shards' pixels (`prepare`, covidxray/data/image_cache.py)
and predict's model input (covidxray/edge/preprocess.py), chosen by the name the
manifest, the model card and the sidecar carry, so train and predict see the
same pixels. No TensorFlow: predict on a board imports this.
"""

from __future__ import annotations

import numpy as np

from covidxray.errors import UserError

NONE = "none"
TRIM_INPAINT_EQUALISE = "trim-inpaint-equalise"
METHODS = (NONE, TRIM_INPAINT_EQUALISE)
WORK_SIDE = 256
FLAT_SPREAD = 12  # gray levels: a row or column spanning no more is frame (as near_duplicates.trim_uniform_border)
TRIM_PASSES = 4  # frames nested this deep are trimmed
OVERLAY_KERNEL = 7  # px at the working size: text strokes and markers are thinner, anatomy is wider
OVERLAY_CONTRAST = 60  # gray levels above (below) the morphological opening (closing) around them
OVERLAY_BRIGHT, OVERLAY_DARK = 160, 80  # ... on pixels at least this bright (at most this dark)
OVERLAY_MAX_AREA = 0.004  # share of the image one overlay region may cover: letters and markers, not anatomy
OVERLAY_MAX_EXTENT = 0.08  # share of the side one overlay region may span each way: not a line along the film
OVERLAY_GROW = 1  # pixels added around an overlay before inpainting: its anti-aliased edge
INPAINT_RADIUS = 3
CLAHE_CLIP, CLAHE_TILES = 2.0, 8


def check_method(name: str, where: str = "data.harmonise") -> str:
    """`name` if this code implements it; UserError otherwise (a sidecar from a newer covidxray, or a typo)."""
    if name not in METHODS:
        raise UserError(
            f"{where}: {name!r} is not a harmonisation this covidxray implements ({', '.join(METHODS)}); "
            "predict with the covidxray version that trained the model, or retrain"
        )
    return name


def _working_copy(gray: np.ndarray, size: int) -> np.ndarray:
    import cv2

    scale = max(WORK_SIDE, size) / max(gray.shape)
    shape = (max(1, round(gray.shape[1] * scale)), max(1, round(gray.shape[0] * scale)))
    return cv2.resize(gray, shape, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)


def trim_flat_border(gray: np.ndarray) -> np.ndarray:
    """`gray` without the rows and columns at its edges whose levels span at most FLAT_SPREAD.

    Repeated while it trims: a frame of two colours (a scan's black margin inside a figure's white padding)
    has rows that cross both, which only become flat once the outer colour is gone.
    """
    original = gray
    for _ in range(TRIM_PASSES):
        rows = np.flatnonzero(np.ptp(gray, axis=1) > FLAT_SPREAD)
        columns = np.flatnonzero(np.ptp(gray, axis=0) > FLAT_SPREAD)
        if len(rows) < 2 or len(columns) < 2:
            break
        top, bottom, left, right = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
        if (top, bottom, left, right) == (0, gray.shape[0], 0, gray.shape[1]):
            break
        gray = gray[top:bottom, left:right]
    if gray.shape[0] < original.shape[0] / 2 or gray.shape[1] < original.shape[1] / 2:
        return original  # most of the image flat: not a frame, keep it whole
    return gray


def overlay_mask(gray: np.ndarray) -> np.ndarray:
    """uint8 mask (255) of the burnt-in text and markers (see the module docstring), grown by OVERLAY_GROW."""
    import cv2

    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (OVERLAY_KERNEL, OVERLAY_KERNEL))
    brighter = cv2.morphologyEx(gray, cv2.MORPH_TOPHAT, kernel)
    darker = cv2.morphologyEx(gray, cv2.MORPH_BLACKHAT, kernel)
    marks = ((brighter > OVERLAY_CONTRAST) & (gray >= OVERLAY_BRIGHT)) | (
        (darker > OVERLAY_CONTRAST) & (gray <= OVERLAY_DARK)
    )
    count, labels, stats, _ = cv2.connectedComponentsWithStats(marks.astype(np.uint8), connectivity=8)
    side = max(gray.shape)
    small = np.zeros(count, bool)
    small[1:] = (
        (stats[1:, cv2.CC_STAT_AREA] <= OVERLAY_MAX_AREA * gray.size)
        & (stats[1:, cv2.CC_STAT_WIDTH] <= OVERLAY_MAX_EXTENT * side)
        & (stats[1:, cv2.CC_STAT_HEIGHT] <= OVERLAY_MAX_EXTENT * side)
    )
    mask = (small[labels] * 255).astype(np.uint8)
    if OVERLAY_GROW and mask.any():
        mask = cv2.dilate(mask, np.ones((2 * OVERLAY_GROW + 1, 2 * OVERLAY_GROW + 1), np.uint8))
    return mask


def equalise(gray: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.createCLAHE(clipLimit=CLAHE_CLIP, tileGridSize=(CLAHE_TILES, CLAHE_TILES)).apply(cv2.equalizeHist(gray))


def harmonised(gray: np.ndarray, method: str, size: int) -> np.ndarray:
    """Decoded 2-D uint8 gray -> the same film harmonised by `method` (NONE: unchanged), at the working size."""
    if method == NONE:
        return gray
    import cv2

    check_method(method)
    work = trim_flat_border(_working_copy(np.ascontiguousarray(gray, np.uint8), size))
    mask = overlay_mask(work)
    if mask.any():
        work = cv2.inpaint(work, mask, INPAINT_RADIUS, cv2.INPAINT_TELEA)
    return equalise(np.ascontiguousarray(work))
