"""Inputs for scripts/arm64_check.sh's predict steps: one held-out phantom PNG from a prepared data set,
and the same pixels as a JPEG 2000 lossless DICOM (so the check also decodes through pylibjpeg-openjpeg).

    python scripts/arm64_inputs.py DATA_DIR OUT_DIR   -> OUT_DIR/phantom.png, OUT_DIR/phantom-j2k.dcm
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import cv2
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, generate_uid

from covidxray.data.prepare import SPLIT_TABLE


def main(data_dir: Path, out_dir: Path) -> None:
    with open(data_dir / SPLIT_TABLE, newline="") as handle:
        image = Path(next(row["image"] for row in csv.DictReader(handle) if row["split"] == "test"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(image, out_dir / "phantom.png")
    pixels = cv2.imread(str(image), cv2.IMREAD_GRAYSCALE)

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PatientID = "DX", "PHANTOM"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = pixels.tobytes()
    ds.compress(JPEG2000Lossless, encoding_plugin="pylibjpeg")
    ds.save_as(out_dir / "phantom-j2k.dcm", enforce_file_format=True)
    print(f"{out_dir / 'phantom.png'} and {out_dir / 'phantom-j2k.dcm'} from {image}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
