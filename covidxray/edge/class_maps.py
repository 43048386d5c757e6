"""Grad-CAM without TensorFlow, from the class activation maps an exported model gives beside its probabilities.

Every registered model but small_cnn ends in global average pooling -> dropout
-> a softmax Dense layer. There the gradient of class c's logit with respect to
the last feature map F (h x w x k) is W[k, c] / (h w) at every position, so
Grad-CAM's channel weights are the Dense kernel's column (up to the positive
1/(h w)) and Grad-CAM equals the class activation map of Zhou et al. 2016,
ReLU(sum_k W[k, c] F[i, j, k]), up to a positive scale (Selvaraju et al. 2017,
sec. 3.1). Dropout is the identity at inference, and the sidecar's temperature
divides every logit by the same T > 0: neither changes the map once it is scaled
to a peak of 1, as Grad-CAM's is. So export adds the maps of every class as the
model output `class_maps` (covidxray/export/class_maps.py), and this module
only picks a class's map and draws it. A model exported before that, or a
small_cnn (a Flatten -> Dense(ReLU) head, whose gradient depends on the input),
has no such output: no overlay, and `serve` says so.
"""

from __future__ import annotations

import base64

import cv2
import numpy as np

from covidxray.edge.litert import TFLiteClassifier

HEAT_WEIGHT = 0.45  # share of the colour map in the overlay; the X-ray stays readable beneath
OVERLAY_MAX_SIDE = 1024  # px: the page shows it at screen size; a 4000 px film would make a 40 MB data URL
# JPEG, not PNG: for a 1422 x 1152 film's overlay at 1024 px, 2 ms and 80 KB against PNG's 110 ms and 900 KB
# (measured here), and a colour map over a radiograph is what JPEG is made for.
OVERLAY_JPEG_QUALITY = 85
NO_OVERLAY = (
    "this model gives no class activation maps (exported before covidxray gave them, or a model without global "
    "average pooling before its classifier, such as small_cnn): export it again with this covidxray for the overlay"
)


def normalised(cam: np.ndarray) -> np.ndarray:
    """A map's negative parts cut and its peak scaled to 1, as Grad-CAM's is."""
    cam = np.maximum(cam.astype(np.float32), 0)
    peak = float(cam.max())
    return cam / peak if peak > 0 else cam


def heat_map(maps: np.ndarray, class_index: int) -> np.ndarray:
    """(h, w, classes) class activation maps -> class `class_index`'s Grad-CAM heat map in [0, 1]."""
    return normalised(maps[..., class_index])


def overlay(gray: np.ndarray, heat: np.ndarray) -> np.ndarray:
    """Gray X-ray (any size) + heat map -> BGR image of the X-ray's size with a JET colour overlay."""
    height, width = gray.shape[:2]
    heat = cv2.resize(heat.astype(np.float32), (width, height), interpolation=cv2.INTER_LINEAR)
    colour = cv2.applyColorMap(np.round(np.clip(heat, 0, 1) * 255).astype(np.uint8), cv2.COLORMAP_JET)
    base = cv2.cvtColor(gray, cv2.COLOR_GRAY2BGR)
    return cv2.addWeighted(base, 1 - HEAT_WEIGHT, colour, HEAT_WEIGHT, 0)


def screen_size(gray: np.ndarray) -> np.ndarray:
    side = max(gray.shape[:2])
    if side <= OVERLAY_MAX_SIDE:
        return gray
    scale = OVERLAY_MAX_SIDE / side
    size = (max(1, round(gray.shape[1] * scale)), max(1, round(gray.shape[0] * scale)))
    return cv2.resize(gray, size, interpolation=cv2.INTER_AREA)


def overlay_data_url(classifier: TFLiteClassifier):
    """An explainer for predict_path giving the overlay as a JPEG data: URL, or None when the model has no maps.

    It reads the maps of the classifier's last `infer`, which predict_path runs just before it explains:
    one explainer per classifier, used by the thread that owns that classifier.
    """
    if classifier.class_maps_output is None:
        return None

    def explain(_source, gray: np.ndarray, _image: np.ndarray, class_index: int) -> str:
        maps = classifier.class_maps()
        drawn = overlay(screen_size(gray), heat_map(maps, class_index))
        ok, jpeg = cv2.imencode(".jpg", drawn, [cv2.IMWRITE_JPEG_QUALITY, OVERLAY_JPEG_QUALITY])
        if not ok:
            raise ValueError("JPEG encoding of the overlay failed")
        return "data:image/jpeg;base64," + base64.b64encode(jpeg.tobytes()).decode("ascii")

    return explain
