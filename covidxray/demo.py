"""`covidxray demo`: the whole product on the embedded phantom data set, in one command, ending with its report."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

from covidxray.config import Config, load_config


def demo_config(workdir: Path, epochs: int) -> Config:
    return load_config(
        None,
        [
            {
                "data": {
                    "sources": {"synthetic": {"patients": 600}},
                    "data_dir": str(workdir / "data"),
                    "image_size": 64,
                    "records_per_shard": 64,
                },
                "train": {"run_dir": str(workdir / "run"), "epochs": epochs, "batch_size": 32},
                "export": {"formats": ["float32"]},
            }
        ],
    )


def run_demo(workdir: Path, epochs: int, say: Callable[[str], None] = print) -> dict:
    from covidxray.cli_progress import progress_bar
    from covidxray.data.prepare import prepare
    from covidxray.edge.predict import predict_files
    from covidxray.export.tflite import export
    from covidxray.manifest import SPLIT_TABLE
    from covidxray.report.build import build_report
    from covidxray.run_folder import tflite_name
    from covidxray.train.evaluate import evaluate
    from covidxray.train.trainer import train

    config = demo_config(workdir, epochs)
    say(f"[bold]1/6 prepare[/]: phantom chest X-rays -> {config.data.data_dir}")
    with progress_bar("preparing") as advance:
        manifest = prepare(config.data, progress=advance)
    say(f"[bold]2/6 train[/]: {config.train.model}, {epochs} epochs -> {config.train.run_dir}")
    train(config, say=say)
    say("[bold]3/6 evaluate[/]: the test split, thresholds chosen on val")
    evaluate(config, say=say)
    say("[bold]4/6 export[/]: TFLite float32, checked against Keras on the test split")
    report = export(config, say=say)
    say("[bold]5/6 predict[/]: one held-out image per class, LiteRT interpreter")
    with open(Path(config.data.data_dir) / SPLIT_TABLE, newline="") as handle:
        test_rows = [row for row in csv.DictReader(handle) if row["split"] == "test"]
    examples = {row["class"]: Path(row["image"]) for row in reversed(test_rows)}
    model_path = Path(config.train.run_dir) / tflite_name("float32")
    for truth, result in zip(examples, predict_files(list(examples.values()), model_path)):
        answer = (
            f"predicted {result['label']} ({result['confidence']:.2f})"
            if "label" in result
            else f"no class: {result.get('rejected') or result['error']} ({result['reason']})"
        )
        say(f"  {result['file']}: true {truth}, {answer}")
    accuracy = report["float32"]["accuracy"]
    test = manifest.splits["test"]
    chance = max(test.classes.values()) / test.records
    say(f"test accuracy {accuracy:.1%} (majority-class baseline {chance:.1%}); model: {model_path}")
    say("[bold]6/6 report[/]: the run's model card as one HTML page")
    page = build_report(Path(config.train.run_dir), Path(config.data.data_dir), say=say)
    say(f"report: {page}")
    return report
