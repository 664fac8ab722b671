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
