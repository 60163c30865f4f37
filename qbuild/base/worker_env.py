"""What a step's worker may see of qbuild's environment: an allow-list, never the whole environment.

No worker talks to a remote store, a registry or MLflow (the executor does that), so no worker needs AWS_*,
MLFLOW_TRACKING_PASSWORD or QBUILD_REGISTRY_PASSWORD; a library that logs its environment, or a plugin that
phones home, then has nothing to leak. What a worker gets:
- the process basics (PATH, HOME, locale, TMPDIR, PYTHON*), thread and BLAS settings, CUDA/torch settings,
  the model caches' locations (HF_HOME, XDG_*), CA bundles, and qbuild's own non-secret QBUILD_* settings;
- per step kind, what that kind needs on top: only the steps that may download a data set from a hub
  (calibration and evaluation text with `type: hf`) get HF_TOKEN and the proxy settings (HTTPS_PROXY,
  HTTP_PROXY, ALL_PROXY, NO_PROXY, upper and lower case: a proxy URL may hold a password), and they reach the
  hub only where HF_HUB_OFFLINE is off.
A name that looks like a credential (…PASSWORD, …TOKEN, …SECRET…, …_KEY, …CREDENTIAL…) is dropped even when
a pattern above matches it, unless its step kind names it exactly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fnmatch import translate

ALLOWED = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
    "PYTHON*", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "COVERAGE_*",
    # threads and math libraries (OPENBLAS_CORETYPE keeps old OpenBLAS builds correct on some CPUs)
    "OMP_*", "MKL_*", "OPENBLAS_*", "GOTO_NUM_THREADS", "KMP_*", "NUMEXPR_*", "BLIS_*", "VECLIB_*",
    # accelerators and the libraries that run on them
    "CUDA_*", "NVIDIA_*", "CUDNN_*", "NCCL_*", "TORCH_*", "PYTORCH_*", "TORCHINDUCTOR_*", "TRITON_*", "TRTLLM_*",
    "TLLM_*", "TRT_*", "VLLM_*", "GGML_*", "LLAMA_*",
    # where models and data sets are cached, and whether the hub may be reached
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_*", "HF_HUB_DISABLE_*", "HF_ASSETS_CACHE",
    "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_*", "TOKENIZERS_PARALLELISM", "SAFETENSORS_*", "ACCELERATE_*",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "QBUILD_*",
)
# never to a worker, whatever matches above: credentials and where to find them
SECRET = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|_KEY$|_KEY_|APIKEY|AUTH)", re.IGNORECASE)
DENIED = ("QBUILD_REGISTRY_*", "QBUILD_SIGNING_KEY", "QBUILD_REMOTE", "QBUILD_STORE")
# each list as one pattern (fnmatchcase one name against every entry was 1-3 ms per step)
_ALLOWED = re.compile("|".join(translate(p) for p in ALLOWED))
_DENIED = re.compile("|".join(translate(p) for p in DENIED))

# steps that may read a data set from a hub (datasets.load_dataset) when the user turned HF_HUB_OFFLINE off
HUB_TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT")
PROXIES = tuple(n for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY") for n in (name, name.lower()))
HUB_ACCESS = HUB_TOKENS + PROXIES
EXTRA_BY_KIND: dict[str, tuple[str, ...]] = {"calibrate": HUB_ACCESS, "eval-data": HUB_ACCESS}


def step_environ(kind: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` a worker for a step of `kind` gets (None: a standby worker, kind unknown yet)."""
    extra = set(EXTRA_BY_KIND.get(kind or "", ()))
    out = {}
    for name, value in environ.items():
        allowed = _ALLOWED.match(name) is not None and not SECRET.search(name) and _DENIED.match(name) is None
        if allowed or name in extra:
            out[name] = value
    return out


__all__ = ["step_environ", "ALLOWED", "EXTRA_BY_KIND"]
