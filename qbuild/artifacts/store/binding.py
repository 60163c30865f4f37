"""What binds an object's provenance (its manifest.json beyond the file list) to the records that name the object.

An object's digest names its files only (tree_digest: path, size, sha256), so objects stay content-addressed: two
steps that write the same bytes share one object, and a rebuild that is bit-identical has the same digest. The
manifest's other fields (key, kind, params, inputs, toolchain, recipe, variant, metrics, timings, ...) are not
covered by it: a remote peer could once edit them and `pull` wrote the forged manifest out.

The binding: `manifest_digest`, the sha256 of the canonical JSON of the manifest without `digest` (and without what
records add beside it), is written into the action record of every key whose step made the object (the commit point,
written after the object). Pull and `verify --remote` recompute it from the manifest they read and refuse a manifest
that does not hash to what an action record naming the object commits to. A record written before this field is
still the manifest of the step that made the object plus record-only fields, so it binds that manifest the same way
(committed_digest). Step keys are untouched (they hash the step's kind, params, inputs' keys and toolchain, never a
manifest). An object no record commits to (its records were removed, or name it only as another step's identical
output) is *unbound*: reported as such by `verify --remote` and pulled with a warning, never damaged.
"""

from __future__ import annotations

import json

from qbuild.base.hashing import canonical_json, sha256_text

MANIFEST_DIGEST = "manifest_digest"
# fields a record adds beside the object's manifest (an action record is the manifest plus these): never hashed
RECORD_ONLY = ("digest", "object_manifest_key", MANIFEST_DIGEST)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical JSON of `manifest` without `digest` and the record-only fields, computed on its JSON
    form (what is written to and read back from disk or a remote), so the manifest object in hand and the file read
    back hash alike."""
    data = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in RECORD_ONLY}, default=str))
    return sha256_text(canonical_json(data))


def changed_fields(manifest: dict, record: dict) -> list[str]:
    """The top-level fields where `manifest` differs from the action record that carries the object's own
    provenance (the record of the step that made it), for the message that names what was forged."""
    keys = (set(manifest) | set(record)) - set(RECORD_ONLY)
    return sorted(k for k in keys if json.dumps(manifest.get(k), sort_keys=True, default=str)
                  != json.dumps(record.get(k), sort_keys=True, default=str))


def committed_digest(record: dict, manifest: dict) -> str | None:
    """The manifest digest an action record commits its object's manifest.json to, or None (it commits to none):
    its `manifest_digest`, or, for a record written before that field, its own provenance when it is the record
    of the step that made the object (its key is the manifest's and its object manifest is its own: such a
    record is that manifest plus record-only fields)."""
    expected = record.get(MANIFEST_DIGEST)
    if isinstance(expected, str):
        return expected
    key = record.get("key")
    if isinstance(key, str) and key == manifest.get("key") and record.get("object_manifest_key", key) == key:
        return manifest_digest(record)
    return None


def binding_problem(manifest: dict, record: dict) -> str | None:
    """Why `manifest` is not the one the action record `record` (naming the same object) commits to, or None (it is,
    or the record commits to none)."""
    expected = committed_digest(record, manifest)
    if expected is None or manifest_digest(manifest) == expected:
        return None
    # the record of the step that made the object carries that very manifest: it names the forged fields
    changed = changed_fields(manifest, record) if manifest_digest(record) == expected else []
    what = f" ({', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''} changed)" if changed else ""
    return (f"provenance changed: its manifest.json is not the one its action record {str(record.get('key'))[:12]} "
            f"commits to{what}")
