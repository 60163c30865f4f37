"""A remote in any OCI distribution registry: oci://host[:port]/repository (through oras-py).

Layout (docs/remote-stores.md, "OCI layout"):
  each object     one OCI image manifest following the CNCF ModelPack spec: artifactType
                  application/vnd.cncf.model.manifest.v1+json, a application/vnd.cncf.model.config.v1+json
                  config (descriptor, config.format/precision/quantization, modelfs.diff_ids), one layer
                  per file (ModelPack .raw media types, digest = the file's sha256 from our manifest,
                  title annotation = its relative path), plus qbuild's manifest.json as a doc layer and
                  the sidecars (model card README.md, .qbuild/<name>) as doc layers. Provenance summary in
                  org.qbuild.* annotations. Tagged `_obj-<digest>`.
  refs            the same manifest, tagged `<recipe>-<variant>-<tag>` (org.qbuild.ref names the ref)
  action records  a small artifact (artifactType application/vnd.qbuild.action.v1+json, one JSON layer)
                  tagged `_key-<step key>`; pushed last, after every blob and the object's manifest.
Reserved tags start with `_`, which recipe names cannot, so they never collide with refs.
A plain `oras pull host/repo:<recipe>-<variant>-<tag>` gets the files, manifest.json and README.md.

Credentials: the docker config ($DOCKER_CONFIG/config.json or ~/.docker/config.json, including
credHelpers/credsStore), or QBUILD_REGISTRY_USERNAME / QBUILD_REGISTRY_PASSWORD. Never stored.
Plain HTTP for localhost/127.0.0.1/::1; other hosts use HTTPS unless the remote sets `insecure: true`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from qbuild.artifacts.remote import remotes
from qbuild.artifacts.remote.base import (
    CHUNK,
    HEX64,
    MANIFEST,
    Progress,
    RemoteConfigError,
    RemoteError,
    RemoteStore,
    bounded_json,
    check_digest,
    check_name,
    check_sidecar,
    remote_record,
)
from qbuild.artifacts.store import REF_RE, now_iso
from qbuild.errors import first_line

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


def oci_tag(recipe: str, variant: str, tag: str) -> str:
    return f"{recipe}-{variant}-{tag}"[:128]


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
        from urllib.parse import urlsplit

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
            r = probe.get(f"{prefix}://{self.host}/v2/", timeout=(CONNECT_TIMEOUT, 30))
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

    def _fail(self, resp, what: str):
        detail = ""
        try:
            errs = resp.json().get("errors") or []
            detail = "; ".join(str(e.get("code", "")) + ": " + str(e.get("message", "")) for e in errs)[:200]
        except Exception:
            pass
        if resp.status_code in (401, 403):
            return self.error(f"{what}: access denied (HTTP {resp.status_code}): wrong credentials or no permission")
        return self.error(f"{what}: HTTP {resp.status_code}" + (f" ({detail})" if detail else ""))

    # --- manifests and blobs -------------------------------------------------------------------------------
    def _get_oci_manifest(self, ref: str) -> tuple[dict | None, str | None]:
        resp = self._req(self.client, "GET", self._url("manifests", ref), headers={"Accept": OCI_MANIFEST})
        if resp.status_code == 404:
            return None, None
        if resp.status_code != 200:
            raise self._fail(resp, f"get manifest {ref}")
        try:
            data = bounded_json(resp.content, f"manifest {ref}")
        except ValueError as exc:
            raise self.error(f"manifest {ref} is not a valid OCI manifest: {first_line(exc)}") from None
        if not isinstance(data, dict):
            raise self.error(f"manifest {ref} is not a JSON object")
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

    def _get_blob(self, digest: str) -> bytes | None:
        try:
            resp = self.client.get_blob(self._container(), digest)
        except Exception as exc:
            raise self.error(f"get blob {digest[:19]} failed: {_describe(exc)}") from None
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"get blob {digest[:19]}")
        data = resp.content
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise self.error(f"blob {digest[:19]} is corrupt on the registry")
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
        tags: list[str] = []
        url = self._url("tags", "list") + "?n=1000"
        for _ in range(10000):
            resp = self._req(self.client, "GET", url)
            if resp.status_code == 404:
                return tags
            if resp.status_code != 200:
                raise self._fail(resp, "list tags")
            try:
                listing = bounded_json(resp.content, "the tag list")
            except ValueError as exc:
                raise self.error(f"the tag list is not valid: {first_line(exc)}") from None
            found = listing.get("tags") if isinstance(listing, dict) else None
            tags += [t for t in found or [] if isinstance(t, str)]
            link = resp.links.get("next", {}).get("url")
            if not link:
                break
            prefix = "http" if self.plain_http else "https"
            url = link if link.startswith("http") else f"{prefix}://{self.host}{link}"
        return tags

    def _read_manifest(self, digest: str) -> dict | None:
        check_digest(digest)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        if oci is None:
            return None
        layer = next((la for la in oci.get("layers", []) if (la.get("annotations") or {}).get(ROLE) == "manifest"), None)
        if layer is None:
            return None
        data = self._get_blob(layer["digest"])
        if data is None:
            return None
        try:
            manifest = bounded_json(data, f"the manifest of {digest[:12]}")
        except ValueError as exc:
            raise self.error(f"object {digest[:12]}: manifest is not valid: {first_line(exc)}") from None
        return manifest if isinstance(manifest, dict) else None

    def has_object(self, digest: str) -> bool:
        check_digest(digest)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        # the registry accepts a manifest only when every blob it names is present
        return oci is not None and (oci.get("annotations") or {}).get("org.qbuild.digest") == digest

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
            "org.qbuild.core.recipe": recipe, "org.qbuild.variant": manifest.get("variant"),
            "org.qbuild.format": manifest.get("format"), "org.opencontainers.image.created": manifest.get("created"),
        }.items() if v}
        return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": MODEL_ARTIFACT, "config": cdesc,
                "layers": layers, "annotations": annotations}

    def put_object(self, digest: str, local_dir: Path, manifest: dict, progress: Progress | None = None,
                   sidecars: dict[str, bytes] | None = None) -> None:
        files = self._push_files(digest, manifest)
        existing, _ = self._get_oci_manifest(OBJ_TAG + digest)
        side = {d["annotations"]["org.qbuild.sidecar"]: d for d in (existing or {}).get("layers", [])
                if (d.get("annotations") or {}).get(ROLE) == "sidecar"}
        if existing is None:
            def put(src: Path, f: dict) -> None:
                self._push_file(src, {"mediaType": media_type(f["path"]), "digest": "sha256:" + f["sha256"],
                                      "size": f["size"], "annotations": {TITLE: f["path"]}})

            self._upload_files(local_dir, files, lambda f: self._blob_exists("sha256:" + f["sha256"], f["size"]),
                               put, progress)
        elif not sidecars:
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
        check_digest(key)
        oci, _ = self._get_oci_manifest(KEY_TAG + key)
        if oci is None or oci.get("artifactType") != ACTION_ARTIFACT or not oci.get("layers"):
            return None
        data = self._get_blob(oci["layers"][0]["digest"])
        try:
            record = remote_record(bounded_json(data, f"action record {key[:12]}") if data else None, key)
        except ValueError:
            record = None
        if record is None:
            return None
        if not self.has_object(record["digest"]):
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
                oci, _ = self._get_oci_manifest(tag)
                d = ((oci or {}).get("annotations") or {}).get("org.qbuild.digest")
                if remote_record({"digest": d}) and HEX64.match(tag[len(KEY_TAG):]):
                    yield tag[len(KEY_TAG):], d

    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str | None = None,
                annotations: dict[str, str] | None = None) -> None:
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        check_digest(digest)
        oci, _ = self._get_oci_manifest(OBJ_TAG + digest)
        if oci is None:
            raise self.error(f"cannot tag {recipe}/{variant}:{tag}: object {digest[:12]} is not on this remote")
        oci = dict(oci)
        oci["annotations"] = {**(oci.get("annotations") or {}), "org.qbuild.ref": f"{recipe}/{variant}:{tag}",
                              "org.qbuild.ref.updated": now_iso(), **({"org.qbuild.key": key} if key else {}),
                              **{k: str(v) for k, v in (annotations or {}).items()}}
        self._put_oci_manifest(oci_tag(recipe, variant, tag), oci)

    def _ref_from(self, oci: dict | None, ref: str | None = None) -> dict | None:
        ann = (oci or {}).get("annotations") or {}
        if not isinstance(ann, dict) or not ann.get("org.qbuild.ref") or (ref and ann["org.qbuild.ref"] != ref) \
                or remote_record({"digest": ann.get("org.qbuild.digest"), "key": ann.get("org.qbuild.key")}) is None \
                or not REF_RE.match(str(ann["org.qbuild.ref"])):
            return None
        return {"ref": ann["org.qbuild.ref"], "digest": ann["org.qbuild.digest"], "key": ann.get("org.qbuild.key"),
                "updated": ann.get("org.qbuild.ref.updated")}

    def get_ref(self, recipe: str, variant: str, tag: str = "latest") -> dict | None:
        check_name("recipe", recipe), check_name("variant", variant), check_name("tag", tag)
        oci, _ = self._get_oci_manifest(oci_tag(recipe, variant, tag))
        return self._ref_from(oci, f"{recipe}/{variant}:{tag}")

    def list_refs(self) -> list[dict]:
        out = []
        for tag in self._tags():
            if not tag.startswith("_"):
                row = self._ref_from(self._get_oci_manifest(tag)[0])
                if row:
                    out.append(row)
        return sorted(out, key=lambda r: r["ref"])

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
        return None if layer is None else self._get_blob(layer["digest"])


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


__all__ = ["OciRemote", "media_type", "oci_tag", "MODEL_ARTIFACT", "MODEL_CONFIG", "WEIGHT", "WEIGHT_CONFIG", "DOC"]
