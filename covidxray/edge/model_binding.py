"""A .tflite and its sidecar bound to each other, so that neither can be swapped or edited unnoticed.

Each side names the other: the sidecar's `tflite_sha256` is the hash of the
.tflite's bytes, and the .tflite carries, in its own metadata table
(`METADATA_NAME`), the hash of the sidecar's content (every key but
`tflite_sha256`, as sorted compact JSON, so formatting does not count).
Editing the sidecar (permuted labels, a NaN threshold) breaks the second
hash, and re-hashing it would mean rewriting the model too, which breaks
the first. The flatbuffer is read and written with the schema module
LiteRT ships (no TensorFlow).
"""

from __future__ import annotations

import hashlib

from covidxray.files import json_sha256

METADATA_NAME = "covidxray_sidecar_sha256"
TFLITE_SHA256 = "tflite_sha256"
_FILE_IDENTIFIER = b"TFL3"


def sidecar_digest(card: dict) -> str:
    return json_sha256({key: value for key, value in card.items() if key != TFLITE_SHA256})


def embedded_digest(flatbuffer: bytes) -> str | None:
    """The sidecar digest recorded in a (verified) flatbuffer's metadata, or None when it has none."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(flatbuffer, 0)
    for i in range(model.MetadataLength()):
        entry = model.Metadata(i)
        if entry.Name() == METADATA_NAME.encode():
            return bytes(model.Buffers(entry.Buffer()).DataAsNumpy()).decode("ascii", errors="replace")
    return None


def bind(flatbuffer: bytes, card: dict) -> tuple[bytes, dict]:
    """(the flatbuffer with the sidecar's digest in its metadata, the sidecar with the new flatbuffer's sha256)."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(flatbuffer, 0))
    buffer = schema.BufferT()
    buffer.data = list(sidecar_digest(card).encode("ascii"))
    model.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = METADATA_NAME, len(model.buffers) - 1
    model.metadata = [m for m in model.metadata or [] if m.name != METADATA_NAME.encode()] + [entry]
    builder = flatbuffers.Builder(len(flatbuffer) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=_FILE_IDENTIFIER)
    bound = bytes(builder.Output())
    return bound, {**card, TFLITE_SHA256: hashlib.sha256(bound).hexdigest()}


def binding_problem(flatbuffer: bytes, card: dict) -> str | None:
    """Why this flatbuffer and this sidecar are not one export's pair, or None."""
    if hashlib.sha256(flatbuffer).hexdigest() != card.get(TFLITE_SHA256):
        return "other"
    if embedded_digest(flatbuffer) is None:
        return "unbound"
    if embedded_digest(flatbuffer) != sidecar_digest(card):
        return "edited"
    return None
