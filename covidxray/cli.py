"""Command line: thin wrappers that resolve config and call the library.

User mistakes (bad config, missing files, unusable images) print one clear
message and exit non-zero; tracebacks are kept for real bugs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from covidxray.config import Config, load_config, parse_override
from covidxray.data.labels import TASKS
from covidxray.errors import UserError
from covidxray.export.formats import FORMATS
from covidxray.manifest import Manifest
from covidxray.registry import Registry
from covidxray.run_folder import DEFAULT_FORMAT
from covidxray.train.models import MODEL_REGISTRY
from covidxray.train.weights import IMAGENET_WEIGHTS, PACKAGED_WEIGHTS
from covidxray.train_stack import missing_train_stack, require_train_stack

if TYPE_CHECKING:  # the edge predictor loads OpenCV, which predict imports only after limiting its decoder
    from covidxray.edge.predict import Predictor
    from covidxray.edge.preprocess import ImageError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter hides our messages

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    help="Chest X-ray classifiers: public data -> Horovod training -> LiteRT on the edge.",
)
console = Console(stderr=True, soft_wrap=True)  # long paths stay whole, also in logs

ConfigOption = typer.Option(None, "--config", "-c", help="YAML config (see configs/).")
SetOption = typer.Option(None, "--set", help="Override any config key, e.g. --set train.epochs=3 (repeatable).")


def resolve(config_path: Path | None, sets: list[str] | None, **flags: Any) -> Config:
    """Defaults -> YAML -> --set -> dedicated flags (the most specific wins)."""
    overrides = [parse_override(s) for s in sets or []]
    for dotted, value in flags.items():
        if value is not None:
            section, key = dotted.split("__")
            overrides.append({section: {key: value}})
    return load_config(config_path, overrides)


RESUMABLE = "finished work is kept; re-run the same command to resume"


def run(action: Callable[[], Any], interrupted: str = RESUMABLE) -> Any:
    """`action()`, with a user mistake or Ctrl-C turned into one message; `interrupted` says what an interrupt leaves."""
    try:
        return action()
    except UserError as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from None
    except ModuleNotFoundError as err:  # an edge install (no `train` extra) running a training command
        needed = missing_train_stack(err)
        if needed is None:
            raise
        console.print(f"[bold red]error:[/] {escape(str(needed))}")  # escape: the message names covidxray[train]
        raise typer.Exit(2) from None
    except PermissionError as err:  # a file or folder the user's system will not let us read or write
        console.print(
            f"[bold red]error:[/] permission denied: {escape(str(err.filename or err))}; check its permissions"
        )
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: {interrupted}")
        raise typer.Exit(130) from None


def parse_sources(
    specs: list[str], from_path: str | None = None, configured: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """`--source a --source b=PATH` -> {a: {...}, b: {..., from_path: PATH}}; `--from` goes with a single source.

    A source's options from the config file and --set (e.g. kermany's `part`) are kept; the path given
    here only adds `from_path`.
    """
    if from_path and len(specs) != 1:
        raise UserError("--from goes with exactly one --source; with several, write --source NAME=PATH for each")
    configured = configured or {}
    sources: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        name, path = name.strip(), path or from_path or ""
        if name in sources:
            raise UserError(
                f"--source {name} is given twice; a source is read from one place (to merge two copies, prepare them as one folder)"
            )
        sources[name] = {**configured.get(name, {}), **({"from_path": path} if path else {})}
    return sources


@app.command()
def prepare(
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
    source: list[str] | None = typer.Option(
        None,
        "--source",
        "-s",
        help="NAME or NAME=PATH (archive/folder on disk); repeatable. Names: `covidxray sources`.",
    ),
    from_path: str | None = typer.Option(
        None, "--from", help="Archive or folder on disk for the single --source given."
    ),
    data_dir: str | None = typer.Option(None, help="Output folder (shards + manifest.json)."),
    task: str | None = typer.Option(None, help=f"{', '.join(TASKS.names())} (see `covidxray tasks`)."),
    image_size: int | None = typer.Option(None),
    workers: int | None = typer.Option(None, help="Decode processes (default: one per core)."),
    hold_out_source: str | None = typer.Option(
        None, "--hold-out-source", help="Put this source (all of it) in test, the others in train/val."
    ),
):
    """Fetch sources, harmonise labels, dedupe, split by patient, write sharded TFRecords."""
    from covidxray.cli_progress import progress_bar

    def go():
        from covidxray.data.prepare import prepare as do_prepare

        require_train_stack()  # the shards are TFRecords: fail now, not after decoding every image

        cfg = resolve(
            config,
            sets,
            data__data_dir=data_dir,
            data__task=task,
            data__image_size=image_size,
            data__workers=workers,
            data__holdout_source=hold_out_source,
        )
        if source:
            cfg.data.sources = parse_sources(source, from_path, cfg.data.sources)
        elif from_path:
            raise UserError(
                "--from needs the --source it belongs to, e.g. --source covid19-talo --from ./COVID-19-master.zip"
            )

        with progress_bar("preparing") as advance:
            manifest = do_prepare(cfg.data, progress=advance, log=console.print)
        for split, info in manifest.splits.items():
            console.print(f"{split:5s} {info.records:6d} images {info.patients:6d} patients  {info.classes}")
        print_composition(manifest)
        for reason, count in manifest.dropped.items():
            console.print(f"[yellow]dropped[/] {count:6d}  {reason}")
        console.print(f"wrote {len(manifest.shards)} shards + manifest.json to {cfg.data.data_dir}")

    run(go)


def print_composition(manifest: Manifest) -> None:
    from rich.markup import escape

    from covidxray.data.composition import table_lines

    for line in table_lines(manifest):
        console.print(escape(line), highlight=False)
    for warning in manifest.composition_warnings:
        console.print(f"[yellow]shortcut risk[/]: {escape(warning)}", highlight=False)


@app.command()
def audit(
    data_dir: Path = typer.Argument(
        ...,
        help="A prepared data set, or a folder with one split per top-level folder (e.g. the Kaggle set's train/ and test/).",
    ),
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
    workers: int | None = typer.Option(None, help="Decode processes (default: one per core)."),
):
    """Find images and patients that are in two splits (exit status 1 when there are any)."""
    from covidxray.cli_progress import progress_bar

    def go():
        from covidxray.data.audit import audit as do_audit

        cfg = resolve(config, sets, data__workers=workers)
        with progress_bar("auditing") as advance:
            leaks = do_audit(data_dir, cfg.data, progress=advance, log=console.print)
        for leak in leaks:
            console.print(f"[red]leak[/] {leak.line()}", highlight=False)
        patients = sum(1 for leak in leaks if leak.kind == "patient")
        console.print(f"{len(leaks) - patients} copied image(s) and {patients} patient(s) across splits")
        return 1 if leaks else 0

    raise typer.Exit(run(go) or 0)


@app.command()
def train(
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
    data_dir: str | None = typer.Option(None),
    run_dir: str | None = typer.Option(None, help="Where checkpoints, model and logs go."),
    model: str | None = typer.Option(None, help=f"{', '.join(MODEL_REGISTRY.names())} (see `covidxray models`)."),
    epochs: int | None = typer.Option(None),
    batch_size: int | None = typer.Option(None, help="Per rank."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint in --run-dir."),
    force: bool = typer.Option(
        False,
        "--force",
        help="With --resume: continue although the data set or training settings differ from the run's.",
    ),
    elastic: bool | None = typer.Option(
        None,
        "--elastic",
        help="Elastic job (horovodrun --min-np/--max-np/--host-discovery-script): survives losing workers.",
    ),
):
    """Train (single process, or one rank under `horovodrun` / `mpirun`)."""
    cfg = run(
        lambda: resolve(
            config,
            sets,
            data__data_dir=data_dir,
            train__run_dir=run_dir,
            train__model=model,
            train__epochs=epochs,
            train__batch_size=batch_size,
            train__elastic=elastic,
        )
    )

    def go():
        from covidxray.train.trainer import train as do_train

        do_train(cfg, resume=resume, say=console.print, force=force)

    run(go)


@app.command()
def evaluate(
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
    run_dir: str | None = typer.Option(
        None, help="Run folder with model.keras (evaluation.json, roc.png, confusion.png go here)."
    ),
    data_dir: str | None = typer.Option(
        None, help="Prepared data: thresholds from its val split, metrics on its test split."
    ),
    external: list[str] | None = typer.Option(
        None,
        "--external",
        help="A data set prepared separately (any sources): every image of it is test, after copies of training "
        "images are dropped; reported beside the test split (repeatable).",
    ),
):
    """Test-split accuracy, per-class sensitivity/specificity/PPV, ROC AUC, confusion matrix; thresholds chosen on val."""
    from covidxray.cli_progress import progress_bar

    cfg = run(lambda: resolve(config, sets, data__data_dir=data_dir, train__run_dir=run_dir))

    def go():
        from covidxray.train.evaluate import evaluate as do_evaluate

        if not external:
            do_evaluate(cfg, say=console.print)
            return
        with progress_bar("checking the external images for copies of training images") as advance:
            do_evaluate(cfg, say=console.print, externals=list(external), progress=advance)

    run(go, "nothing was written (evaluation.json and the plots are written at the end); run evaluate again")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run folder (train, evaluate and export write into it)."),
    data_dir: Path | None = typer.Option(
        None, help="The prepared data the run used (default: data.data_dir of the run's config.yaml)."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/report.html)."),
):
    """One self-contained HTML page per run (a model card): data, training, evaluation, export, Grad-CAM, intended use."""

    def go():
        from covidxray.report.build import build_report

        require_train_stack()  # Grad-CAM runs the Keras model: fail now, on an edge install, with what to install
        print(build_report(run_dir, data_dir, out, say=console.print))

    run(go, "nothing was written (the page is written whole at the end); run report again")


@app.command()
def doctor(
    data_dir: Path | None = typer.Option(
        None,
        help="Also check these shards against their manifest's sha256s, and measure a training rank's peak memory on them.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout (to compare boards)."),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="The training config the memory check runs (model, batch, Horovod buffers); default: the built-in defaults.",
    ),
    memory_probe: bool = typer.Option(
        True,
        "--memory-probe/--no-memory-probe",
        help='With --data-dir: run a few training steps to measure peak memory ("fits this board").',
    ),
):
    """What this board has: versions, Horovod build (controllers, ops), mpirun, cores, memory, disk, shard integrity, fits this board."""
    from covidxray.doctor import diagnose, render

    report = run(lambda: diagnose(data_dir, config, memory_probe))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report, console)
    if not report["ok"]:
        raise typer.Exit(1)


@app.command("export")
def export_cmd(
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
    run_dir: str | None = typer.Option(None),
    data_dir: str | None = typer.Option(
        None, help="Prepared data (test split for parity, train for int8 calibration)."
    ),
    formats: list[str] | None = typer.Option(
        None,
        "--format",
        help=f"{', '.join(FORMATS.names())} (repeatable; default export.formats; see `covidxray formats`).",
    ),
    c_array: bool = typer.Option(
        False, "--c-array", help="Also export int8 and write it as model-int8.cc/.h for TensorFlow Lite Micro."
    ),
):
    """Write a SavedModel, convert it to TFLite and check each format against Keras on the test split."""
    cfg = run(lambda: resolve(config, sets, data__data_dir=data_dir, train__run_dir=run_dir))
    if formats:
        cfg.export.formats = list(formats)
    if c_array and "int8" not in cfg.export.formats:
        cfg.export.formats.append("int8")  # the C array is made from a freshly checked int8 model, never a stale file

    def go():
        from covidxray.export.tflite import export

        if c_array and cfg.export.int8_method == "mixed":
            raise UserError(
                "--c-array needs an integer-only int8 build for TensorFlow Lite Micro, and export.int8_method=mixed "
                "keeps some layers in float: export with export.int8_method=ptq (or qat) for a board"
            )
        export(cfg, say=console.print)

    run(
        go,
        "each format's .tflite and sidecar are replaced together when it is done, so every model in the run folder "
        "still has its own sidecar; run export again for the formats not done",
    )


@app.command()
def predict(
    files: list[Path] = typer.Argument(..., help="PNG, JPEG or DICOM files, or folders of them."),
    model: Path = typer.Option(
        Path("runs/default"), "--model", "-m", help="A .tflite written by export, or its run directory."
    ),
    fmt: str | None = typer.Option(
        None, "--format", help=f"With a run directory: {', '.join(FORMATS.names())} (default {DEFAULT_FORMAT})."
    ),
    threads: int = typer.Option(1, help="Interpreter threads."),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON document (a list, one entry per file) on stdout, when all are done."
    ),
    as_jsonl: bool = typer.Option(
        False, "--jsonl", help="JSON lines: one JSON object per file on stdout, each as soon as it is done."
    ),
    explain: bool = typer.Option(
        False, "--explain", help="Write a Grad-CAM overlay per image (needs TensorFlow and the Keras model)."
    ),
    explain_dir: Path = typer.Option(Path("gradcam"), help="Where --explain writes <image stem>.gradcam.png."),
    keras_model: Path | None = typer.Option(
        None, help="Keras model for --explain (default: model.keras beside the .tflite; it must be the one exported)."
    ),
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
):
    """Classify X-rays with the exported model (LiteRT interpreter; no TensorFlow needed)."""
    from covidxray.edge.image_header import limit_decoder_pixels
    from covidxray.run_folder import resolve_model

    def load():
        if as_json and as_jsonl:
            raise UserError("--json and --jsonl: choose one")
        max_pixels = resolve(config, sets).data.max_pixels
        limit_decoder_pixels(max_pixels)  # OpenCV's own limit, read once when cv2 is imported (next line)
        from covidxray.edge.predict import Predictor, expand_inputs

        explainer = _gradcam(explain_dir, keras_model) if explain else None
        predictor = Predictor(resolve_model(model, fmt), threads, explainer, warn, max_pixels)
        return predictor, expand_inputs(files)

    predictor, inputs = run(load)
    mode = "jsonl" if as_jsonl else "json" if as_json else "text"
    results = _classify_each(predictor, inputs, mode)
    if mode == "json":
        print(json.dumps(results, indent=2))
    if any("error" in item or "rejected" in item for item in results):
        raise typer.Exit(1)


def _gradcam(explain_dir: Path, keras_model: Path | None):
    """predict --explain's Grad-CAM writer, or a UserError where TensorFlow is not installed (as on a Pi)."""
    try:
        from covidxray.export.gradcam import gradcam_for  # imports TensorFlow
    except ImportError as err:
        raise UserError(
            f"--explain runs the Keras model and needs TensorFlow ({err}): run it where covidxray was trained, or install the full package"
        ) from None
    return gradcam_for(explain_dir, keras_model)


