"""Variants: what `retrofit eval` and `retrofit bench` compare against the dense model.

A :class:`Variant` has a ``name`` and ``open(model, tokenizer)``, a context manager yielding the model to
evaluate (and undoing whatever it did on exit). Kinds are registered by name in :data:`VARIANT_KINDS` so later
features plug in: ``dense`` (the model as given), ``sparse`` (``retrofit.sparse.sparse_decoding``), ``prefill``
(``retrofit.sparse.sparse_prefill``: block-sparse prefill), ``hybrid``
(a checkpoint loaded with ``retrofit.load``), ``convert`` (the model converted in memory, undistilled: for speed and
memory, e.g. of a random-weight 8B hybrid that has no checkpoint).

Spec strings (``--variant``): ``dense``; ``hybrid:DIR``; ``convert:KIND:LAYERS`` (KIND gdn or kda, LAYERS a
``--layers`` spec without scoring, e.g. ``convert:gdn:not:every:4`` = 3 of 4 layers GDN);
``METHOD:budget=N[,key=value...]`` for sparse decoding, e.g. ``quest:budget=256,page_size=16`` (named
``quest@256,page_size=16``); ``prefill:METHOD[:key=value,...]`` for sparse prefill, e.g.
``prefill:xattention:threshold=0.9`` (named ``prefill:xattention,threshold=0.9``); ``A+B`` composes two, e.g.
``convert:gdn:not:every:4+quest:budget=2048`` (Quest on a converted hybrid's softmax layers) or
``prefill:xattention+quest:budget=1024`` (sparse prefill and sparse decoding in one session).
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from retrofit.cliargs import parse_pairs, split_pairs
from retrofit.errors import RetrofitError
from retrofit.model_files import check_model_dir
from retrofit.registry import Registry


@dataclass(frozen=True)
class Variant:
    """A named way of running the model; ``open(model, tokenizer)`` yields the model to evaluate.

    ``describer`` (optional) checks the variant against the dense model before anything runs (raising
    RetrofitError) and returns facts worth recording, e.g. which layers a conversion replaces.

    ``decode_only``: the variant changes decode steps only and leaves every forward pass over a prompt exactly as it
    was (sparse decoding), so tasks scored by forward passes alone give the dense numbers by construction."""

    name: str
    opener: Callable[[object, object], ContextManager[object]]
    describer: Callable[[object], dict] | None = None
    decode_only: bool = False

    def open(self, model, tokenizer) -> ContextManager[object]:
        return self.opener(model, tokenizer)

    def describe(self, model) -> dict:
        """Validate against ``model`` (the dense model) -> facts about this variant on it ({} if none)."""
        return self.describer(model) if self.describer is not None else {}


VARIANT_KINDS: Registry[Callable[..., Variant]] = Registry("variant kind")


@VARIANT_KINDS.register("dense")
def dense() -> Variant:
    """The model exactly as given."""

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        yield model

    return Variant("dense", opener)


def _sparse_decoding():
    try:
        from retrofit.sparse import sparse_decoding
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("retrofit.sparse"):
            raise RetrofitError("sparse decoding is not available in this install (the module retrofit.sparse "
                                "is missing), so sparse variants cannot run") from None
        raise
    except ImportError as error:
        raise RetrofitError(f"sparse decoding is not available: retrofit.sparse has no sparse_decoding ({error})") \
            from None
    return sparse_decoding


def format_params(params: dict[str, object]) -> str:
    """``k=v,...`` for a variant's column name; a file path shows as its file name to keep the table narrow."""
    def shown(value: object) -> object:
        return Path(value).name if isinstance(value, str) and "/" in value else value

    return ",".join(f"{key}={shown(value)}" for key, value in params.items())


@VARIANT_KINDS.register("sparse")
def sparse(method: str, budget: int, **params) -> Variant:
    """``with retrofit.sparse.sparse_decoding(model, method=method, budget=budget, **params)``."""
    if budget <= 0:
        raise RetrofitError(f"--budget must be a positive number of tokens, got {budget}")
    name = f"{method}@{budget}" + (f",{format_params(params)}" if params else "")

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        with _sparse_decoding()(model, method=method, budget=budget, **params):
            yield model

    return Variant(name, opener, decode_only=True)


