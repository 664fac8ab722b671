"""Helpers to craft hostile checkpoints: an attacker who can write a checkpoint can also
recompute its manifest checksum, so crafted manifests are sealed to test the validation
behind the checksum."""

import json

import xxhash


def seal(obj) -> bytes:
    """Manifest bytes for ``obj`` with a valid ``manifest_xxh3_128`` (as unickpt writes it)."""
    obj = {k: v for k, v in obj.items() if k != "manifest_xxh3_128"}
    body = json.dumps(obj, separators=(",", ":")).encode()
    return body[:-1] + b',"manifest_xxh3_128":"' + xxhash.xxh3_128_hexdigest(body).encode() + b'"}'


def seal_text(text: str) -> bytes:
    """Seal manifest text edited as a string (a stale checksum member is dropped first)."""
    import re

    raw = re.sub(r',"manifest_xxh3_128":"[0-9a-f]{32}"\}\s*$', "}", text).encode()
    return raw[:-1] + b',"manifest_xxh3_128":"' + xxhash.xxh3_128_hexdigest(raw).encode() + b'"}'


def worst_case_json(size: int):
    """(label, JSON text of about ``size`` bytes): the shapes that maximize parse memory and
    work per input byte. Shared by tests/test_fuzz.py (bounded memory and calls) and
    bench/parse_dos.py (the time they take)."""
    k = size // 3
    yield "[{}]", ("[" + "{}," * k + "{}]").encode()
    yield "[[]]", ("[" + "[]," * k + "[]]").encode()
    yield "keys", ("{" + ",".join(f'"{i}":[]' for i in range(size // 10)) + "}").encode()
    yield "strings", ("[" + '"ab",' * (size // 5) + '"ab"]').encode()
    yield "floats", ("[" + "0.5," * (size // 4) + "0.5]").encode()
    yield "ints", ("[" + "1000," * (size // 5) + "1]").encode()
    yield "nested", ("[" * 1000 + "]" * 1000).encode()
    yield "small-objects", ("[" + '{"":0},0,' * (size // 9) + "0]").encode()


def worst_case_inputs(size: int):
    """(label, manifest bytes, safetensors header prefix) for each :func:`worst_case_json`
    text: the text as a manifest's ``extra`` value (format 1: no digest in the way) and as a
    header entry (length prefix included; the file is exactly the header)."""
    import struct

    for label, text in worst_case_json(size):
        doc = b'{"format":"unickpt","format_version":1,"files":{},"tensors":{},"extra":{"x":' + text + b"}}"
        hdr = b'{"__metadata__":{},"x":' + text + b"}"
        yield label, doc, struct.pack("<Q", len(hdr)) + hdr
