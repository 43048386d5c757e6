"""The Zhang lab (Kermany et al. 2018) folder and file-name conventions.

Shared by the Mendeley release (`kermany`) and its Kaggle re-split
(`chest-xray-pneumonia`): `<split>/<CLASS>/<image>` trees, and three naming
schemes that carry the patient (and, for pneumonia, the cause):
  v2 / Kaggle  IM-0115-0001, IM-0011-0001-0002, NORMAL2-IM-1427-0001, NORMAL2-IM-0173-0001-0002,
               person1_bacteria_1, person1_virus_6, person447_virus_921_1
  v3 chest     NORMAL-28501-0001, BACTERIA-213622-0001, VIRUS-3637528-0002
  OCT          CNV-1016042-1, DME-1072015-1, DRUSEN-1001666-1, NORMAL-1017237-1

Evidence from the full Kaggle listing (5856 files, checked 2026-12-03):
* `personN_bacteria_*` and `personN_virus_*` are two numberings, so the patient
  is (N, cause): in train, 808 numbers occur with both causes (of 1353
  bacteria and 1090 virus numbers: a patient with both causes 808 times is not
  plausible), and the authors' patient-level train/test split keeps every
  (N, cause) on one side (0 shared between train and test per cause) while 170
  numbers are shared across causes (107 test-virus / train-bacteria, 63 the
  other way), which a single numbering would not allow. Serials (the last
  number) also run separately per cause.
* `IM-NNNN-SSSS-IIII` (a study and image number after the patient) and the
  `NORMAL2-` series: 144 names such as IM-0011-0001-0001 and person447_virus_921_1
  were dropped before; five patients lost all their images. `NORMAL2-IM-N` is
  its own numbering (IM-0640 and NORMAL2-IM-0640 both exist in train).
* Ids are not namespaced by train/test: every number above is one numbering
  across the archive's splits (0 IM ids and 0 (N, cause) shared between train
  and test), and the Kermany v2 OCT archive uses the same ids in train and test
  (CNV-1016042-1 in both), so one id is one patient wherever it is. Treating
  equal ids as one patient can only merge, never split, so the split stays sound.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

from covidxray.records import Dropped, Record
from covidxray.sources.descriptors import Descriptor
from covidxray.sources.layout import list_images, subdirs

SPLITS = ("train", "val", "test")
CHEST_CLASSES = ("NORMAL", "PNEUMONIA")
OCT_CLASSES = ("CNV", "DME", "DRUSEN", "NORMAL")
PNEUMONIA_CAUSES = ("bacteria", "virus")

_CLASS_FIRST = re.compile(r"^(NORMAL|BACTERIA|VIRUS|CNV|DME|DRUSEN)-(\d+)-(\d+)$", re.I)
_PERSON = re.compile(r"^person(\d+)_(bacteria|virus)_\d+(_\d+)?$", re.I)
_IM = re.compile(r"^(NORMAL\d*-)?IM-(\d+)(-\d+){1,2}$", re.I)


def parse_name(stem: str) -> tuple[str, str] | None:
    """(patient, token) of a file name stem, or None when it follows no known scheme.

    The token is the class or cause the name states ('bacteria', 'virus',
    'normal', 'cnv', ...) or '' when the name states none (IM-… names).
    """
    if match := _CLASS_FIRST.match(stem):
        token = match[1].lower()
        return match[2], {"bacteria": "bacteria", "virus": "virus"}.get(token, token)
    if match := _PERSON.match(stem):
        return f"person{int(match[1])}_{match[2].lower()}", match[2].lower()
    if match := _IM.match(stem):
        return f"{(match[1] or '').upper()}IM-{match[2]}", ""
    return None


def name_agrees_with_folder(token: str, folder: str) -> bool:
    folder = folder.lower()
    return token in ("", folder) or (folder == "pneumonia" and token in PNEUMONIA_CAUSES)


def is_split_tree(folder: Path, classes: tuple[str, ...]) -> bool:
    """`folder/<split>/<one of classes>` exists for some split."""
    return any((folder / split / cls).is_dir() for split in SPLITS for cls in classes)


def records(
    record: Callable[..., Record], root: Path, descriptor: Descriptor, part: str = "", view: str = "frontal"
) -> Iterator[Record | Dropped]:
    """Walk `root/<split>/<CLASS>/`; `part` ('chest', 'oct' or '') prefixes label keys and patient ids.

    `record` is the adapter's `Source.record`, which stamps its source and namespaces the patient.
    """
    prefix = f"{part}/" if part else ""
    for item in list_images(root):
        yield item if isinstance(item, Dropped) else Dropped("image outside a split/class folder", str(item))
    for split_dir in subdirs(root):
        split = split_dir.name.lower()
        if split not in SPLITS:
            yield Dropped(f"folder {split_dir.name!r} is not a split (train/val/test), ignored", str(split_dir))
            continue
        for item in list_images(split_dir):
            yield item if isinstance(item, Dropped) else Dropped("image outside a class folder", str(item))
        for class_dir in subdirs(split_dir):
            known_class = descriptor.label_for(prefix + class_dir.name) is not None
            for item in list_images(class_dir):
                if isinstance(item, Dropped) or not known_class:
                    yield (
                        item
                        if isinstance(item, Dropped)
                        else Dropped(f"unknown class folder {class_dir.name!r}", str(item))
                    )
                    continue
                parsed = parse_name(item.stem)
                if parsed is None:
                    yield Dropped("file name carries no patient id", str(item))
                    continue
                patient, token = parsed
                if not name_agrees_with_folder(token, class_dir.name):
                    yield Dropped("file name and class folder disagree", str(item), f"{token} in {class_dir.name}")
                    continue
                finding = f"{prefix}{class_dir.name}" + (f"/{token}" if token else "")
                label = descriptor.label_for(finding)
                if label is None:  # a token the map cannot place under its known folder (e.g. a comma list)
                    yield Dropped("unknown finding", str(item), finding)
                    continue
                yield record(item, label, f"{prefix.replace('/', ':')}{patient}", view=view, original_split=split)
