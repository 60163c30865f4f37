"""Signed provenance for artifacts: an in-toto SLSA provenance statement and an OpenSSF model-signing signature.

What is signed: the artifact's directory as a serving team receives it (every file, qbuild's manifest.json,
and the provenance statement at .qbuild/provenance.intoto.json), hashed file by file by `model-signing`
and signed with an EC private key (offline, no Sigstore). The signature bundle lives at
.qbuild/signature.sig; the model card README.md and the signature itself are left out of what is signed
(recorded in the signature, so `model_signing verify` skips them too):

    model_signing verify key --signature DIR/.qbuild/signature.sig --public_key key.pub DIR

What a signature binds: the object (its digest: every file and manifest.json are subjects of the statement) and
the names it is published under. The statement lists them in externalParameters.names ("recipe/variant"; the
names the signer pushed it as); `verify(..., name=)` refuses a pull whose requested name is not among them, so a
ref moved onto another signed artifact is caught. Tags are not bound: they are pointers that move (promotion
from `nightly` to `serving`). A statement signed before names were recorded binds its own recipe.name and
step.variant.

Keys: `keygen(path)` writes an EC P-256 private key (PEM, mode 0600) and `<path>.pub`. The signing key of
a push comes from QBUILD_SIGNING_KEY (a path). Never stored in manifests, records or logs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from qbuild.base.errors import MissingBackendError, QBuildError, UserError

ENV_KEY = "QBUILD_SIGNING_KEY"
STATEMENT = "provenance.intoto.json"
SIGNATURE = "signature.sig"
SIDECAR_DIR = ".qbuild"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://qbuild.dev/buildtypes/step/v1"


class SignatureError(QBuildError):
    """An artifact is unsigned, or its files, manifest or provenance do not match its signature (exit 1)."""


def _need_model_signing():
    try:
        import model_signing  # noqa: F401
    except ImportError:
        raise MissingBackendError("signing needs model-signing, which", "sign") from None


def keygen(path: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
    """Write an EC P-256 private key to `path` (0600) and its public key to `path`.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    priv, pub = Path(path), Path(f"{path}.pub")
    key = ec.generate_private_key(ec.SECP256R1())
    priv.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL|O_NOFOLLOW: no window between a check and the open, and never through a link (a key path pointing at
    # ~/.bashrc must not truncate it); `overwrite` replaces an existing key by a rename, never by writing through it
    _write_new(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), 0o600, overwrite)
    try:
        _write_new(pub, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo), 0o644, overwrite)
    except UserError:
        if not overwrite:
            priv.unlink()   # the private key this call just created (O_EXCL): never an unmatched pair
        raise
    return priv, pub


def _write_new(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    target = path.with_name(f".{path.name}.{os.getpid()}.new") if overwrite else path
    try:
        fd = os.open(target, flags, mode)
    except FileExistsError:
        raise UserError(f"{path} already exists (refusing to overwrite a key)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if overwrite:
        os.replace(target, path)   # replaces a link itself, never what it points at


def signing_key(explicit: str | os.PathLike | None = None) -> Path | None:
    """The private key to sign with: an explicit path, else QBUILD_SIGNING_KEY, else None (unsigned)."""
    raw = explicit or os.environ.get(ENV_KEY)
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_file():
        raise UserError(f"signing key {path} does not exist (set {ENV_KEY} to a key written by `qbuild keygen`)")
    return path


def _qbuild_version() -> str:
    try:
        from importlib.metadata import version

        return version("qbuild")
    except Exception:
        return "0+unknown"


def own_name(manifest: dict) -> str | None:
    """recipe/variant of the build that made the object (its manifest), or None when it has no variant."""
    recipe, variant = (manifest.get("recipe") or {}).get("name"), manifest.get("variant")
    return f"{recipe}/{variant}" if isinstance(recipe, str) and isinstance(variant, str) else None


def provenance_statement(manifest: dict, manifest_sha256: str, source: dict | None = None,
                         hardware: dict | None = None, names: Iterable[str] = ()) -> dict:
    """An in-toto v1 Statement with a SLSA v1 provenance predicate for one artifact.

    subject: every file (sha256) and manifest.json. source: the source model's identity, e.g.
    {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "digest": {"sha256": ...}} (from the import step).
    names: the recipe/variant names the signer publishes the object as (its manifest's own is always one).
    """
    subject = [{"name": f["path"], "digest": {"sha256": f["sha256"]}} for f in manifest["files"]]
    subject.append({"name": "manifest.json", "digest": {"sha256": manifest_sha256}})
    recipe = manifest.get("recipe") or {}
    deps = []
    if source:
        deps.append({"name": source.get("name", "source-model"), "digest": source.get("digest", {}),
                     "annotations": {"role": "source-model"}})
    inputs = manifest.get("inputs") or {}
    for role, inp in sorted(inputs.items() if isinstance(inputs, dict) else []):
        if isinstance(inp, dict) and inp.get("digest"):
            deps.append({"name": f"qbuild-object:{inp.get('step') or role}",
                         "digest": {"qbuildTreeSha256": inp["digest"]}, "annotations": {"role": role,
                                                                                          "stepKey": inp.get("key")}})
    hw = dict(hardware or {})
    hw.setdefault("machine", platform.machine())
    if (manifest.get("info") or {}).get("gpu"):
        hw.setdefault("gpu", manifest["info"]["gpu"])
    if manifest.get("toolchain", {}).get("gpu.sm"):
        hw.setdefault("gpu_sm", manifest["toolchain"]["gpu.sm"])
    return {
        "_type": STATEMENT_TYPE,
        "subject": subject,
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "recipe": {"name": recipe.get("name"), "sha256": recipe.get("sha256")},
                    "step": {"name": manifest.get("name"), "kind": manifest.get("kind"),
                             "variant": manifest.get("variant"), "params": manifest.get("params")},
                    "names": sorted({*names, *filter(None, [own_name(manifest)])}),
                },
                "internalParameters": {"toolchain": manifest.get("toolchain"), "hardware": hw,
                                       "stepKey": manifest.get("key"), "objectDigest": manifest.get("digest"),
                                       "format": manifest.get("format")},
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": "https://qbuild.dev/builder/qbuild", "version": {"qbuild": _qbuild_version()}},
                "metadata": {"invocationId": manifest.get("run_id"), "startedOn": manifest.get("created")},
            },
        },
    }