@VARIANT_KINDS.register("prefill")
def prefill(method: str, **params) -> Variant:
    """``with retrofit.sparse.sparse_prefill(model, method=method, **params)``: the prompt's attention block-sparse
    (it changes forward passes over prompts, so no task is dense by construction)."""
    from retrofit.sparse.prefill import build_prefill_method, prefill_layers

    build_prefill_method(method, **params)  # a bad method or parameter fails at parse time
    name = f"prefill:{method}" + (f",{format_params(params)}" if params else "")

    def describer(model) -> dict:
        return {"prefill_method": method, "prefill_layers": prefill_layers(model)}

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        from retrofit.sparse.prefill import sparse_prefill

        with sparse_prefill(model, method=method, **params):
            yield model

    return Variant(name, opener, describer)


@VARIANT_KINDS.register("hybrid")
def hybrid(path: str) -> Variant:
    """A hybrid checkpoint directory, loaded with ``retrofit.load`` on the dense model's device and dtype."""
    directory = Path(path)
    if directory.is_file():
        raise RetrofitError(f"--hybrid {path}: is a file, not a hybrid checkpoint directory")
    if not directory.is_dir():
        raise RetrofitError(f"--hybrid {path}: no such directory")
    try:
        config = check_model_dir(directory)  # a damaged or non-model directory fails before dense runs
    except RetrofitError as error:
        raise RetrofitError(f"--hybrid {path}: {error}") from None
    if "retrofit" not in config:
        raise RetrofitError(f"--hybrid {path}: not a hybrid checkpoint (its config.json has no retrofit section; "
                            "evaluate a dense model as MODEL)")

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        from retrofit.load import load

        parameter = next(model.parameters())
        try:
            loaded, _ = load(str(directory), dtype=parameter.dtype, device=parameter.device)
        except (ModuleNotFoundError, NotImplementedError) as error:
            raise RetrofitError(f"--hybrid {path}: hybrid checkpoints cannot be loaded in this install ({error})") \
                from None
        try:
            yield loaded
        finally:
            del loaded
            gc.collect()

    return Variant(f"hybrid:{directory.name}", opener)


@VARIANT_KINDS.register("convert")
def convert(layer_type: str, layers: str) -> Variant:
    """The dense model with the ``layers`` (a ``--layers`` spec: list, ``every:K``, ``not:SPEC``) replaced by fresh
    ``layer_type`` (gdn/kda) layers initialised from their attention weights, built in memory by
    :func:`retrofit.convert.build.to_hybrid` on the dense model's device and dtype.

    The hybrid shares every other weight with the dense model (no copy), so only the new layers' weights are added;
    they are released once the caller drops the yielded model. Nothing is distilled: the outputs are not
    meaningful, the speed and memory are."""
    from retrofit.layers import LAYER_TYPES

    layer_type, layers = layer_type.strip(), layers.strip().replace(" ", "")
    name = f"convert:{layer_type}:{layers}"
    try:
        LAYER_TYPES.get(layer_type)
    except RetrofitError as error:
        raise RetrofitError(f"--variant {name}: {error}") from None

    def converted_layers(model) -> list[int]:
        from retrofit.convert.selection import parse_layer_spec, sliding_layers_of
        from retrofit.hybrid import check_base_type

        try:
            check_base_type(model.config.model_type)
            parsed = parse_layer_spec(layers, model.config.num_hidden_layers, sliding_layers_of(model.config))
        except RetrofitError as error:  # the layer spec's own words name convert's flag, not this one
            raise RetrofitError(f"--variant {name}: {str(error).replace('bad --layers ', 'layers ', 1)}") from None
        if parsed.needs_scoring:
            raise RetrofitError(f"--variant {name}: a scored fraction needs calibration data; name the layers "
                                "(0,2,4, every:K or not:SPEC) or convert with `retrofit convert`")
        return list(parsed.indices)

    def describer(model) -> dict:
        chosen = converted_layers(model)
        return {"layer_type": layer_type, "converted_layers": chosen, "num_layers": model.config.num_hidden_layers}

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        from retrofit.convert.build import to_hybrid
        from retrofit.hybrid import HybridSection

        section = HybridSection(layers=converted_layers(model), layer_type=layer_type,
                                base_model_type=model.config.model_type)
        yield to_hybrid(model, section, share_weights=True)  # freed once the caller drops it (run_bench collects)

    return Variant(name, opener, describer)


