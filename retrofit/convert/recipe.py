"""Recipes: YAML files naming a conversion's settings, found by path or by a shipped name, one able to start from
another (``base:``) and name only what it changes.

    # recipes/smollm2-135m/archive/kda-15of30-b16-long.yaml
    base: kda-15of30-b16          # a recipe in the same folder, a path, or a shipped name like smollm2-135m/cpu-small
    tokens: 30000000
    stage2_lengths: "1024:0.5,4096:0.3,8192:0.2"

A recipe's own keys replace its base's; ``select`` and ``layer_spec`` (mappings) replace key by key, so that a recipe
may change one scorer setting and keep the others.
"""
from __future__ import annotations

import os
from pathlib import Path

from retrofit.errors import RetrofitError

RECIPE_KEYS = {"model", "to", "layers", "data", "tokens", "layer_spec", "device", "select"}
MAPPING_KEYS = ("select", "layer_spec")


def load_recipe(path: str | os.PathLike | None) -> dict:
    """A recipe YAML -> dict of its settings, its ``base:`` chain applied. Keys: model, to, layers, data, tokens, any
    DistillConfig field, ``layer_spec`` (LinearAttentionSpec fields) and ``select`` (scored-selection settings:
    SelectSettings fields). A bare name such as ``smollm2-135m/cpu-small`` resolves to the recipes shipped with
    retrofit. Raises RetrofitError, naming the file, on a missing recipe, bad YAML, an unknown key, or a base chain
    that leads back to itself."""
    if path is None:
        return {}
    return _settings_of(find_recipe(path), chain=())


ARCHIVE = "archive"
"""The folder, inside a model's recipe folder, of the recipes that led to the recommended ones (the tuning history):
they load by their own name as before, e.g. ``smollm2-135m/kda-8of30-24m``."""


def find_recipe(name: str | os.PathLike, relative_to: Path | None = None) -> Path:
    """The YAML file that ``name`` means: a file (tried beside ``relative_to`` first, the folder of the recipe naming
    it as its base, with or without ``.yaml``, then in that folder's :data:`ARCHIVE`), else a recipe shipped with
    retrofit (``MODEL/NAME``, found in ``recipes/MODEL/`` or ``recipes/MODEL/archive/``)."""
    tried = []
    if relative_to is not None:
        tried += [relative_to / str(name), relative_to / f"{name}.yaml", relative_to / ARCHIVE / f"{name}.yaml"]
    tried.append(Path(name))
    for candidate in tried:
        if candidate.is_file():
            return candidate
    folder, _, stem = str(name).rpartition("/")
    for relative in [f"{name}.yaml"] + ([f"{folder}/{ARCHIVE}/{stem}.yaml"] if folder else []):
        shipped = _shipped(relative)
        if shipped is not None:
            return shipped
    raise RetrofitError(f"recipe {name} not found (a YAML file, or a shipped name like smollm2-135m/cpu-small)")


def _shipped(relative: str) -> Path | None:
    """``recipes/RELATIVE`` of the source checkout, else of the installed package; None if neither has it."""
    shipped = Path(__file__).resolve().parents[2] / "recipes" / relative  # source checkout
    if not shipped.is_file():
        try:  # installed package
            from importlib.resources import files

            shipped = Path(str(files("retrofit.recipes").joinpath(relative)))
        except (ImportError, TypeError, ValueError):
            return None
    return shipped if shipped.is_file() else None


def _settings_of(path: Path, chain: tuple[Path, ...]) -> dict:
    import yaml

    from retrofit.convert.plan import DistillConfig

    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RetrofitError(f"recipe {path}: invalid YAML ({str(err).splitlines()[0]})") from None
    if values is None:  # an empty file (a truncated copy, a failed substitution) would convert on every default
        raise RetrofitError(f"recipe {path}: empty (no settings)")
    if not isinstance(values, dict):
        raise RetrofitError(f"recipe {path}: expected a mapping of settings")
    unknown = set(values) - RECIPE_KEYS - {"base"} - set(DistillConfig.field_names())
    if unknown:
        raise RetrofitError(f"recipe {path}: unknown key(s) {', '.join(sorted(unknown))}")
    base = values.pop("base", None)
    if base is None:
        return values
    if not isinstance(base, str) or not base:
        raise RetrofitError(f"recipe {path}: base must name a recipe, got {base!r}")
    here = path.resolve()
    try:
        base_path = find_recipe(base, relative_to=path.parent)
    except RetrofitError as err:
        raise RetrofitError(f"recipe {path}: base {err}") from None
    if base_path.resolve() in (*chain, here):
        raise RetrofitError(f"recipe {path}: base {base} leads back to {base_path} (a recipe cannot build on itself)")
    return merged(_settings_of(base_path, (*chain, here)), values)


def merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` applied: keys replaced, except the mappings of :data:`MAPPING_KEYS`, updated key by
    key."""
    result = dict(base)
    for key, value in changes.items():
        if key in MAPPING_KEYS and isinstance(value, dict) and isinstance(base.get(key), dict):
            result[key] = {**base[key], **value}
        else:
            result[key] = value
    return result