def _ignored(files: list[dict]) -> list[str]:
    """What the signature leaves out: itself, and the model card where it is not one of the object's files."""
    paths = [f"{SIDECAR_DIR}/{SIGNATURE}"]
    if not any(f["path"] == "README.md" for f in files):
        paths.append("README.md")
    return paths


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def sign(object_dir: str | os.PathLike, manifest: dict, key: str | os.PathLike, source: dict | None = None,
         hardware: dict | None = None, names: Iterable[str] = (),
         previous: tuple[bytes, bytes] | None = None) -> tuple[bytes, bytes]:
    """Sign an object directory (its files and manifest.json) for `names` (recipe/variant: what it is published
    as, besides its manifest's own). Returns (statement JSON, signature bundle): push them as the sidecars
    `provenance.intoto.json` and `signature.sig`.

    `previous`: the (statement, signature) the object carries already (read from a remote, so not trusted): the
    names it binds are kept only when that signature verifies with this key for these very files."""
    _need_model_signing()
    from model_signing import hashing, signing

    object_dir = Path(object_dir)
    mpath = object_dir / "manifest.json"
    if not mpath.is_file():
        raise UserError(f"{object_dir} has no manifest.json: not a qbuild object")
    mhash = hashlib.sha256(mpath.read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory(prefix=".qbuild-sign-", dir=_scratch(object_dir)) as tmp:
        view = Path(tmp) / "view"
        for f in manifest["files"]:
            _link_or_copy(object_dir / f["path"], view / f["path"])
        _link_or_copy(mpath, view / "manifest.json")
        (view / SIDECAR_DIR).mkdir(parents=True, exist_ok=True)
        kept = _names_still_signed(view, Path(key), previous) if previous else []
        statement = json.dumps(provenance_statement(manifest, mhash, source, hardware, [*names, *kept]), indent=2,
                               sort_keys=True).encode()
        (view / SIDECAR_DIR / STATEMENT).write_bytes(statement)
        sig = Path(tmp) / SIGNATURE
        hashing_config = hashing.Config().set_ignored_paths(paths=_ignored(manifest["files"]))
        try:
            signing.Config().use_elliptic_key_signer(private_key=Path(key)).set_hashing_config(
                hashing_config).sign(view, sig)
        except Exception as exc:
            raise SignatureError(f"signing {manifest.get('digest', '')[:12]} failed: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        return statement, sig.read_bytes()


def _names_still_signed(view: Path, key: Path, previous: tuple[bytes, bytes]) -> list[str]:
    """The names `previous` (statement, signature) binds when it is a valid signature by `key` of the object in
    `view`; [] otherwise (another key, other files, a statement edited on the remote). Leaves no sidecar in view."""
    from cryptography.hazmat.primitives import serialization

    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    public = view.parent / "previous.pub"
    public.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    statement, signature = view / SIDECAR_DIR / STATEMENT, view / SIDECAR_DIR / SIGNATURE
    statement.write_bytes(previous[0])
    signature.write_bytes(previous[1])
    try:
        return signed_names(verify(view, public))
    except (SignatureError, ValueError):
        return []
    finally:
        statement.unlink(missing_ok=True)
        signature.unlink(missing_ok=True)


def _scratch(object_dir: Path) -> str:
    """A writable directory on the object's filesystem (hard links), else the system temp dir."""
    for cand in (object_dir.parent.parent.parent / "tmp", object_dir.parent):
        if cand.is_dir() and os.access(cand, os.W_OK):
            return str(cand)
    return tempfile.gettempdir()


def place_sidecars(directory: str | os.PathLike, statement: bytes, signature: bytes) -> None:
    """Write the statement and signature where verify() and `model_signing verify` look for them."""
    d = Path(directory) / SIDECAR_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / STATEMENT).write_bytes(statement)
    (d / SIGNATURE).write_bytes(signature)


def signed_names(statement: dict) -> list[str]:
    """The recipe/variant names a (verified) statement binds: externalParameters.names, or for a statement signed
    before names were recorded, its recipe.name/step.variant."""
    params = ((statement.get("predicate") or {}).get("buildDefinition") or {}).get("externalParameters") or {}
    names = params.get("names")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return sorted(set(names))
    recipe, step = params.get("recipe") or {}, params.get("step") or {}
    legacy = own_name({"recipe": recipe if isinstance(recipe, dict) else {},
                       "variant": step.get("variant") if isinstance(step, dict) else None})
    return [legacy] if legacy else []


def check_binding(statement: dict, manifest: dict, name: str, where: str = "") -> str:
    """That a verified statement is for `name` (a ref recipe/variant[:tag] or a 64-hex digest); returns what it
    verified ("recipe/variant (object <digest>)"), or SignatureError naming what the signature is for."""
    from qbuild.artifacts.store import REF_RE

    digest = str(manifest.get("digest"))   # manifest.json is a signed subject: the digest it records is signed
    names = signed_names(statement)
    m = REF_RE.match(name)
    if m:
        wanted = f"{m.group('recipe')}/{m.group('variant')}"
        if wanted not in names:
            raise SignatureError(f"{where}the signature is for {', '.join(names) or 'no name'} (object {digest[:12]}), "
                                 f"not {wanted}: the ref points at another artifact; refusing it")
        return f"{wanted} (object {digest})"
    if name.removeprefix("sha256:").lower() != digest:
        raise SignatureError(f"{where}the signature is for object {digest[:12]}, not {name[:80]}; refusing it")
    return f"object {digest}" + (f" ({', '.join(names)})" if names else "")


def verify(directory: str | os.PathLike, public_key: str | os.PathLike, name: str | None = None) -> dict:
    """Check a pulled artifact directory against its signature and provenance; returns the statement.

    Refuses (SignatureError) an unsigned artifact, any added, removed or changed file, a manifest.json or a
    provenance statement that is not the signed one, or a statement whose subject disagrees with the manifest;
    with `name` (what the pull asked for: a ref or a digest), a signature made for another name (check_binding).
    """
    _need_model_signing()
    from model_signing import verifying

    directory = Path(directory)
    sig, stmt_path = directory / SIDECAR_DIR / SIGNATURE, directory / SIDECAR_DIR / STATEMENT
    if not sig.is_file():
        raise SignatureError(f"{directory}: unsigned artifact (no {SIDECAR_DIR}/{SIGNATURE}); refusing it")
    if not stmt_path.is_file():
        raise SignatureError(f"{directory}: no provenance statement ({SIDECAR_DIR}/{STATEMENT}); refusing it")
    if not Path(public_key).is_file():
        raise UserError(f"public key {public_key} does not exist")
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=Path(public_key)).verify(directory, sig)
    except Exception as exc:
        text = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise SignatureError(f"{directory}: signature check failed: {text}") from None
    statement = json.loads(stmt_path.read_text())
    manifest = json.loads((directory / "manifest.json").read_text())
    want = {f["path"]: f["sha256"] for f in manifest["files"]}
    want["manifest.json"] = hashlib.sha256((directory / "manifest.json").read_bytes()).hexdigest()
    got = {s["name"]: s["digest"].get("sha256") for s in statement.get("subject", [])}
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != SLSA_PROVENANCE or got != want:
        raise SignatureError(f"{directory}: the provenance statement does not describe these files; refusing it")
    if name is not None:
        check_binding(statement, manifest, name, f"{name}: ")
    return statement


__all__ = ["keygen", "signing_key", "sign", "verify", "check_binding", "signed_names", "own_name",
           "place_sidecars", "provenance_statement", "SignatureError",
           "STATEMENT", "SIGNATURE", "ENV_KEY"]
