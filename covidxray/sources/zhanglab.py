"""The Zhang lab (Kermany et al. 2018) folder and file-name conventions.

Shared by the Mendeley release (`kermany`) and its Kaggle re-split
(`chest-xray-pneumonia`): `<split>/<CLASS>/<image>` trees, and three naming
schemes that carry the patient (and, for pneumonia, the cause):
  v2 / Kaggle  IM-0115-0001, NORMAL2-IM-1427-0001, person1_bacteria_1, person1_virus_6
  v3 chest     NORMAL-28501-0001, BACTERIA-213622-0001, VIRUS-3637528-0002
  OCT          CNV-1016042-1, DME-1072015-1, DRUSEN-1001666-1, NORMAL-1017237-1
Patient ids are namespaced by original split group (train+val vs test)
because the test set is numbered on its own; the authors split by patient,
so this can never join two real patients' images across groups.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from covidxray.sources.base import Dropped, Record
from covidxray.sources.descriptors import Descriptor
from covidxray.sources.layout import list_images, subdirs

SPLITS = ("train", "val", "test")
CHEST_CLASSES = ("NORMAL", "PNEUMONIA")
OCT_CLASSES = ("CNV", "DME", "DRUSEN", "NORMAL")
PNEUMONIA_CAUSES = ("bacteria", "virus")

_CLASS_FIRST = re.compile(r"^(NORMAL|BACTERIA|VIRUS|CNV|DME|DRUSEN)-(\d+)-(\d+)$", re.I)
_PERSON = re.compile(r"^person(\d+)_(bacteria|virus)_\d+$", re.I)
_IM = re.compile(r"^(NORMAL\d*-)?IM-(\d+)-\d+$", re.I)


def parse_name(stem: str) -> tuple[str, str] | None:
    """(patient, token) of a file name stem, or None when it follows no known scheme.

    The token is the class or cause the name states ('bacteria', 'virus',
    'normal', 'cnv', ...) or '' when the name states none (IM-… names).
    """
    if match := _CLASS_FIRST.match(stem):
        token = match[1].lower()
        return match[2], {"bacteria": "bacteria", "virus": "virus"}.get(token, token)
    if match := _PERSON.match(stem):
        return f"person{int(match[1])}", match[2].lower()
    if match := _IM.match(stem):
        return f"{(match[1] or '').upper()}IM-{match[2]}", ""
    return None


def name_agrees_with_folder(token: str, folder: str) -> bool:
    folder = folder.lower()
    return token in ("", folder) or (folder == "pneumonia" and token in PNEUMONIA_CAUSES)


def is_split_tree(folder: Path, classes: tuple[str, ...]) -> bool:
    """`folder/<split>/<one of classes>` exists for some split."""
    return any((folder / split / cls).is_dir() for split in SPLITS for cls in classes)


def records(source: str, root: Path, descriptor: Descriptor, part: str = "", view: str = "frontal") -> Iterator[Record | Dropped]:
    """Walk `root/<split>/<CLASS>/`; `part` ('chest', 'oct' or '') prefixes label keys and patient ids."""
    prefix = f"{part}/" if part else ""
    for item in list_images(root):
        yield item if isinstance(item, Dropped) else Dropped("image outside a split/class folder", str(item))
    for split_dir in subdirs(root):
        split = split_dir.name.lower()
        if split not in SPLITS:
            yield Dropped(f"folder {split_dir.name!r} is not a split (train/val/test), ignored", str(split_dir))
            continue
        group = "test" if split == "test" else "trainval"
        for item in list_images(split_dir):
            yield item if isinstance(item, Dropped) else Dropped("image outside a class folder", str(item))
        for class_dir in subdirs(split_dir):
            known_class = descriptor.label_for(prefix + class_dir.name) is not None
            for item in list_images(class_dir):
                if isinstance(item, Dropped) or not known_class:
                    yield item if isinstance(item, Dropped) else Dropped(f"unknown class folder {class_dir.name!r}", str(item))
                    continue
                parsed = parse_name(item.stem)
                if parsed is None:
                    yield Dropped("file name carries no patient id", str(item))
                    continue
                patient, token = parsed
                if not name_agrees_with_folder(token, class_dir.name):
                    yield Dropped("file name and class folder disagree", str(item), f"{token} in {class_dir.name}")
                    continue
                label = descriptor.label_for(f"{prefix}{class_dir.name}" + (f"/{token}" if token else ""))
                patient_id = f"{source}:{prefix.replace('/', ':')}{group}:{patient}"
                yield Record(image=item, label=label, patient_id=patient_id, source=source, view=view, original_split=split)
