"""Recipe models for text sources, shared by calibration and evaluation datasets."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from qbuild.base.schema_base import StrictModel


class _SourceBase(StrictModel):
    weight: float = Field(1.0, gt=0, description="Relative share of samples drawn from this source in a mix.")


class PyDocsSource(_SourceBase):
    """Offline English text: docstrings of the Python standard library (exists on every machine)."""

    type: Literal["pydocs"]
    split: Literal["train", "test"] = Field(
        "train", description="train and test use disjoint modules, so calibration and evaluation never overlap."
    )


class FileSource(_SourceBase):
    """Local .txt (one document per blank-line-separated block), .jsonl or .parquet."""

    type: Literal["file"]
    path: str
    column: str = Field("text", description="Text column (jsonl/parquet); a 'messages' column is rendered with the chat template.")
    format: Literal["auto", "txt", "jsonl", "parquet"] = "auto"

    @field_validator("path")
    @classmethod
    def _known_extension(cls, v: str) -> str:
        if not v:
            raise ValueError("path must not be empty")
        return v


class HFDatasetSource(_SourceBase):
    """A Hugging Face dataset, loaded with datasets.load_dataset (works whenever it is cached or reachable)."""

    type: Literal["hf"]
    name: str
    config: str | None = None
    split: str = "train"
    column: str = "text"
    revision: str | None = Field(None, description="Pin a dataset revision for reproducibility.")
    data_files: str | list[str] | None = Field(
        None, description="For file-based builders (name: json/parquet/text): local files, relative to the recipe."
    )


DataSource = Annotated[Union[PyDocsSource, FileSource, HFDatasetSource], Field(discriminator="type")]
