"""Recipe sections for distribution: `store.remotes` (qbuild/planning/recipe.py StoreConfig) and `register`.

    store:
      path: ./artifacts
      remotes:
        - s3://team-models/qbuild                      # a bare URL: defaults for everything else
        - url: oci://registry.example.com/ml/qbuild
          name: registry
          push: on-success                               # always | on-success | never
        - {url: s3://local-minio/qbuild, endpoint_url: http://127.0.0.1:9000, region: us-east-1}
    register:
      name: "{recipe}-{variant}"                         # one registered model per variant
      alias: champion                                    # set when every gate passes
      variants: [q4km, w4g64]                            # default: every variant

Only non-secret options are allowed here; credentials come from the environment and provider chains.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from qbuild.artifacts.remote.base import RemoteConfigError, split_url
from qbuild.base.schema_base import StrictModel


class RemoteSpec(StrictModel):
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)  # a bad URL may hold a secret

    url: str = Field(description="s3://bucket/prefix, gs://, az://, file:///mnt/share/qbuild, or oci://host/repository. "
                                 "No credentials: they come from AWS_*, the docker config, etc.")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.-]*$", description="Shown in `plan` (hit (remote NAME)).")
    push: Literal["always", "on-success", "never"] = Field(
        "on-success", description="always: after each built step; on-success: when the run succeeded; never: read-only.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph...); or AWS_ENDPOINT_URL.")
    region: str | None = None
    insecure: bool = Field(False, description="Plain HTTP to a non-localhost registry.")
    jobs: int = Field(4, ge=1, le=64, description="Parallel file transfers.")

    @field_validator("url", "endpoint_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            split_url(v)
        except RemoteConfigError as exc:
            raise ValueError(exc.reason) from None
        return v

    @property
    def display_name(self) -> str:
        return self.name or split_url(self.url)[1]

    def open(self):
        from qbuild.artifacts.remote import open_remote

        return open_remote(self.url, name=self.name, endpoint_url=self.endpoint_url, region=self.region,
                           insecure=self.insecure, push=self.push, jobs=self.jobs)


class RegisterSpec(StrictModel):
    name: str = Field("{recipe}-{variant}", description="Registered model name; {recipe} and {variant} are filled in.")
    alias: str | None = Field("champion", pattern=r"^[\w.-]+$", description="Set when every gate passes; null: never.")
    variants: list[str] | None = Field(None, description="Default: every variant.")
    tracking_uri: str | None = Field(None, description="Default: tracking.mlflow.uri, else MLFLOW_TRACKING_URI.")

    def model_name(self, recipe: str, variant: str) -> str:
        return self.name.format(recipe=recipe, variant=variant)


__all__ = ["RemoteSpec", "RegisterSpec"]
