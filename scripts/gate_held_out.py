"""The held-out set scripts/bench_gate.py measures the radiograph gate on, after the corpus (scripts/gate_corpus.py).

THE RULE: this set is held out. It must never be used to choose a threshold, a fit, a rule, a margin or a corpus
entry; only scripts/gate_corpus.py's images may be looked at for that. It is measured once a change has been chosen
on the corpus, to see how the gate does on images nothing was chosen on. A change chosen by looking at what this set
lets through or refuses (including adding one of its images, sources or designs to the corpus) makes it no longer
held out: the docs that quote its figures (docs/deploy.md, the README's gate row) must then say so, and only a new
set of unseen sources measures the gate without that bias again.

It re-creates the design of the 89-image held-out measurement in docs/deploy.md, whose throw-away script was not
kept: the same sources and forms, but not the same crops, screenshots or photos, so its figures are its own.
Everything is deterministic (fixed seeds), needs no network, and comes from packages already installed and the
shared data. Every non-radiograph here must be refused (an unreadable one counts as refused):

- photo, map, mr-slice: sources scripts/gate_corpus.py does not use: matplotlib's sample data (the grace_hopper,
  Minduka_Present_Blue_Pack and logo2 pictures as `photo`, transparency shown on white; the MR slice s1045.ima
  as `mr-slice`; the elevation maps jacksboro_fault_dem and topobathy rendered to 8-bit gray as `map`),
  scikit-learn's `flower` photo, and the photos bundled with `mahotas` when that package happens to be installed
  (it is no dependency; without it the set lacks the 28 images the 89-image set had from its four photos). Each as
  a gray PNG, as 3 random crops (50-80% of each side), mirrored, turned 270 degrees, and with gamma 0.6 and a
  Gaussian blur: 7 gray PNGs per source ("pixels": the decoder's colour check cannot refuse them).
- screenshot-text-panel: 8 screenshots of another layout than the corpus's viewer screenshots: a real film at the
  left, a plain panel of report text at the right (panel grays, widths and font scales vary), as gray PNGs.
- grid: one 2 x 2 grid of four real films.
- photo-of-film: 3 phone-style photos of a real film lying on a desk (the film perspective-warped onto a textured
  desk of smoothed noise and a gradient, with a slight colour cast), as colour PNGs as a phone gives them ("file")
  and as gray PNGs ("pixels").

The real films are NIH films of shared/data/covid19-talo-nih-half-512 at an even stride (none of the corpus's odd
films or viewer screenshots, none of gate_corpus.KNOWN_ODD); without that folder those items are left out.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import cv2
import numpy as np
from gate_corpus import KNOWN_ODD, RASTER, Item, _images_under, _write

FILMS = "covid19-talo-nih-half-512"
SCREENSHOTS, GRID, PHONE_PHOTOS = 8, 4, 3  # films each part takes, in this order


def _seed(name: str) -> int:
    """A fixed seed per source (stable across runs, unlike hash(); adding a source changes no other's images)."""
    return zlib.crc32(name.encode())


def _to_gray(image: np.ndarray) -> np.ndarray:
    """A decoded 8-bit picture as gray: transparency shown on white, as a viewer shows it."""
    if image.ndim == 2:
        return image
    if image.shape[2] == 4:
        alpha = image[:, :, 3:].astype(np.float64) / 255
        image = np.round(image[:, :, :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
    return cv2.cvtColor(image[:, :, :3], cv2.COLOR_BGR2GRAY)


def _eight_bit(values: np.ndarray) -> np.ndarray:
    """A height map or a scan's values spread over 0..255 (min to max)."""
    values = values.astype(np.float64)
    return np.round((values - values.min()) * 255 / max(float(np.ptp(values)), 1e-12)).astype(np.uint8)


def _sources() -> list[tuple[str, str, np.ndarray]]:
    """(category, name, gray picture) of every photo and map source."""
    import matplotlib.cbook
    import sklearn.datasets

    def sample(name: str) -> str:
        return matplotlib.cbook.get_sample_data(name, asfileobj=False)

    sources = [
        ("photo", Path(name).stem, _to_gray(cv2.imread(sample(name), cv2.IMREAD_UNCHANGED)))
        for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
    ]
    with gzip.open(sample("s1045.ima.gz")) as handle:  # 256 x 256 big-endian uint16
        slice_ = np.frombuffer(handle.read(), ">u2").reshape(256, 256)
    sources.append(("mr-slice", "s1045", _eight_bit(slice_)))
    with np.load(sample("jacksboro_fault_dem.npz")) as dem:
        sources.append(("map", "jacksboro_fault_dem", _eight_bit(dem["elevation"])))
    with np.load(sample("topobathy.npz")) as topo:
        sources.append(("map", "topobathy", _eight_bit(topo["topo"])))
    flower = sklearn.datasets.load_sample_image("flower.jpg")  # RGB
    sources.append(("photo", "flower", cv2.cvtColor(flower, cv2.COLOR_RGB2GRAY)))
    try:
        import mahotas
    except ImportError:
        return sources
    for path in sorted((Path(mahotas.__file__).parent / "demos" / "data").glob("*")):
        image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED) if path.suffix.lower() in RASTER else None
        if image is not None and image.dtype == np.uint8:
            sources.append(("photo", f"mahotas-{path.stem}", _to_gray(image)))
    return sources


def forms(gray: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """A gray picture as it is, as 3 random crops (50-80% of each side), mirrored, turned 270 degrees, and with gamma
    0.6 and a Gaussian blur."""
    rng = np.random.default_rng(seed)
    height, width = gray.shape
    shown = {"gray": gray}
    for i in range(3):
        crop_h, crop_w = (np.array([height, width]) * rng.uniform(0.5, 0.8, 2)).round().astype(int)
        top, left = rng.integers(0, height - crop_h + 1), rng.integers(0, width - crop_w + 1)
        shown[f"crop{i}"] = gray[top : top + crop_h, left : left + crop_w]
    shown["mirror"] = np.ascontiguousarray(gray[:, ::-1])
    shown["rot270"] = np.ascontiguousarray(np.rot90(gray, 3))
    brighter = np.round(255 * (gray / 255.0) ** 0.6).astype(np.uint8)
    shown["gamma-blur"] = cv2.GaussianBlur(brighter, (0, 0), 1.5)
    return shown


def _photos_and_maps(out: Path) -> list[Item]:
    return [
        Item(category, _write(out / "photos" / f"{name}-{form}.png", image), "pixels")
        for category, name, gray in _sources()
        for form, image in forms(gray, _seed(name)).items()
    ]


def _films(shared: Path) -> list[np.ndarray]:
    """SCREENSHOTS + GRID + PHONE_PHOTOS real films at an even stride through FILMS (fewer if it holds fewer)."""
    folder = shared / FILMS
    if not folder.is_dir():
        return []
    paths = [p for p in _images_under(folder) if p.suffix.lower() == ".png" and p.name not in KNOWN_ODD]
    step = max(1, len(paths) // (SCREENSHOTS + GRID + PHONE_PHOTOS))
    return [
        cv2.imread(str(p), cv2.IMREAD_GRAYSCALE) for p in paths[step // 2 :: step][: SCREENSHOTS + GRID + PHONE_PHOTOS]
    ]


REPORT = [
    "Patient: DOE, JANE  ID {pid}",
    "DOB: 19{yy}-0{mm}-1{dd}   Sex: F",
    "Accession: A{acc}",
    "Exam: XR CHEST PA AND LATERAL",
    "Date: 2020-04-0{dd} 10:{mi}",
    "Referring: Dr. SMITH",
    "",
    "CLINICAL HISTORY: cough and fever for five days.",
    "COMPARISON: none available.",
    "FINDINGS: The cardiomediastinal silhouette is within normal limits. The lungs are clear without focal "
    "consolidation, pleural effusion or pneumothorax. No acute osseous abnormality.",
    "IMPRESSION: No acute cardiopulmonary process.",
    "",
    "Dictated by: Dr. A. RADIOLOGIST",
    "Signed: 2020-04-0{dd} 11:{mi}",
]


def _wrapped(text: str, width: int, font: int, scale: float, thickness: int) -> list[str]:
    """`text` in lines no wider than `width` pixels."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and cv2.getTextSize(candidate, font, scale, thickness)[0][0] > width:
            lines.append(line)
            candidate = word
        line = candidate
    return [*lines, line]


def text_panel_screenshot(film: np.ndarray, layout: dict, seed: int) -> np.ndarray:
    """`film` at the left of a screen, fitted to its height, and a plain panel of report text at the right."""
    rng = np.random.default_rng(seed)
    width, height = layout["size"]
    panel = round(width * layout["panel"])
    screen = np.full((height, width), layout["background"], np.uint8)
    scale = min((height - 20) / film.shape[0], (width - panel - 20) / film.shape[1])
    shown = cv2.resize(film, (round(film.shape[1] * scale), round(film.shape[0] * scale)), interpolation=cv2.INTER_AREA)
    top, left = (height - shown.shape[0]) // 2, (width - panel - shown.shape[1]) // 2
    screen[top : top + shown.shape[0], left : left + shown.shape[1]] = shown
    screen[:, width - panel :] = layout["panel_gray"]
    font, font_scale = layout["font"], layout["scale"]
    thickness = max(1, round(1.6 * font_scale))
    line_height = round(34 * font_scale)
    fields = {
        "pid": rng.integers(10**6, 10**7),
        "yy": rng.integers(30, 99),
        "mm": rng.integers(1, 9),
        "dd": rng.integers(1, 9),
        "acc": rng.integers(10**7, 10**8),
        "mi": rng.integers(10, 59),
    }
    y = 20 + line_height
    for paragraph in REPORT:
        for line in (
            _wrapped(paragraph.format(**fields), panel - 40, font, font_scale, thickness) if paragraph else [""]
        ):
            if y > height - 10:
                return screen
            cv2.putText(screen, line, (width - panel + 20, y), font, font_scale, layout["ink"], thickness, cv2.LINE_AA)
            y += line_height
    return screen


PANEL_LAYOUTS = [  # screen size, panel share of the width, film-side background, panel gray, ink, font, font scale
    {"size": (1920, 1080), "panel": 0.40, "background": 0, "panel_gray": 40, "ink": 230, "font": 0, "scale": 0.8},
    {"size": (1280, 1024), "panel": 0.35, "background": 10, "panel_gray": 245, "ink": 20, "font": 0, "scale": 0.6},
    {"size": (1600, 900), "panel": 0.45, "background": 0, "panel_gray": 70, "ink": 255, "font": 2, "scale": 0.7},
    {"size": (1440, 900), "panel": 0.30, "background": 25, "panel_gray": 200, "ink": 30, "font": 0, "scale": 0.5},
    {"size": (1366, 768), "panel": 0.42, "background": 0, "panel_gray": 25, "ink": 180, "font": 0, "scale": 0.55},
    {"size": (1920, 1200), "panel": 0.33, "background": 50, "panel_gray": 255, "ink": 60, "font": 2, "scale": 1.0},
    {"size": (1280, 800), "panel": 0.50, "background": 0, "panel_gray": 120, "ink": 250, "font": 0, "scale": 0.6},
    {"size": (2560, 1440), "panel": 0.38, "background": 15, "panel_gray": 160, "ink": 0, "font": 2, "scale": 1.3},
]


def _screenshots(films: list[np.ndarray], out: Path) -> list[Item]:
    return [
        Item(
            "screenshot-text-panel",
            _write(out / "screenshots" / f"text-panel{i}.png", text_panel_screenshot(film, layout, seed=i)),
        )
        for i, (film, layout) in enumerate(zip(films, PANEL_LAYOUTS))
    ]


def grid(films: list[np.ndarray], gap: int = 6) -> np.ndarray:
    """Four films in 2 x 2 tiles of the first film's size, on black with a `gap` between them."""
    height, width = films[0].shape
    sheet = np.zeros((2 * height + gap, 2 * width + gap), np.uint8)
    for i, film in enumerate(films[:4]):
        top, left = (i // 2) * (height + gap), (i % 2) * (width + gap)
        sheet[top : top + height, left : left + width] = cv2.resize(film, (width, height), interpolation=cv2.INTER_AREA)
    return sheet


def phone_photo_of_film(film: np.ndarray, seed: int, size: tuple[int, int] = (1600, 1200)) -> np.ndarray:
    """A BGR phone-style photo of `film` lying on a desk: the film perspective-warped onto a textured desk (smoothed
    noise and a gradient), a soft shadow, sensor noise and a slight colour cast."""
    rng = np.random.default_rng(seed)
    width, height = size
    yy, xx = np.mgrid[:height, :width] / max(height, width)
    angle = rng.uniform(0, 2 * np.pi)
    desk = rng.uniform(110, 160) + 60 * (np.cos(angle) * xx + np.sin(angle) * yy - 0.5)  # light falling off
    for sigma_x, sigma_y, amount in ((1.0, 1.0, 3), (60, 1.5, 9), (25, 25, 6)):  # fine grain, wood grain, blotches
        noise = cv2.GaussianBlur(rng.normal(0, 1, (height, width)), (0, 0), sigmaX=sigma_x, sigmaY=sigma_y)
        desk += amount * noise / max(noise.std(), 1e-9)
    # where the film's corners land: a quadrilateral about 60% of the frame, narrower at the top (the phone tilted)
    film_h, film_w = film.shape
    quad_h = height * rng.uniform(0.62, 0.78)
    quad_w = quad_h * film_w / film_h * rng.uniform(0.95, 1.05)
    centre = np.array([width / 2, height / 2]) + rng.uniform(-0.06, 0.06, 2) * [width, height]
    narrow = rng.uniform(0.04, 0.12) * quad_w
    corners = np.array(
        [
            [-quad_w / 2 + narrow, -quad_h / 2],
            [quad_w / 2 - narrow, -quad_h / 2],
            [quad_w / 2, quad_h / 2],
            [-quad_w / 2, quad_h / 2],
        ]
    )
    turn = np.deg2rad(rng.uniform(-8, 8))
    rotation = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    corners = (corners @ rotation.T + centre + rng.normal(0, 0.008 * width, (4, 2))).astype(np.float32)
    source = np.array([[0, 0], [film_w - 1, 0], [film_w - 1, film_h - 1], [0, film_h - 1]], np.float32)
    matrix = cv2.getPerspectiveTransform(source, corners)
    # a film lies on the desk as a dark sheet: its base is not pure black, its brightest parts not pure white
    sheet = 18 + film.astype(np.float64) * (215 / 255)
    warped = cv2.warpPerspective(sheet, matrix, (width, height), flags=cv2.INTER_LINEAR)
    cover = cv2.warpPerspective(np.ones_like(sheet), matrix, (width, height), flags=cv2.INTER_LINEAR)
    shadow = cv2.GaussianBlur(np.roll(cover, (int(0.012 * height), int(0.01 * width)), (0, 1)), (0, 0), 0.015 * width)
    desk *= 1 - 0.35 * shadow
    glare = np.exp(-(((xx - rng.uniform(0.3, 0.7)) ** 2 + (yy - rng.uniform(0.2, 0.5)) ** 2) / 0.02))
    gray = desk * (1 - cover) + warped * cover + 35 * glare * cover + rng.normal(0, 3, (height, width))
    cast = 1 + rng.uniform(-0.07, 0.07, 3)  # B, G, R gains of a white balance slightly off
    photo = gray[:, :, None] * cast[None, None, :]
    return np.clip(np.round(cv2.GaussianBlur(photo, (0, 0), 0.7)), 0, 255).astype(np.uint8)


def _photos_of_film(films: list[np.ndarray], out: Path) -> list[Item]:
    items = []
    for i, film in enumerate(films):
        photo = phone_photo_of_film(film, seed=100 + i)
        items.append(Item("photo-of-film", _write(out / "photo-of-film" / f"desk{i}.png", photo)))
        gray = cv2.cvtColor(photo, cv2.COLOR_BGR2GRAY)
        items.append(Item("photo-of-film", _write(out / "photo-of-film" / f"desk{i}-gray.png", gray), "pixels"))
    return items


def held_out(shared: Path, out: Path) -> list[Item]:
    """Every image of the held-out set (see the module docstring), its generated files written under `out`."""
    films = _films(shared)
    items = _photos_and_maps(out) + _screenshots(films[:SCREENSHOTS], out)
    if len(films) >= SCREENSHOTS + GRID:
        items.append(Item("grid", _write(out / "grid" / "grid2x2.png", grid(films[SCREENSHOTS : SCREENSHOTS + GRID]))))
    return items + _photos_of_film(films[SCREENSHOTS + GRID :], out)
