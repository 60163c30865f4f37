"""A remote in any OCI distribution registry: oci://host[:port]/repository (through oras-py).

Layout (docs/remote-stores.md, "OCI layout"):
  each object     one OCI image manifest following the CNCF ModelPack spec: artifactType
                  application/vnd.cncf.model.manifest.v1+json, a application/vnd.cncf.model.config.v1+json
                  config (descriptor, config.format/precision/quantization, modelfs.diff_ids), one layer
                  per file (ModelPack .raw media types, digest = the file's sha256 from our manifest,
                  title annotation = its relative path), plus qbuild's manifest.json as a doc layer and
                  the sidecars (model card README.md, .qbuild/<name>) as doc layers. Provenance summary in
                  org.qbuild.* annotations. Tagged `_obj-<digest>`.
  refs            the same manifest, tagged with the ref's encoding (oci_tag: `<recipe>-<variant>-<tag>` with
                  '_' written `__` and '-' inside a name written `_-`, so `demo/q4km:latest` is
                  `demo-q4km-latest`; org.qbuild.ref names the ref). Tags that earlier qbuild versions wrote
                  (`<recipe>-<variant>-<tag>` cut at 128 characters) are still read: legacy_oci_tag.
  action records  a small artifact (artifactType application/vnd.qbuild.action.v1+json, one JSON layer)
                  tagged `_key-<step key>`; pushed last, after every blob and the object's manifest.
Reserved tags start with `_`, which recipe names cannot, so they never collide with refs.
A plain `oras pull host/repo:<recipe>-<variant>-<tag>` gets the files, manifest.json and README.md.

What a registry answers is not trusted: every OCI manifest is read with a bounded, streamed read (its declared
size first) and checked field by field (check_oci_manifest) before anything indexes it; a bad one is a
RemoteRecordError naming the tag and the field, which `verify --remote` reports on that object's row alone.

Credentials: the docker config ($DOCKER_CONFIG/config.json or ~/.docker/config.json, including
credHelpers/credsStore), or QBUILD_REGISTRY_USERNAME / QBUILD_REGISTRY_PASSWORD. Never stored.
Plain HTTP for localhost/127.0.0.1/::1; other hosts use HTTPS unless the remote sets `insecure: true`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from qbuild.artifacts.remote import remotes
from qbuild.artifacts.remote.base import (
    CHUNK,
    HEX64,
    MANIFEST,
    MAX_JSON_BYTES,
    Progress,
    RemoteConfigError,
    RemoteError,
    RemoteRecordError,
    RemoteRefused,
    RemoteStore,
    bounded_json,
    check_digest,
    check_name,
    check_sidecar,
    read_bounded,
    remote_record,
)
from qbuild.artifacts.remote.oci_upload import push_blob_resumable
from qbuild.artifacts.remote.resume import UploadResume
from qbuild.artifacts.store import REF_RE, now_iso
from qbuild.base.errors import UserError, first_line
from qbuild.base.hashing import sha256_file

log = logging.getLogger("qbuild")

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
CODE = "application/vnd.cncf.model.code.v1.raw"
DATASET = "application/vnd.cncf.model.dataset.v1.raw"
ACTION_ARTIFACT = "application/vnd.qbuild.action.v1+json"
EMPTY = "application/vnd.oci.empty.v1+json"
TITLE = "org.opencontainers.image.title"
ROLE = "org.qbuild.role"  # manifest | sidecar (absent: one of the object's files)
OBJ_TAG, KEY_TAG = "_obj-", "_key-"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
CONNECT_TIMEOUT, READ_TIMEOUT, RETRIES = 5, 120, 2
UPLOAD_CHUNK = 64 << 20
MONOLITHIC_MAX = 32 << 20
TAG_MAX = 128                       # the distribution spec's tag grammar: [A-Za-z0-9_][A-Za-z0-9._-]{0,127}
READ_CHUNK = 1 << 20
ERROR_BODY = 64 << 10              # what is read of an error answer, for its message
BLOB_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# the whole tag list, beside each page's bound (MAX_JSON_BYTES): a repository of 200,000 objects has ~400,000 tags
# of ~70 characters (26 MiB of JSON, ~400 pages of 1,000); past any of these the listing fails in one line
MAX_TAGS = 500_000
MAX_TAG_LIST_BYTES = 48 << 20
MAX_TAG_PAGES = 5_000
TAG_LIST_SECONDS = 300.0

WEIGHT_EXT = {".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".engine", ".plan", ".onnx", ".npz", ".h5",
              ".msgpack", ".tflite", ".mlmodel"}
CONFIG_NAMES = re.compile(r"^(config|generation_config|preprocessor_config|special_tokens_map|added_tokens|"
                          r"tokenizer(_config)?|vocab|merges|hf_quant_config|quantize_config|quant_config|"
                          r"chat_template)(\.[\w.]+)?$|\.(model|tiktoken|jinja)$")
DOC_EXT = {".md", ".txt", ".html", ".pdf", ".rst"}
CODE_EXT = {".py", ".sh", ".ipynb"}
DATA_EXT = {".parquet", ".arrow", ".jsonl", ".npy", ".csv", ".tsv"}


def media_type(path: str) -> str:
    """The ModelPack layer media type for one of an object's files."""
    name = PurePosixPath(path).name
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in WEIGHT_EXT:
        return WEIGHT
    if CONFIG_NAMES.search(name):
        return WEIGHT_CONFIG
    if suffix in CODE_EXT:
        return CODE
    if suffix in DATA_EXT:
        return DATASET
    if suffix in DOC_EXT or name.upper().startswith(("LICENSE", "NOTICE", "README")):
        return DOC
    return DOC if suffix == ".json" else WEIGHT_CONFIG


