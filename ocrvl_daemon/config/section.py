"""What every section of the configuration shares: unknown keys refused, empty sections read
as their defaults."""

from __future__ import annotations

from typing import Any, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    """A section of the configuration (or the whole of it)."""

    # Unknown keys are typos until proven otherwise.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_mapping_is_default(cls, data: Any) -> Any:
        """A section or mapping key left empty (`pipeline:` followed only by comments, as
        when config.example.yaml is edited) reads as its defaults, not as a type error."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or not _holds_a_mapping(cls, key)}


def _holds_a_mapping(model: type[BaseModel], key: str) -> bool:
    field = model.model_fields.get(key)
    annotation = field.annotation if field else None
    return get_origin(annotation) is dict or (
        isinstance(annotation, type) and issubclass(annotation, BaseModel))


def named_twice(names: list[Any]) -> Any:
    """The first of `names` named more than once."""
    return next(n for n in names if names.count(n) > 1)

