"""Shared pieces of the config models: the base section class and a ``Field`` helper.

Every field's description ends with its valid range, written from the same numbers pydantic
enforces, so the docs, the YAML template's comments and the error messages never disagree.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """A config section: unknown keys are errors, and NaN/inf are never valid numbers."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_friendly(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        # pydantic reads true as 1; in a config `learning_rate: yes` is a mistake, not 1.0.
        if isinstance(value, bool) and annotation in (int, float):
            kind = "int_type" if annotation is int else "float_type"
            raise PydanticCustomError(kind, "Input should be a number, not a boolean")
        # A YAML section written with no keys (`episode_statistics_config:`) reads as null.
        if value is None and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return {}
        return value


class OpenSection(Section):
    """A section whose extra keys belong to a component selected by name (checked by the core)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# The marker ``setting(ignored=...)`` leaves on a field (its ``json_schema_extra``).
IGNORED = "ignored_because"


def setting(
    default: Any,
    description: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    ignored: str | None = None,
) -> Any:
    """A ``Field`` whose description states the valid range enforced by ``gt/ge/lt/le``.

    ``ignored``: the key is accepted so that MineStudio's configs load unchanged, but nothing reads
    it; the text says why, and ``config.checks.ignored_key_warnings`` warns with it when it is set."""
    text = _range_text(gt=gt, ge=ge, lt=lt, le=le)
    if text:
        description = f"{description} Valid range: {text}."
    extra = {IGNORED: ignored} if ignored else None
    return Field(default, description=description, gt=gt, ge=ge, lt=lt, le=le, json_schema_extra=extra)


def _fmt(number: float) -> str:
    return f"{number:g}"


def _range_text(*, gt: Any = None, ge: Any = None, lt: Any = None, le: Any = None) -> str:
    low = f"{_fmt(gt)} < " if gt is not None else f"{_fmt(ge)} <= " if ge is not None else ""
    high = f" < {_fmt(lt)}" if lt is not None else f" <= {_fmt(le)}" if le is not None else ""
    if low and high:
        return f"{low}x{high}"
    if low:
        return f"{'>' if gt is not None else '>='} {_fmt(gt if gt is not None else ge)}"
    if high:
        return f"{'<' if lt is not None else '<='} {_fmt(lt if lt is not None else le)}"
    return ""


def range_text(info: FieldInfo) -> str:
    """The valid range of a numeric field, like ``0 < x <= 1`` or ``>= 1``; '' when unbounded."""
    bounds: dict[str, Any] = {}
    for item in info.metadata:
        for attr in ("gt", "ge", "lt", "le"):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                bounds[attr] = getattr(item, attr)
    return _range_text(**bounds)


def type_text(annotation: Any) -> str:
    """A short human name of a field's type: ``int``, ``float``, ``str | None``, ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_text(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The model class of a nested section field (unwrapping ``X | None``), else None."""
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