def _escape(name: str) -> str:
    return name.replace("_", "__").replace("-", "_-")


def oci_tag(recipe: str, variant: str, tag: str) -> str:
    """The OCI tag of ref recipe/variant:tag: the three names joined by '-', each with '_' written `__` and '-'
    written `_-`. A prefix code (`__`, `_-`, `-` and every other character stand for one thing each), so two refs
    never share a tag; refs without '_' or '-' in their names keep the plain `recipe-variant-tag`. A ref whose
    encoding is longer than an OCI tag may be is refused (UserError), never cut."""
    encoded = "-".join(_escape(part) for part in (recipe, variant, tag))
    if len(encoded) > TAG_MAX:
        raise UserError(f"ref {recipe}/{variant}:{tag} cannot be an OCI tag: its encoding {encoded[:40]}... is "
                        f"{len(encoded)} characters, more than {TAG_MAX}; use shorter names")
    return encoded


def parse_oci_tag(tag: str) -> tuple[str, str, str] | None:
    """(recipe, variant, tag) that oci_tag encoded as `tag`, or None when `tag` is no such encoding."""
    parts, current, i = [], [], 0
    while i < len(tag):
        ch = tag[i]
        if ch == "_":
            if i + 1 == len(tag) or tag[i + 1] not in "_-":
                return None
            current.append(tag[i + 1])
            i += 2
            continue
        if ch == "-":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


def legacy_oci_tag(recipe: str, variant: str, tag: str) -> str:
    """The tag qbuild before the injective encoding wrote for a ref (ambiguous, cut at 128): read, never written."""
    return f"{recipe}-{variant}-{tag}"[:TAG_MAX]


def _check_descriptor(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a descriptor (a JSON object), got {type(value).__name__}")
    if not isinstance(value.get("digest"), str) or not BLOB_DIGEST.match(value["digest"]):
        raise ValueError(f"{where}.digest is not a sha256:<64 hex> digest")
    size = value.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"{where}.size is not a non-negative integer")
    if not isinstance(value.get("mediaType", ""), str):
        raise ValueError(f"{where}.mediaType is not a string")
    _check_annotations(value.get("annotations"), f"{where}.annotations")
    return value