def _classify_each(predictor: Predictor, inputs: list[Path | ImageError], mode: str) -> list[dict]:
    """Each input's result, shown as soon as it is done; on Ctrl-C, what was done and where to pick up (exit 130)."""
    from covidxray.files import signals_held

    results: list[dict] = []
    try:
        for item in inputs:
            result = predictor(item)
            with signals_held():  # a result counts as done once its line is out, whole
                show_result(result, mode)
                results.append(result)
    except KeyboardInterrupt:
        if mode == "json":
            print(json.dumps(results, indent=2))  # still one valid document, of the files done
        left = inputs[len(results)]
        console.print(
            f"[yellow]interrupted[/]: {len(results)} of {len(inputs)} file(s) done (their results are above); "
            f"{len(inputs) - len(results)} not classified, from {escape(str(getattr(left, 'path', left)))} on: "
            "run predict again on those",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(130) from None
    return results


def show_result(item: dict, mode: str) -> None:
    """One result as soon as it is done: errors on stderr; results and refusals on stdout (text or a JSON line)."""
    if "error" in item:
        console.print(f"[red]{escape(item['file'])}: {escape(item['error'])}[/]", soft_wrap=True, highlight=False)
    if mode == "jsonl":
        print(json.dumps(item), flush=True)
    elif mode == "text" and "rejected" in item:
        print(
            f"{item['file']}: rejected: {item['rejected']} ({item['reason']}, score {item['score']:.3g}, limit {item['limit']:.3g})",
            flush=True,
        )
    elif mode == "text" and "label" in item:
        probs = "  ".join(f"{k} {v:.3f}" for k, v in item["probabilities"].items())
        heat = f"  grad-cam {item['gradcam']}" if "gradcam" in item else ""
        print(f"{item['file']}: {item['label']}  ({probs}){heat}", flush=True)
    if "warning" in item.get("source_profile", {}):
        warn(f"{item['file']}: {item['source_profile']['warning']}")


def warn(message: str) -> None:
    """A warning on stderr, the text as it is (file names may hold [brackets])."""
    console.print(f"[yellow]warning[/]: {escape(message)}", soft_wrap=True, highlight=False)


@app.command()
def serve(
    model: Path = typer.Option(..., "--model", "-m", help="A .tflite written by export, or its run directory."),
    host: str = typer.Option(
        "127.0.0.1", help="Address to listen on; any but loopback needs the access token (--token, or one is made)."
    ),
    port: int = typer.Option(8000, help="Port (0: any free one; the address is printed)."),
    token: str | None = typer.Option(
        None, help="Access token every request must carry (default: $COVIDXRAY_SERVE_TOKEN, or one made and printed)."
    ),
    keep: Path | None = typer.Option(
        None, "--keep", help="Save every upload into this folder (default: none is written)."
    ),
    fmt: str | None = typer.Option(
        None, "--format", help=f"With a run directory: {', '.join(FORMATS.names())} (default {DEFAULT_FORMAT})."
    ),
    config: Path | None = ConfigOption,
    sets: list[str] | None = SetOption,
):
    """A page and an HTTP API (POST /predict, GET /healthz) classifying uploads as predict does (the `serve` extra)."""
    from covidxray.edge.image_header import limit_decoder_pixels
    from covidxray.run_folder import resolve_model

    def go():
        cfg = resolve(config, sets)
        limit_decoder_pixels(cfg.data.max_pixels)  # before cv2 is imported, as predict does
        try:  # the web packages are checked before the model is loaded, so their absence is the one message
            import flask  # noqa: F401
            import waitress  # noqa: F401

            from covidxray.serve.server import serve as do_serve
        except ImportError as err:
            raise UserError(
                f"serve needs Flask and waitress ({err}): install covidxray's `serve` extra, which pins both (scripts/install.sh installs it)"
            ) from None
        do_serve(
            resolve_model(model, fmt), cfg, host, port, token, keep, lambda text: console.print(escape(text)), warn
        )

    run(go, "stopped serving")


@app.command()
def demo(
    workdir: Path = typer.Option(Path("demo"), help="Where the demo's data and run go."),
    epochs: int = typer.Option(10),
):
    """prepare -> train -> evaluate -> export -> predict -> report on generated phantom X-rays (a few minutes on 2 cores)."""
    from covidxray.demo import run_demo

    run(lambda: run_demo(workdir, epochs, say=console.print))


weights_app = typer.Typer(
    no_args_is_help=True, help="ImageNet backbone weights: where they come from, air-gapped copies."
)
app.add_typer(weights_app, name="weights")


@weights_app.command("list")
def weights_list():
    """Where `train.weights: imagenet` gets each model's file, and whether it is on this machine."""
    from covidxray.train.weights import describe_imagenet_weights

    for model in [*PACKAGED_WEIGHTS, *IMAGENET_WEIGHTS]:
        print(describe_imagenet_weights(model))


@weights_app.command("download")
def weights_download(
    model: str = typer.Argument(..., help=f"{' or '.join(IMAGENET_WEIGHTS)}."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="File (or folder) to write; default: Keras' file name here."
    ),
):
    """Download Keras' ImageNet backbone file (checked against Keras' hash) for `train.weights: PATH` on every board."""
    from covidxray.train.weights import download_weights

    run(lambda: download_weights(model, out, say=console.print))


def print_listing(registry: Registry) -> None:
    for line in registry.listing():
        print(line)


@app.command()
def sources():
    """List the dataset adapters (data.sources, --source) and their options."""
    from covidxray.sources import SOURCE_REGISTRY

    print_listing(SOURCE_REGISTRY)


@app.command()
def models():
    """List the models (train.model, --model)."""
    print_listing(MODEL_REGISTRY)


@app.command()
def tasks():
    """List the tasks (data.task, --task) and their classes."""
    print_listing(TASKS)


@app.command()
def formats():
    """List the export formats (export.formats, --format)."""
    print_listing(FORMATS)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
