"""Tiny copies of each public collection in its real on-disk layout (see docs/datasets.md).

Every builder writes small but genuine images (decodable, distinct, smooth
enough that perceptual hashes behave as on radiographs) under the exact
folder and file names the real archives use, including their warts, and
returns what an adapter must make of them, declared row by row beside the
fixture itself.
"""

from __future__ import annotations

import csv
import io
import tarfile
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

IEEE_NEW_HEADER = (
    "patientid,offset,sex,age,finding,RT_PCR_positive,survival,intubated,intubation_present,went_icu,in_icu,"
    "needed_supplemental_O2,extubated,temperature,pO2_saturation,leukocyte_count,neutrophil_count,lymphocyte_count,"
    "view,modality,date,location,folder,filename,doi,url,license,clinical_notes,other_notes,"
)
IEEE_OLD_HEADER = "Patientid,offset,sex,age,finding,survival,view,date,location,filename,doi, url,license,notes"


def xray(seed: int, size: int = 96) -> np.ndarray:
    """A smooth random gray picture: distinct per seed, stable under re-encoding like a radiograph.

    A 10 x 10 grid blown up: blobs about 10 px across at 96 px, smooth enough at the 9 px scale to
    pass the radiograph gate (a 16 x 16 grid is refused as `busy-texture`)."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (10, 10)).astype(np.float32)
    image = cv2.resize(coarse, (size, size), interpolation=cv2.INTER_CUBIC)
    image += rng.normal(0, 2, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def seed_of(name: str) -> int:
    """Same file name -> same picture, as in collections that copy each other."""
    return zlib.crc32(name.encode())


def write_image(path: Path, seed: int | None = None, size: int = 96) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ok, data = cv2.imencode(path.suffix, xray(seed_of(path.name) if seed is None else seed, size))
    assert ok, path
    path.write_bytes(data.tobytes())
    return path


def write_bad(path: Path, kind: str) -> Path:
    """kind: 'corrupt' (not an image), 'truncated' (half a JPEG/PNG) or 'empty' (zero bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "corrupt":
        path.write_bytes(b"this is not an image at all" * 20)
    elif kind == "truncated":
        full = write_image(path).read_bytes()
        path.write_bytes(full[: len(full) // 3])
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise ValueError(kind)
    return path


def write_junk(folder: Path) -> None:
    """What macOS leaves behind."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + b"\x00" * 40)


@dataclass
class Layout:
    root: Path  # folder a user would pass with --from
    labels: dict[str, str] = field(default_factory=dict)  # image file name -> harmonised label the adapter must give
    patients: dict[str, str] = field(default_factory=dict)  # image file name -> patient id the adapter must give
    dropped: Counter = field(default_factory=Counter)  # reason -> count the adapter must report
    bad_images: dict[str, str] = field(default_factory=dict)  # file name -> decode failure reason at prepare time


def prepare_config(data_dir: Path, sources: dict, **data):
    """A small, quick DataConfig for `sources` (32 px, 4 images a shard, one worker, a quarter each to val and test)."""
    from covidxray.config import load_config

    values = {
        "sources": sources,
        "data_dir": str(data_dir),
        "image_size": 32,
        "records_per_shard": 4,
        "workers": 1,
        "val_fraction": 0.25,
        "test_fraction": 0.25,
        **data,
    }
    return load_config(None, [{"data": values}]).data


# ---------------------------------------------------------------- ieee8023


def _ieee_row(header: list[str], **values: str) -> list[str]:
    names = [h.strip().lower() for h in header]
    return [values.get(name, "") for name in names]


def build_ieee8023(base: Path, header: str = "new") -> Layout:
    """covid-chestxray-dataset-master/{metadata.csv, images/, volumes/} with the real header generations."""
    root = base / "covid-chestxray-dataset-master"
    images = root / "images"
    layout = Layout(root)
    new = header == "new"
    columns = (IEEE_NEW_HEADER if new else IEEE_OLD_HEADER).split(",")
    rows = []

    def row(
        patient,
        finding,
        view,
        filename,
        *,
        expect=None,
        drop=None,
        modality="X-ray",
        folder="images",
        bad=None,
        write=True,
        **extra,
    ):
        values = {"patientid": patient, "finding": finding, "view": view, "filename": filename, **extra}
        if new:
            values.update(modality=modality, folder=folder)
        rows.append(_ieee_row(columns, **values))
        if write and folder == "images":
            write_bad(images / filename, bad) if bad else write_image(images / filename)
        if expect:
            layout.labels[filename] = expect
            layout.patients[filename] = f"covid-chestxray:{patient}"
        if bad:
            layout.bad_images[filename] = bad
        if drop:
            layout.dropped[drop] += 1

    notes = 'Bilateral ground-glass opacities, "peripheral".\nSecond line of notes.'
    row(
        "1",
        "Pneumonia/Viral/COVID-19" if new else "COVID-19",
        "PA",
        "covid-1-PA.jpeg",
        expect="covid-19",
        offset="-23",
        sex="F",
        age="70",
        **({"clinical_notes": notes} if new else {"notes": notes}),
    )
    row("1", "Pneumonia/Viral/COVID-19" if new else "COVID-19", "AP", "covid-1-day3.png", expect="covid-19", offset="3")
    row(
        "2",
        "Pneumonia/Viral/COVID-19" if new else "COVID-19, ARDS",
        "AP Supine",
        "F051E018-DAD1-4506-AD43-BE4CA29E960B.jpeg",
        expect="covid-19",
    )
    row(
        "2", "Pneumonia/Viral/COVID-19" if new else "COVID-19", "L", "covid-2-lateral.jpg", drop="view L is not frontal"
    )
    row("4", "No Finding", "PA", "2c35005f.jpg", expect="normal", location="Hannover Medical School, Hannover, Germany")
    row(
        "5",
        "Pneumonia/Bacterial/Streptococcus" if new else "Streptococcus",
        "PA",
        "streptococcus-pneumoniae-1.JPG",
        expect="pneumonia/bacterial",
    )
    row(
        "6",
        "Pneumonia/Viral/SARS" if new else "SARS",
        "AP",
        "SARS-10.1148rg.242035193-g04mr34g0-Fig8a-day0.jpeg",
        expect="pneumonia/viral",
    )
    row(
        "7",
        "Pneumonia/Fungal/Pneumocystis" if new else "Pneumocystis",
        "PA",
        "pneumocystis-1.png",
        expect="pneumonia/fungal",
    )
    row("8", "todo", "PA", "todo-1.jpg", drop="finding not labelled yet (todo/Unknown)")
    row("9", "Unknown", "PA", "unknown-1.jpg", drop="finding not labelled yet (todo/Unknown)")
    row(
        "10",
        "ARDS",
        "PA",
        "ARDSSevere.png",
        drop="finding 'ARDS' excluded: ARDS alone is a syndrome (sepsis, trauma, bites...), not a pneumonia",
    )
    row("17", "Atelectasis", "PA", "atelectasis-1.jpg", drop="unknown finding 'Atelectasis'")
    row(
        "18",
        "todo",
        "",
        "no-view-1.jpg",
        drop="view unknown (blank, '?' or no view column); source option unknown_view: keep takes it as frontal",
    )
    row(
        "11",
        "Pneumonia/Viral/COVID-19" if new else "COVID-19",
        "PA",
        "listed-but-missing.jpeg",
        write=False,
        drop="image file listed in metadata.csv is missing",
    )
    row(
        "12",
        "Pneumonia/Viral/COVID-19" if new else "COVID-19",
        "PA",
        "corrupt-upload.jpeg",
        expect="covid-19",
        bad="corrupt",
    )
    row("13", "Pneumonia", "PA", "16745_2_1.PNG", expect="pneumonia")
    if new:
        row("3", "Pneumonia/Viral/COVID-19", "Axial", "ct-slice-1.jpg", modality="CT", drop="modality CT is not X-ray")
        row(
            "3",
            "Pneumonia/Viral/COVID-19",
            "Axial",
            "radiopaedia_org_covid-19-pneumonia-14_85914_0-dcm.nii.gz",
            modality="CT",
            folder="volumes",
            write=False,
            drop="CT volume (volumes/), not a radiograph",
        )
        row("14", "Pneumonia/Viral/Herpes ", "APS", "herpes-1.jpeg", expect="pneumonia/viral")
        row("15", "No Finding", "AP semi erect", "hannover-ap-semi-erect.jpg", expect="normal")
        row(
            "16",
            "Pneumonia/Viral/COVID-19",
            "Coronal",
            "ct-coronal.jpg",
            modality="CT",
            drop="modality CT is not X-ray",
        )
    else:
        row("3", "COVID-19", "Axial", "ct-slice-1.jpg", drop="view Axial is not frontal")
        row("19", "Mycoplasma Bacterial Pneumonia", "PA", "000001.jpg", expect="pneumonia/bacterial")
        row("20", "Lipoid", "PA", "000001-17.jpg", expect="pneumonia/other")

    root.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)  # the new header's trailing comma is an empty last column name
    writer.writerows(rows)
    (root / "metadata.csv").write_text(buffer.getvalue())
    (root / "volumes").mkdir(exist_ok=True)
    (root / "volumes" / "DOWNLOAD.md").write_text(
        "CT volumes: academictorrents 136ffddd0959108becb2b3a86630bec049fcb0ff\n"
    )
    (root / "README.md").write_text("# COVID-19 image data collection\n")
    return layout


# ------------------------------------------------- Zhang lab (Kaggle + Mendeley)

# (split, class folder, file name, harmonised label, patient) -- Kaggle names and Kaggle's val folder
KAGGLE_FILES = [
    ("train", "NORMAL", "IM-0115-0001.jpeg", "normal", "IM-0115"),
    ("train", "NORMAL", "IM-0115-0002.jpeg", "normal", "IM-0115"),
    ("train", "NORMAL", "IM-0117-0001.jpeg", "normal", "IM-0117"),
    ("train", "NORMAL", "NORMAL2-IM-1427-0001.jpeg", "normal", "NORMAL2-IM-1427"),
    ("train", "NORMAL", "NORMAL2-IM-0115-0001.jpeg", "normal", "NORMAL2-IM-0115"),
    ("train", "NORMAL", "IM-0640-0001-0001.jpeg", "normal", "IM-0640"),  # study-image suffixes (real names)
    ("train", "NORMAL", "IM-0640-0001-0002.jpeg", "normal", "IM-0640"),
    ("train", "NORMAL", "NORMAL2-IM-0983-0001-0002.jpeg", "normal", "NORMAL2-IM-0983"),
    ("train", "PNEUMONIA", "person1_bacteria_1.jpeg", "pneumonia/bacterial", "person1_bacteria"),
    ("train", "PNEUMONIA", "person1_virus_6.jpeg", "pneumonia/viral", "person1_virus"),  # another numbering
    ("train", "PNEUMONIA", "person2_bacteria_3.jpeg", "pneumonia/bacterial", "person2_bacteria"),
    ("train", "PNEUMONIA", "person3_virus_7.jpeg", "pneumonia/viral", "person3_virus"),
    ("train", "PNEUMONIA", "person63_bacteria_306.jpeg", "pneumonia/bacterial", "person63_bacteria"),
    ("train", "PNEUMONIA", "person447_virus_921.jpeg", "pneumonia/viral", "person447_virus"),
    ("train", "PNEUMONIA", "person447_virus_921_1.jpeg", "pneumonia/viral", "person447_virus"),
    ("val", "NORMAL", "NORMAL2-IM-1430-0001.jpeg", "normal", "NORMAL2-IM-1430"),
    ("val", "PNEUMONIA", "person1946_bacteria_4874.jpeg", "pneumonia/bacterial", "person1946_bacteria"),
    ("test", "NORMAL", "IM-0001-0001.jpeg", "normal", "IM-0001"),
    ("test", "NORMAL", "IM-0003-0001.jpeg", "normal", "IM-0003"),
    ("test", "NORMAL", "IM-0011-0001-0001.jpeg", "normal", "IM-0011"),
    ("test", "NORMAL", "NORMAL2-IM-0173-0001-0002.jpeg", "normal", "NORMAL2-IM-0173"),
    (
        "test",
        "PNEUMONIA",
        "person1_virus_8.jpeg",
        "pneumonia/viral",
        "person1_virus",
    ),  # the train patient: one numbering
    ("test", "PNEUMONIA", "person100_bacteria_478.jpeg", "pneumonia/bacterial", "person100_bacteria"),
]


def _zhang_id(source: str, split: str, patient: str, part: str = "") -> str:
    return f"{source}:{part + ':' if part else ''}{patient}"  # one id is one patient in every split of the archive


def build_kaggle(base: Path, bad: bool = False) -> Layout:
    """chest_xray/{train,val,test}/{NORMAL,PNEUMONIA}, plus the nested duplicate copy, __MACOSX and .DS_Store."""
    root = base / "chest_xray"
    layout = Layout(root)
    for split, cls, name, label, patient in KAGGLE_FILES:
        write_image(root / split / cls / name)
        write_image(root / "chest_xray" / split / cls / name)  # the duplicate copy the archive carries
        (root / "__MACOSX" / split / cls).mkdir(parents=True, exist_ok=True)
        (root / "__MACOSX" / split / cls / f"._{name}").write_bytes(b"\x00\x05\x16\x07AppleDouble")
        layout.labels[name] = label
        layout.patients[name] = _zhang_id("chest-xray-pneumonia", split, patient)
    for folder in (root, root / "train", root / "test" / "NORMAL"):
        write_junk(folder)
    layout.dropped["hidden or macOS metadata file, not an image"] += 3
    layout.dropped["folder 'chest_xray' is not a split (train/val/test), ignored"] += 1
    write_image(root / "test" / "NORMAL" / "scan_final.jpeg")
    layout.dropped["file name carries no patient id"] += 1
    write_image(root / "train" / "NORMAL" / "person9_bacteria_40.jpeg")
    layout.dropped["file name and class folder disagree"] += 1
    (root / "train" / "PNEUMONIA" / "notes.txt").write_text("not an image")
    layout.dropped["not an image file"] += 1
    if bad:
        for split, cls, name, kind, patient in (
            ("train", "NORMAL", "IM-0300-0001.jpeg", "corrupt", "IM-0300"),
            ("train", "PNEUMONIA", "person7_bacteria_30.jpeg", "truncated", "person7"),
            ("test", "NORMAL", "IM-0200-0001.jpeg", "empty", "IM-0200"),
        ):
            write_bad(root / split / cls / name, kind)
            layout.bad_images[name] = kind
            layout.labels[name] = "pneumonia/bacterial" if cls == "PNEUMONIA" else "normal"
            layout.patients[name] = _zhang_id("chest-xray-pneumonia", split, patient)
    return layout


def build_mendeley_v2(base: Path) -> tuple[Layout, Layout]:
    """ChestXRay2017.zip content (chest_xray/{train,test}: Kaggle's images with val put back into train)
    and OCT2017.tar.gz content (OCT2017/{train,test}/{CNV,DME,DRUSEN,NORMAL})."""
    chest = Layout(base / "ChestXRay2017")
    for split, cls, name, label, patient in KAGGLE_FILES:
        split = "train" if split == "val" else split
        write_image(chest.root / "chest_xray" / split / cls / name)
        chest.labels[name] = label
        chest.patients[name] = _zhang_id("kermany", split, patient, "chest")
    (chest.root / "__MACOSX" / "chest_xray").mkdir(parents=True)
    (chest.root / "__MACOSX" / "chest_xray" / "._train").write_bytes(b"\x00\x05\x16\x07")
    write_junk(chest.root / "chest_xray" / "test")
    chest.dropped["hidden or macOS metadata file, not an image"] += 1
    oct_ = Layout(base / "OCT2017-unpacked")
    for split in ("train", "test"):
        for cls, patient in (("CNV", "1016042"), ("DME", "1072015"), ("DRUSEN", "1001666"), ("NORMAL", "1017237")):
            for n in (1, 2):
                name = f"{cls}-{patient}-{n + (2 if split == 'test' else 0)}.jpeg"  # v2 uses one patient id in train and test
                write_image(oct_.root / "OCT2017" / split / cls / name)
                oct_.labels[name] = f"oct/{cls.lower()}"
                oct_.patients[name] = _zhang_id("kermany", split, patient, "oct")
    return chest, oct_


def build_mendeley_v3(base: Path) -> tuple[Layout, Layout]:
    """ZhangLabData.zip content: CellData/chest_xray and CellData/OCT, chest files renamed <CLASS>-<patient>-<n>."""
    root = base / "ZhangLabData"
    chest, oct_ = Layout(root), Layout(root)
    for split, cls, name, label, patient in (
        ("train", "NORMAL", "NORMAL-28501-0001.jpeg", "normal", "28501"),
        ("train", "NORMAL", "NORMAL-28501-0002.jpeg", "normal", "28501"),
        ("train", "PNEUMONIA", "BACTERIA-213622-0001.jpeg", "pneumonia/bacterial", "213622"),
        ("train", "PNEUMONIA", "VIRUS-3637528-0002.jpeg", "pneumonia/viral", "3637528"),
        ("test", "NORMAL", "NORMAL-4512-0001.jpeg", "normal", "4512"),
        ("test", "PNEUMONIA", "BACTERIA-7761-0001.jpeg", "pneumonia/bacterial", "7761"),
        ("test", "PNEUMONIA", "VIRUS-9913-0003.jpeg", "pneumonia/viral", "9913"),
    ):
        write_image(root / "CellData" / "chest_xray" / split / cls / name)
        chest.labels[name] = label
        chest.patients[name] = _zhang_id("kermany", split, patient, "chest")
    write_image(root / "CellData" / "chest_xray" / "train" / "NORMAL" / "BACTERIA-5-0001.jpeg")
    chest.dropped["file name and class folder disagree"] += 1
    for split, first_digit in (("train", "8"), ("test", "9")):
        for i, cls in enumerate(("CNV", "DME", "DRUSEN", "NORMAL")):
            patient = f"{first_digit}10{i}"
            name = f"{cls}-{patient}-1.jpeg"
            write_image(root / "CellData" / "OCT" / split / cls / name)
            oct_.labels[name] = f"oct/{cls.lower()}"
            oct_.patients[name] = _zhang_id("kermany", split, patient, "oct")
    write_junk(root / "CellData" / "OCT" / "train")
    oct_.dropped["hidden or macOS metadata file, not an image"] += 1
    return chest, oct_


# ---------------------------------------------------------------- talo


def build_talo(base: Path, covid_copies: dict[str, Path] | None = None) -> Layout:
    """COVID-19-master/X-Ray Image DataSet/{Covid-19,No_findings,Pneumonia}.

    `covid_copies` maps a Covid-19 file name to an ieee8023 image whose bytes
    it copies (as the real collection did), making a cross-source duplicate.
    """
    root = base / "COVID-19-master"
    data = root / "X-Ray Image DataSet"
    layout = Layout(root)
    for name, patient in (
        # ieee8023 file names get ieee8023's patientid (its metadata.csv, Aug 2020); unknown names group by case
        ("1-s2.0-S0929664620300449-gr2_lrg-a.jpg", "covid-chestxray:19"),
        ("1-s2.0-S0929664620300449-gr2_lrg-b.jpg", "covid-chestxray:19"),
        ("nejmc2001573_f1a.jpeg", "covid-chestxray:4"),
        ("01E392EE-69F9-4E33-BFCE-E5C968654078.jpeg", "covid-chestxray:46"),
        ("covid-19-pneumonia-24-day6.jpg", "covid-chestxray:116"),
        ("covid-19-case-report-7-day3.jpg", "covid19-talo:case:covid-19-case-report-7"),
        ("covid-19-case-report-7-day9.jpg", "covid19-talo:case:covid-19-case-report-7"),
    ):
        write_image(data / "Covid-19" / name)
        layout.labels[name], layout.patients[name] = "covid-19", patient
    for name, source in (covid_copies or {}).items():
        (data / "Covid-19" / name).write_bytes(source.read_bytes())
        layout.labels[name], layout.patients[name] = "covid-19", f"covid19-talo:case:{Path(name).stem}"
    for folder, label, names in (
        ("No_findings", "normal", ("00001280_004.png", "00001280_005.png", "00001281_000.png", "00001299_000.png")),
        ("Pneumonia", "pneumonia", ("00000061_012.png", "00000061_015.png", "00000165_001.png", "00000211_013.png")),
    ):
        for name in names:
            write_image(data / folder / name)
            layout.labels[name], layout.patients[name] = label, f"covid19-talo:nih:{name[:8]}"
    (root / "README.md").write_text("# COVID-19\n")
    (root / "DarkCovidNet.ipynb").write_text("{}")
    write_junk(data / "No_findings")
    layout.dropped["hidden or macOS metadata file, not an image"] += 1
    return layout


# ---------------------------------------------------------------- archives


def zip_tree(folder: Path, archive: Path, prefix: str = "") -> Path:
    """Zip `folder`'s content (names under `prefix/`), as GitHub and Kaggle archives are laid out."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        for path in sorted(folder.rglob("*")):
            name = str(Path(prefix) / path.relative_to(folder)) if prefix else str(path.relative_to(folder))
            bundle.write(path, name)
    return archive


def tar_tree(folder: Path, archive: Path) -> Path:
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as bundle:
        for path in sorted(folder.iterdir()):
            bundle.add(path, path.name)
    return archive


# ---------------------------------------------------------------- a local HTTP server


class FileServer:
    """Serves `files` (URL path -> bytes) on 127.0.0.1 with HTTP Range support and scripted failures.

    `drop_after[path] = n`: the next response for `path` announces the full
    length but the connection dies after n bytes (once). `errors[path] =
    [503, ...]`: statuses answered before serving normally. Every request's
    (path, Range header) is recorded in `requests`. `password = "user:secret"`
    answers 401 to a request without those HTTP Basic credentials.
    """

    def __init__(self, files: dict[str, bytes]):
        import http.server
        import threading

        self.files = dict(files)
        self.drop_after: dict[str, int] = {}
        self.errors: dict[str, list[int]] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.password: str | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Range")))
                if server.password is not None:
                    import base64

                    expected = "Basic " + base64.b64encode(server.password.encode()).decode()
                    if self.headers.get("Authorization") != expected:
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="mirror"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                if server.errors.get(self.path):
                    self.send_error(server.errors[self.path].pop(0))
                    return
                if self.path not in server.files:
                    self.send_error(404)
                    return
                body = server.files[self.path]
                start = 0
                ranged = self.headers.get("Range", "")
                if ranged.startswith("bytes="):
                    start = int(ranged[6:].split("-")[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                cut = server.drop_after.pop(self.path, None)
                self.wfile.write(body[start:] if cut is None else body[start : start + cut])
                if cut is not None:
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