def _check_annotations(value: object, where: str) -> None:
    if value is not None and (not isinstance(value, dict)
                              or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise ValueError(f"{where} is not a map of strings")


def check_oci_manifest(data: object) -> dict:
    """An OCI image manifest as qbuild reads it, or ValueError naming the first bad field: a JSON object whose
    config and layers are descriptors (sha256 digest, size) and whose annotations are maps of strings."""
    if not isinstance(data, dict):
        raise ValueError(f"is not a JSON object, got {type(data).__name__}")
    layers = data.get("layers", [])
    if not isinstance(layers, list):
        raise ValueError("layers is not a list")
    for i, layer in enumerate(layers):
        _check_descriptor(layer, f"layers[{i}]")
    if "config" in data:
        _check_descriptor(data["config"], "config")
    if not isinstance(data.get("artifactType", ""), str):
        raise ValueError("artifactType is not a string")
    _check_annotations(data.get("annotations"), "annotations")
    return data


def sidecar_title(name: str, files: list[dict]) -> str:
    """Where a sidecar lands in a pulled directory: the model card at README.md unless the object has one."""
    if name == "README.md" and not any(f["path"] == "README.md" for f in files):
        return "README.md"
    return f".qbuild/{name}"


def precision_of(manifest: dict) -> tuple[str | None, str | None]:
    """(precision, quantization) for the ModelPack config, from the manifest's format/params."""
    params = manifest.get("params") or {}
    fmt = str(manifest.get("format") or "")
    method = str(params.get("method") or "").lower() or None
    qtype = params.get("type") or params.get("scheme") or params.get("qformat")
    bits = params.get("bits") or params.get("w_bits")
    if qtype:
        precision = str(qtype).lower()
    elif bits:
        precision = f"int{bits}"
    elif params.get("dtype"):
        precision = str(params["dtype"]).replace("float", "fp").replace("bfp16", "bf16")
    else:
        precision = None
    quant = method if method not in (None, "none", "baseline") else None
    if quant is None and fmt.lower().startswith("gguf") and qtype:
        quant = "gguf"
    return precision, quant


@remotes.register
class OciRemote(RemoteStore):
    name = "oci"
    schemes = ("oci",)
    extra = "oci"
    requires = ("oras", "requests")

    def __init__(self, url: str, **options):
        super().__init__(url, **options)
        parts = urlsplit(self.display)
        self.host = parts.netloc
        self.repository = parts.path.strip("/")
        if not self.host or not self.repository or not re.fullmatch(r"[a-z0-9]+([._/-][a-z0-9]+)*", self.repository):
            raise RemoteConfigError(self.display, "expected oci://host[:port]/repository (lowercase repository path)")
        if self.endpoint_url or self.region:
            raise RemoteConfigError(self.display, "endpoint_url/region apply to s3:// remotes only")
        self.plain_http = (parts.hostname or "") in LOCAL_HOSTS or self.insecure
        self._client = None

    # --- client -----------------------------------------------------------------------------------------
    def _container(self, tag: str = "latest"):
        import oras.container

        return oras.container.Container(f"{self.host}/{self.repository}:{tag}")

    @property
    def client(self):
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _connect(self):
        import requests

        prefix = "http" if self.plain_http else "https"
        probe = requests.Session()
        try:
            r = probe.get(f"{prefix}://{self.host}/v2/", timeout=(CONNECT_TIMEOUT, 30), stream=True)
            r.close()   # status and headers are all it says; its body is never read
        except requests.RequestException as exc:
            raise self.error(f"unreachable ({_describe(exc)})") from None
        finally:
            probe.close()
        challenge = r.headers.get("WWW-Authenticate", "")
        backend = "basic" if r.status_code == 401 and challenge.lower().startswith("basic") else "token"
        client = _make_client(self.host, self.plain_http, backend)
        user, password = os.environ.get("QBUILD_REGISTRY_USERNAME"), os.environ.get("QBUILD_REGISTRY_PASSWORD")
        if user and password and self.env_credentials:
            client.auth.set_basic_auth(user, password)
        else:
            cfg_dir = os.environ.get("DOCKER_CONFIG")
            configs = [os.path.join(cfg_dir, "config.json")] if cfg_dir else None
            try:
                client.auth.load_configs(self._container(), configs=[c for c in configs or [] if os.path.exists(c)])
            except Exception as exc:
                raise RemoteConfigError(self.display, f"cannot read the docker config: {first_line(exc)}") from None
        has_creds = bool(getattr(client.auth, "_basic_auth", None))
        if r.status_code == 401 and backend == "basic" and not has_creds:
            raise self.error("the registry requires credentials and none were found "
                             "(docker login, $DOCKER_CONFIG, or QBUILD_REGISTRY_USERNAME/PASSWORD)")
        client.qbuild_basic = backend == "basic" and has_creds
        if r.status_code in (401, 403):
            resp = self._req(client, "GET", f"{prefix}://{self.host}/v2/")
            if resp.status_code in (401, 403):
                raise self.error(f"authentication failed (HTTP {resp.status_code}): wrong credentials?")
        elif r.status_code >= 400:
            raise self.error(f"not an OCI registry? GET /v2/ answered HTTP {r.status_code}")
        return client

    def _req(self, client, method: str, url: str, **kw):
        try:
            return client.do_request(url, method, **kw)
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"{method} failed: {_describe(exc)}") from None

    def _url(self, kind: str, ref: str) -> str:
        prefix = "http" if self.plain_http else "https"
        return f"{prefix}://{self.host}/v2/{self.repository}/{kind}/{ref}"

    def _fail(self, resp, what: str, streamed: bool = False):
        """One-line RemoteError for a refused request; `streamed`: read at most ERROR_BODY bytes of the body."""
        detail = ""
        try:
            body = _head(resp, ERROR_BODY) if streamed else resp.content
            errs = json.loads(body).get("errors") or []
            detail = "; ".join(str(e.get("code", "")) + ": " + str(e.get("message", "")) for e in errs)[:200]
        except Exception:
            pass
        if resp.status_code in (401, 403):
            return self.error(f"{what}: access denied (HTTP {resp.status_code}): wrong credentials or no permission")
        return self.error(f"{what}: HTTP {resp.status_code}" + (f" ({detail})" if detail else ""))

    # --- manifests and blobs -------------------------------------------------------------------------------
    def _read_bounded(self, resp, what: str, limit: int = MAX_JSON_BYTES, deadline: float | None = None,
                      late: Callable[[], Exception] | None = None) -> bytes:
        """The body of a streamed response, read at most `limit` bytes: a declared Content-Length over the limit is
        refused before any byte is read, a body that runs past it as soon as it does (RemoteRecordError: the record
        is bad, not the remote). With `deadline` (time.monotonic()), late() is raised for a body still arriving then."""
        declared = resp.headers.get("Content-Length")
        chunks = resp.iter_content(READ_CHUNK)
        if deadline is not None and late is not None:
            chunks = _until(chunks, deadline, late)
        try:
            return read_bounded(chunks, what, limit=limit,
                                size=int(declared) if declared is not None and declared.isdigit() else None)
        except ValueError as exc:
            raise RemoteRecordError(self.display, str(exc)) from None
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"reading {what} failed: {_describe(exc)}") from None
        finally:
            resp.close()

    def _get_oci_manifest(self, ref: str) -> tuple[dict | None, str | None]:
        """The OCI manifest tagged `ref` (None when absent), checked field by field; RemoteRecordError when the
        registry's answer is not one."""
        resp = self._req(self.client, "GET", self._url("manifests", ref), headers={"Accept": OCI_MANIFEST},
                         stream=True)
        if resp.status_code == 404:
            resp.close()
            return None, None
        if resp.status_code != 200:
            raise self._fail(resp, f"get manifest {ref}", streamed=True)
        body = self._read_bounded(resp, f"manifest {ref}")
        try:
            data = check_oci_manifest(bounded_json(body, f"manifest {ref}"))
        except ValueError as exc:
            raise RemoteRecordError(self.display, f"manifest {ref} is not a valid OCI manifest: "
                                                  f"{first_line(exc)}") from None
        return data, resp.headers.get("Docker-Content-Digest")

    def _put_oci_manifest(self, ref: str, manifest: dict) -> None:
        try:
            resp = self.client.upload_manifest(manifest, self._container(ref))
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"push manifest {ref} failed: {_describe(exc)}") from None
        if resp.status_code not in (200, 201, 202):
            raise self._fail(resp, f"push manifest {ref}")

    def _blob_exists(self, digest: str, size: int | None = None) -> bool:
        resp = self._req(self.client, "HEAD", self._url("blobs", digest))
        if resp.status_code == 200:
            return size is None or int(resp.headers.get("Content-Length", size)) == size
        if resp.status_code in (401, 403):
            raise self._fail(resp, "blob lookup")
        return False

    def _get_blob(self, digest: str, size: int | None = None, what: str | None = None) -> bytes | None:
        """A small blob (a JSON record, a sidecar), at most MAX_JSON_BYTES read, checked against its digest."""
        what = what or f"blob {digest[:19]}"
        if not isinstance(digest, str) or not BLOB_DIGEST.match(digest):
            raise RemoteRecordError(self.display, f"{what}: {str(digest)[:80]!r} is not a sha256 digest")
        if size is not None and size > MAX_JSON_BYTES:
            raise RemoteRecordError(self.display, f"{what}: its descriptor says {size:,} bytes, more than "
                                                  f"{MAX_JSON_BYTES:,} (not a qbuild record); not read")
        resp = self._req(self.client, "GET", self._url("blobs", digest), stream=True)
        if resp.status_code == 404:
            resp.close()
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"get {what}", streamed=True)
        data = self._read_bounded(resp, what, MAX_JSON_BYTES if size is None else size)
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise RemoteRecordError(self.display, f"{what} is corrupt on the registry (its sha256 is not {digest[:19]})")
        return data

    def _push_bytes(self, data: bytes, media: str, annotations: dict | None = None) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        desc = {"mediaType": media, "digest": digest, "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        if not self._blob_exists(digest, len(data)):
            import tempfile

            with tempfile.NamedTemporaryFile(prefix="qbuild-blob-") as tmp:
                tmp.write(data)
                tmp.flush()
                self._push_file(Path(tmp.name), desc)
        return desc

    def _push_file(self, path: Path, desc: dict) -> None:
        layer = {"mediaType": desc["mediaType"], "digest": desc["digest"], "size": desc["size"]}
        chunked = desc["size"] > MONOLITHIC_MAX
        try:
            resp = self.client.upload_blob(str(path), self._container(), layer, do_chunked=chunked,
                                           chunk_size=UPLOAD_CHUNK)
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"upload of {desc.get('annotations', {}).get(TITLE, desc['digest'][:19])} failed: "
                             f"{_describe(exc)}") from None
        if resp.status_code not in (200, 201, 202):
            raise self._fail(resp, f"upload {desc.get('annotations', {}).get(TITLE, desc['digest'][:19])}")

    def _push_file_resumable(self, path: Path, desc: dict, digest: str, rel: str, resume: UploadResume) -> None:
        """A large blob through a chunked session the local store remembers (qbuild.artifacts.remote.oci_upload):
        a push cut off in the middle continues it. The record is dropped once the session is closed; one the
        registry no longer continues (refused, expired) is found out by the next push, which opens a new session."""
        upload = resume.upload(self.display, digest, rel)
        kept = push_blob_resumable(self, path, desc, upload.get(), upload.remember, UPLOAD_CHUNK)
        upload.drop()
        self._count(bytes_resumed=kept)

    # --- contract ---------------------------------------------------------------------------------------------
    def check(self) -> None:
        self.client  # noqa: B018 - connects: reachability + credentials

    def repository_exists(self) -> bool:
        resp = self._req(self.client, "GET", self._url("tags", "list"))
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            raise self._fail(resp, "list tags")
        return True

    def _tags(self) -> list[str]:
        """Every tag of the repository, page by page. Each page is bounded (read_bounded), and so is the whole list:
        at most MAX_TAGS tags, MAX_TAG_LIST_BYTES bytes, MAX_TAG_PAGES pages and TAG_LIST_SECONDS seconds. A registry
        whose pages link on without end once grew `ls --remote` to 1.6 GB in 45 s; past a bound the listing fails in
        one line naming the remote, never a silently cut list (gc decides from it what no ref reaches)."""
        tags: list[str] = []
        url = self._url("tags", "list") + "?n=1000"
        read, deadline = 0, time.monotonic() + TAG_LIST_SECONDS

        def past(bound: str, pages: int):
            return self.error(f"the tag list goes on past {bound} ({len(tags):,} tags, {read:,} bytes in {pages:,} "
                              "pages; a registry whose pages link on without end?); stopped reading")

        for page in range(1, MAX_TAG_PAGES + 2):
            if page > MAX_TAG_PAGES:
                raise past(f"{MAX_TAG_PAGES:,} pages", page - 1)
            if time.monotonic() > deadline:
                raise past(f"{TAG_LIST_SECONDS:g} s", page - 1)
            resp = self._req(self.client, "GET", url, stream=True)
            if resp.status_code == 404:
                resp.close()
                return tags
            if resp.status_code != 200:
                raise self._fail(resp, "list tags", streamed=True)
            body = self._read_bounded(resp, f"page {page:,} of the tag list", deadline=deadline,
                                      late=lambda page=page: past(f"{TAG_LIST_SECONDS:g} s", page - 1))
            read += len(body)
            try:
                listing = bounded_json(body, "the tag list")
            except ValueError as exc:
                raise self.error(f"the tag list is not valid: {first_line(exc)}") from None
            found = listing.get("tags") if isinstance(listing, dict) else None
            tags += [t for t in found or [] if isinstance(t, str)]
            if read > MAX_TAG_LIST_BYTES or len(tags) > MAX_TAGS:
                raise self.error(f"the tag list is longer than {MAX_TAGS:,} tags or {MAX_TAG_LIST_BYTES:,} bytes "
                                 f"({len(tags):,} tags, {read:,} bytes in {page:,} pages so far; a registry whose pages "
                                 "link on without end?); stopped reading")
            link = resp.links.get("next", {}).get("url")
            if not link:
                break
            prefix = "http" if self.plain_http else "https"
            url = link if link.startswith("http") else f"{prefix}://{self.host}{link}"
            if urlsplit(url).netloc != self.host:   # the next page, with our credentials, only from this registry
                raise RemoteRecordError(self.display, f"the tag list's next page is on another host ({url[:80]}); "
                                                      "not followed")
        return tags

    def _read_manifest(self, digest: str) -> dict | None:
        check_digest(digest)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        if oci is None:
            return None
        layer = next((la for la in oci.get("layers", []) if (la.get("annotations") or {}).get(ROLE) == "manifest"), None)
        if layer is None:
            return None
        data = self._get_blob(layer["digest"], layer["size"], f"the manifest.json of object {digest[:12]}")
        if data is None:
            return None
        try:
            manifest = bounded_json(data, f"the manifest of {digest[:12]}")
        except ValueError as exc:
            raise RemoteRecordError(self.display, f"object {digest[:12]}: manifest is not valid: "
                                                  f"{first_line(exc)}") from None
        if not isinstance(manifest, dict):
            raise RemoteRecordError(self.display, f"object {digest[:12]}: manifest.json is not a JSON object")
        return manifest

    def has_object(self, digest: str) -> bool:
        """True when the object's qbuild manifest is `digest`'s (get_manifest checks it) and a layer holds every file
        it lists; a planted or damaged object is not (a push uploads it again), as on fsspec remotes."""
        check_digest(digest)
        try:
            oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
            if oci is None or (oci.get("annotations") or {}).get("org.qbuild.digest") != digest:
                return False
            manifest = self.get_manifest(digest)
        except (RemoteRefused, RemoteRecordError):
            return False
        # the registry accepts a manifest only when every blob it names is present
        layers = {(la["digest"], la["size"]) for la in oci["layers"]}
        return manifest is not None and all(("sha256:" + f["sha256"], f["size"]) in layers for f in manifest["files"])

    def _object_oci(self, digest: str, manifest: dict, files: list[dict], sidecars: dict[str, dict]) -> dict:
        layers = [{"mediaType": media_type(f["path"]), "digest": "sha256:" + f["sha256"], "size": f["size"],
                   "annotations": {TITLE: f["path"]}} for f in files]
        mbytes = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        layers.append(self._push_bytes(mbytes, DOC, {TITLE: MANIFEST, ROLE: "manifest"}))
        layers += [sidecars[n] for n in sorted(sidecars)]
        precision, quant = precision_of(manifest)
        recipe = (manifest.get("recipe") or {}).get("name")
        model_cfg = {k: v for k, v in {"format": manifest.get("format"), "precision": precision,
                                        "quantization": quant}.items() if v}
        descriptor = {k: v for k, v in {
            "name": "/".join(x for x in (recipe, manifest.get("variant") or manifest.get("name")) if x) or digest[:12],
            "title": manifest.get("name"), "revision": digest, "createdAt": manifest.get("created"),
            "description": f"qbuild {manifest.get('kind', 'artifact')} {digest[:12]} (step key {str(manifest.get('key'))[:12]})",
        }.items() if v}
        config = {"descriptor": descriptor, "config": model_cfg,
                  "modelfs": {"type": "layers", "diff_ids": [la["digest"] for la in layers]}}
        cdesc = self._push_bytes(json.dumps(config, sort_keys=True).encode(), MODEL_CONFIG)
        annotations = {k: str(v) for k, v in {
            "org.qbuild.digest": digest, "org.qbuild.key": manifest.get("key"), "org.qbuild.kind": manifest.get("kind"),
            "org.qbuild.planning.recipe": recipe, "org.qbuild.variant": manifest.get("variant"),
            "org.qbuild.format": manifest.get("format"), "org.opencontainers.image.created": manifest.get("created"),
        }.items() if v}
        return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": MODEL_ARTIFACT, "config": cdesc,
                "layers": layers, "annotations": annotations}

    def put_object(self, digest: str, local_dir: Path, manifest: dict, progress: Progress | None = None,
                   sidecars: dict[str, bytes] | None = None, resume: UploadResume | None = None,
                   replace: Iterable[str] = ()) -> None:
        """As RemoteStore.put_object. `replace`: a damaged manifest.json is replaced (the object's OCI manifest is
        pushed again with ours); a blob damaged in the registry's storage cannot be: a registry keeps the bytes it
        holds for a digest (an upload of the same digest is taken as already there), so that is one line saying
        how to remove it."""
        files = self._push_files(digest, manifest)
        blobs = sorted(set(replace) - {MANIFEST})
        if blobs:
            raise self.error(f"object {digest[:12]}: {', '.join(blobs[:3])} is damaged in the registry's storage (its "
                             "bytes are not its digest's); a registry keeps the blob it holds for a digest, so a push "
                             "cannot replace it: delete that blob with the registry's own tools (DELETE of "
                             f"/v2/{self.repository}/blobs/sha256:..., where deletes are enabled, then its garbage "
                             "collection) and push again")
        existing, _ = self._get_oci_manifest(OBJ_TAG + digest)
        side = {d["annotations"]["org.qbuild.sidecar"]: d for d in (existing or {}).get("layers", [])
                if (d.get("annotations") or {}).get(ROLE) == "sidecar" and "org.qbuild.sidecar" in d["annotations"]}
        if existing is None:
            def put(src: Path, f: dict) -> None:
                # the registry hashes the upload and refuses a blob that is not its digest's: one read here
                desc = {"mediaType": media_type(f["path"]), "digest": "sha256:" + f["sha256"], "size": f["size"],
                        "annotations": {TITLE: f["path"]}}
                try:
                    if resume is not None and f["size"] > MONOLITHIC_MAX:
                        self._push_file_resumable(src, desc, digest, f["path"], resume)
                    else:
                        self._push_file(src, desc)
                except RemoteError:
                    if sha256_file(src) != f["sha256"]:
                        raise self.mismatch(f) from None
                    raise

            self._upload_files(local_dir, files, lambda f: self._blob_exists("sha256:" + f["sha256"], f["size"]),
                               put, progress)
        elif not sidecars and MANIFEST not in replace:
            return
        for name, data in (sidecars or {}).items():
            check_sidecar(name)
            side[name] = self._push_bytes(data, DOC, {TITLE: sidecar_title(name, files), ROLE: "sidecar",
                                                      "org.qbuild.sidecar": name})
        self._put_oci_manifest(OBJ_TAG + digest, self._object_oci(digest, manifest, files, side))

    def _read_file(self, digest: str, entry: dict, offset: int) -> Iterator[bytes]:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        resp = self._req(self.client, "GET", self._url("blobs", "sha256:" + entry["sha256"]), headers=headers,
                         stream=True)
        if resp.status_code not in (200, 206):
            raise self._fail(resp, f"download {entry['path']}")
        try:
            if offset and resp.status_code == 200:  # no range support: skip what we have
                skip = offset
                for chunk in resp.iter_content(CHUNK):
                    if skip >= len(chunk):
                        skip -= len(chunk)
                        continue
                    yield chunk[skip:]
                    skip = 0
                    break
            yield from resp.iter_content(CHUNK)
        except RemoteError:
            raise
        except Exception as exc:
            raise self.error(f"download of {entry['path']} failed: {_describe(exc)}") from None
        finally:
            resp.close()

    def get_action(self, key: str) -> dict | None:
        """The action record of `key`, or None: a record that is not one (a hostile or damaged manifest, a layer
        that is not a record, an object that is gone) is a miss, named in a warning, so the step is rebuilt."""
        check_digest(key)
        try:
            oci, _ = self._get_oci_manifest(KEY_TAG + key)
            if oci is None or oci.get("artifactType") != ACTION_ARTIFACT or not oci.get("layers"):
                return None
            layer = oci["layers"][0]
            data = self._get_blob(layer["digest"], layer["size"], f"action record {key[:12]}")
            try:
                record = remote_record(bounded_json(data, f"action record {key[:12]}") if data else None, key)
            except ValueError:
                record = None
            if record is None or not self.has_object(record["digest"]):
                return None
        except RemoteRecordError as exc:
            log.warning(f"{exc} (ignored: a miss)")
            return None
        return record

    def put_action(self, key: str, record: dict) -> None:
        check_digest(key)
        digest = check_digest(record.get("digest", ""))
        layer = self._push_bytes(json.dumps(record, indent=2, sort_keys=True, default=str).encode(), ACTION_ARTIFACT,
                                 {TITLE: "action.json"})
        cfg = self._push_bytes(b"{}", EMPTY)
        self._put_oci_manifest(KEY_TAG + key, {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ACTION_ARTIFACT, "config": cfg,
            "layers": [layer], "annotations": {"org.qbuild.key": key, "org.qbuild.digest": digest}})

    def list_actions(self) -> Iterator[tuple[str, str]]:
        for tag in self._tags():
            if tag.startswith(KEY_TAG):
                try:
                    oci, _ = self._get_oci_manifest(tag)
                except RemoteRecordError as exc:
                    log.warning(f"{exc} (skipped)")
                    continue
                d = ((oci or {}).get("annotations") or {}).get("org.qbuild.digest")
                if remote_record({"digest": d}) and HEX64.match(tag[len(KEY_TAG):]):
                    yield tag[len(KEY_TAG):], d

    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str | None = None,
                annotations: dict[str, str] | None = None) -> None:
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        check_digest(digest)
        ref, target = f"{recipe}/{variant}:{tag}", oci_tag(recipe, variant, tag)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        if oci is None:
            raise self.error(f"cannot tag {ref}: object {digest[:12]} is not on this remote")
        self._check_not_legacy_of_another(ref, target)
        oci = dict(oci)
        oci["annotations"] = {**(oci.get("annotations") or {}), "org.qbuild.ref": ref,
                              "org.qbuild.ref.updated": now_iso(), **({"org.qbuild.key": key} if key else {}),
                              **{k: str(v) for k, v in (annotations or {}).items()}}
        self._put_oci_manifest(target, oci)

    def _check_not_legacy_of_another(self, ref: str, target: str) -> None:
        """Refuse to overwrite `target` where it is the legacy tag of another ref that has no tag of its own yet
        (an earlier qbuild tagged a__b/c:t `a__b-c-t`, which is a_b/c:t's encoding): that ref would be lost."""
        try:
            holder = ((self._get_oci_manifest(target)[0] or {}).get("annotations") or {}).get("org.qbuild.ref")
        except RemoteRecordError:
            return   # not a ref manifest: ours to replace
        m = REF_RE.match(str(holder or ""))
        if not m or holder == ref:
            return
        parts = (m.group("recipe"), m.group("variant"), m.group("tag") or "latest")
        try:
            own = self._ref_from(self._get_oci_manifest(oci_tag(*parts))[0], holder)
        except (UserError, RemoteRecordError):
            own = None
        if own is None:
            raise self.error(f"cannot tag {ref}: its tag {target} holds ref {holder}, written by an earlier qbuild; "
                             f"re-tag that one first (qbuild tag {holder} {holder} --remote {self.display})")

    def _ref_from(self, oci: dict | None, ref: str | None = None) -> dict | None:
        ann = (oci or {}).get("annotations") or {}
        if not isinstance(ann, dict) or not ann.get("org.qbuild.ref") or (ref and ann["org.qbuild.ref"] != ref) \
                or remote_record({"digest": ann.get("org.qbuild.digest"), "key": ann.get("org.qbuild.key")}) is None \
                or not REF_RE.match(str(ann["org.qbuild.ref"])):
            return None
        return {"ref": ann["org.qbuild.ref"], "digest": ann["org.qbuild.digest"], "key": ann.get("org.qbuild.key"),
                "updated": ann.get("org.qbuild.ref.updated")}

    def get_ref(self, recipe: str, variant: str, tag: str = "latest") -> dict | None:
        """The ref from its tag; a registry an earlier qbuild pushed to still answers from the legacy tag (read only
        when the ref has no tag of its own, and only when its manifest names exactly this ref)."""
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        ref = f"{recipe}/{variant}:{tag}"
        try:
            tags = [oci_tag(recipe, variant, tag)]
        except UserError:
            tags = []   # too long to have been written by this version: only the legacy tag can hold it
        if legacy_oci_tag(recipe, variant, tag) not in tags:
            tags.append(legacy_oci_tag(recipe, variant, tag))
        for candidate in tags:
            row = self._ref_from(self._get_oci_manifest(candidate)[0], ref)
            if row is not None:
                return row
        return None

    def list_refs(self) -> list[dict]:
        """Every ref whose tag is its own: its encoding, or the legacy tag of a ref that has no encoded tag yet.
        A tag whose manifest names another ref (a copied manifest), or that is not a ref manifest, is skipped."""
        rows: dict[str, tuple[bool, dict]] = {}
        for tag in self._tags():
            if tag.startswith("_"):
                continue
            try:
                row = self._ref_from(self._get_oci_manifest(tag)[0])
            except RemoteRecordError as exc:
                log.warning(f"{exc} (skipped)")
                continue
            if row is None:
                continue
            m = REF_RE.match(row["ref"])
            parts = (m.group("recipe"), m.group("variant"), m.group("tag") or "latest")
            own = parse_oci_tag(tag) == parts
            if not own and tag != legacy_oci_tag(*parts):
                continue
            if row["ref"] not in rows or own:
                rows[row["ref"]] = (own, row)
        return sorted((row for _, row in rows.values()), key=lambda r: r["ref"])

    def list_objects(self) -> list[str]:
        return sorted(t[len(OBJ_TAG):] for t in self._tags() if t.startswith(OBJ_TAG) and HEX64.match(t[len(OBJ_TAG):]))

    def delete_object(self, digest: str) -> None:
        """Untag the object and its action records. The registry's own garbage collection frees the blobs."""
        check_digest(digest)
        for key, d in list(self.list_actions()):
            if d == digest:
                self._delete_manifest(KEY_TAG + key)
        self._delete_manifest(OBJ_TAG + digest)

    def _delete_manifest(self, tag: str) -> None:
        resp = self._req(self.client, "HEAD", self._url("manifests", tag), headers={"Accept": OCI_MANIFEST})
        if resp.status_code == 404:
            return
        mdigest = resp.headers.get("Docker-Content-Digest")
        if resp.status_code != 200 or not mdigest:
            raise self._fail(resp, f"look up {tag}")
        resp = self._req(self.client, "DELETE", self._url("manifests", mdigest))
        if resp.status_code not in (200, 202, 404):
            raise self._fail(resp, f"delete {tag} (does the registry allow deletes?)")

    def put_sidecar(self, digest: str, name: str, data: bytes) -> None:
        manifest = self.get_manifest(digest)
        if manifest is None:
            raise self.error(f"cannot attach {name}: object {digest[:12]} is not on this remote")
        self.put_object(digest, Path("."), manifest, sidecars={name: data})

    def get_sidecar(self, digest: str, name: str) -> bytes | None:
        check_digest(digest), check_sidecar(name)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        layer = next((la for la in (oci or {}).get("layers", [])
                      if (la.get("annotations") or {}).get("org.qbuild.sidecar") == name), None)
        return None if layer is None else self._get_blob(layer["digest"], layer["size"],
                                                         f"sidecar {name} of object {digest[:12]}")