def composed(outer: Variant, inner: Variant) -> Variant:
    """``inner`` opened on the model ``outer`` yields (e.g. sparse decoding on a converted hybrid), named
    ``OUTER+INNER``; both are checked against the dense model."""

    @contextlib.contextmanager
    def opener(model, tokenizer) -> Iterator[object]:
        with outer.open(model, tokenizer) as first, inner.open(first, tokenizer) as second:
            yield second

    def describer(model) -> dict:
        return {**inner.describe(model), **outer.describe(model)}

    return Variant(f"{outer.name}+{inner.name}", opener, describer)


def parse_variant_spec(spec: str) -> Variant:
    """A ``--variant`` string: ``dense``, ``hybrid:DIR``, ``convert:KIND:LAYERS``, ``prefill:METHOD[:key=value,...]``,
    ``METHOD:budget=N[,key=value...]``, or ``A+B`` (variant B opened on what variant A yields)."""
    if "+" in spec:
        outer, _, inner = spec.partition("+")
        return composed(parse_variant_spec(outer), parse_variant_spec(inner))
    head, _, rest = spec.partition(":")
    head = head.strip()
    if head == "dense" and not rest:
        return dense()
    if head == "hybrid":
        if not rest:
            raise RetrofitError(f"--variant {spec!r}: expected hybrid:DIR")
        return hybrid(rest)
    if head == "convert":
        layer_type, _, layers = rest.partition(":")
        if not layer_type.strip() or not layers.strip():
            raise RetrofitError(f"--variant {spec!r}: expected convert:KIND:LAYERS, e.g. convert:gdn:not:every:4")
        return convert(layer_type, layers)
    if head == "prefill":
        method, _, pairs = rest.partition(":")
        if not method.strip():
            raise RetrofitError(f"--variant {spec!r}: expected prefill:METHOD[:key=value,...], e.g. "
                                "prefill:xattention:threshold=0.9")
        return prefill(method.strip(), **parse_pairs(split_pairs(pairs), f"--variant {spec!r}:"))
    if not head:
        raise RetrofitError(f"--variant {spec!r}: expected METHOD:budget=N[,key=value...]")
    params = parse_pairs(split_pairs(rest), f"--variant {spec!r}:")
    try:
        budget = int(params.pop("budget", ""))
    except ValueError:
        raise RetrofitError(f"--variant {spec!r}: sparse variants need an integer budget, e.g. {head}:budget=1024") \
            from None
    return sparse(head, budget, **params)


def variants_from_options(sparse_methods: list[str], budgets: list[int], sparse_args: list[str],
                          hybrid_dirs: list[str], specs: list[str], prefill_methods: list[str] = (),
                          prefill_args: list[str] = ()) -> list[Variant]:
    """The variants (besides dense) named on the command line, in order: sparse x budgets, sparse prefill methods
    (each with the ``--prefill-arg`` pairs), hybrids, specs. Duplicate names are a user error."""
    if budgets and not sparse_methods:
        raise RetrofitError("--budget needs --sparse METHOD")
    if sparse_methods and not budgets:
        raise RetrofitError("--sparse needs at least one --budget N")
    if sparse_args and not sparse_methods:
        raise RetrofitError("--sparse-arg needs --sparse METHOD")
    if prefill_args and not prefill_methods:
        raise RetrofitError("--prefill-arg needs --prefill METHOD")
    params = parse_pairs(sparse_args, "--sparse-arg")
    variants = [sparse(method, budget, **params) for method in sparse_methods for budget in budgets]
    prefill_params = parse_pairs(prefill_args, "--prefill-arg")
    variants += [prefill(method, **prefill_params) for method in prefill_methods]
    variants += [hybrid(path) for path in hybrid_dirs]
    variants += [parse_variant_spec(spec) for spec in specs]
    names = [variant.name for variant in variants]
    for name in names:
        if name == "dense" or names.count(name) > 1:
            raise RetrofitError(f"variant {name!r} is given twice (dense always runs first)")
    return variants