def _make_client(host: str, plain_http: bool, backend: str):
    """An oras-py Registry with bounded connect/read timeouts and a short, fast retry policy."""
    from http.cookiejar import DefaultCookiePolicy

    import oras.provider
    import requests

    raw_request = oras.provider.Registry.do_request.__wrapped__  # oras' own 5-attempt, minutes-long retry off

    class Session(requests.Session):
        def request(self, *args, **kwargs):
            kwargs.setdefault("timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
            return super().request(*args, **kwargs)

    class Client(oras.provider.Registry):
        qbuild_basic = False

        def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):
            headers = dict(headers or {})
            if self.qbuild_basic and "Authorization" not in headers:
                headers.update(self.auth.get_auth_header())
            for attempt in range(RETRIES + 1):
                try:
                    resp = raw_request(self, url, method, data, headers, json, stream)
                except (requests.ConnectionError, requests.Timeout):
                    if attempt == RETRIES:
                        raise
                    time.sleep(0.2 * (attempt + 1))
                    continue
                if resp.status_code in (502, 503, 504) and attempt < RETRIES:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                return resp

    client = Client(hostname=host, insecure=plain_http, auth_backend=backend)
    session = Session()
    session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
    client.session = session
    client.auth.session = session
    return client


def _until(chunks: Iterator[bytes], deadline: float, late: Callable[[], Exception]) -> Iterator[bytes]:
    """The chunks of a body until time.monotonic() passes `deadline`; then late() is raised."""
    for chunk in chunks:
        if time.monotonic() > deadline:
            raise late()
        yield chunk


def _head(resp, limit: int) -> bytes:
    """At most `limit` bytes of a streamed response's body; the response is closed."""
    body = bytearray()
    try:
        for chunk in resp.iter_content(min(limit, READ_CHUNK)):
            body += chunk
            if len(body) >= limit:
                break
    finally:
        resp.close()
    return bytes(body[:limit])


def _describe(exc: BaseException) -> str:
    import requests

    if isinstance(exc, requests.ConnectionError):
        errno_text = re.search(r"\[Errno -?\d+\][^'\")]*", str(exc))
        if errno_text:
            return f"connection failed: {errno_text.group(0).strip()}"
        if "Connection aborted" in str(exc) or "RemoteDisconnected" in str(exc):
            return "connection lost (the registry closed the connection)"
        return f"connection failed: {first_line(exc)}"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return f"{type(exc).__name__}: {first_line(exc)}"


__all__ = ["OciRemote", "media_type", "oci_tag", "parse_oci_tag", "legacy_oci_tag", "check_oci_manifest",
           "MODEL_ARTIFACT", "MODEL_CONFIG", "WEIGHT", "WEIGHT_CONFIG", "DOC"]
