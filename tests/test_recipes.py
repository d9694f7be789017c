"""Every shipped recipe is one a conversion would accept, before any GPU time is spent on it.

A recipe is read by ``retrofit convert`` only once the model is loaded and the calibration text tokenized; a typo in a
key, a stage-2 share that does not sum to one, a window past the model's positions or a layer spec that converts
every layer would surface minutes into a run on the GPU. Here each recipe goes through the same parsers the pipeline
uses, against the configuration of the real model the recipe names: SmolLM2-135M (30 layers, 8,192 positions) or
Qwen2.5-Coder-0.5B-Instruct (24 layers, 32,768 positions; its config.json alone, read from the alias's cached
checkpoint, no weights loaded). The recipes of ``recipes/any/`` (no model named) go through them against both, and
against the shapes of Llama-3-8B and Qwen2.5-7B. The tuning history under each model's ``archive/`` is checked the
same way and loads by its old names.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from retrofit.convert.recipe import load_recipe
from retrofit.convert.plan import DistillConfig, Plan
from retrofit.convert.select_settings import SelectSettings
from retrofit.convert.selection import layer_count, parse_layer_spec
from retrofit.layers import LAYER_TYPES, LinearAttentionSpec

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(RECIPES_DIR.rglob("*.yaml"))
ANY_MODEL = "any"  # the folder of recipes that name no model
ANY_MODEL_CONFIGS = ("smollm2-135m", "qwen2.5-0.5b", "llama3-8b", "qwen2.5-7b")


def folder_of(path: Path) -> str:
    """The model folder a recipe lies in (``smollm2-135m`` for ``recipes/smollm2-135m/archive/x.yaml``)."""
    return path.relative_to(RECIPES_DIR).parts[0]


def name_of(path: Path) -> str:
    """The shipped name a recipe loads by: ``MODEL/STEM``, archived or not."""
    return f"{folder_of(path)}/{path.stem}"


def recipe_id(path: Path) -> str:
    return str(path.relative_to(RECIPES_DIR).with_suffix(""))


def test_the_recipes_are_found():
    # the 22 of 2026-12-06 (4 recommended, 18 archived), the lever recipe of 2026-12-07, the 5 Qwen recipes and its
    # lever recipe, and the 2 for any model: a moved folder must not turn this file into no tests
    assert sum(folder_of(path) == "smollm2-135m" for path in RECIPES) >= 23, RECIPES
    assert sum(folder_of(path) == "smollm2-135m" and path.parent.name == "archive" for path in RECIPES) >= 18
    assert sum(folder_of(path) == "qwen2.5-0.5b" for path in RECIPES) >= 6, RECIPES
    assert sum(folder_of(path) == ANY_MODEL for path in RECIPES) >= 2, RECIPES
    assert len({name_of(path) for path in RECIPES}) == len(RECIPES)  # one recipe per name, archived or not


@pytest.fixture(scope="module")
def model_config(request):
    """``model_config(alias)``: the real configuration of the model a recipe names. SmolLM2's is the session's
    loaded checkpoint's (not loaded a second time); Qwen's is read from its cached checkpoint's config.json."""
    from transformers import AutoConfig

    from retrofit.load import reference_checkpoint

    configs = {}

    from retrofit.model_configs import MODEL_CONFIGS

    def config_of(alias: str):
        if alias not in configs:
            if alias == "smollm2-135m":
                configs[alias] = request.getfixturevalue("smollm2")[0].config
            elif alias in ("llama3-8b", "qwen2.5-7b"):
                configs[alias] = MODEL_CONFIGS.get(alias)()
            else:
                configs[alias] = AutoConfig.from_pretrained(reference_checkpoint(alias))
        return configs[alias]

    return config_of


def test_qwen_config_is_the_one_the_recipes_are_written_for(model_config):
    config = model_config("qwen2.5-0.5b")
    assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == ("qwen2", 24, 32768)


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_recipe_is_accepted_by_the_conversion(path: Path, model_config):
    recipe = load_recipe(path)  # unknown keys, bad YAML, an empty file: RetrofitError
    assert load_recipe(name_of(path)) == recipe  # its shipped name finds it, archived or not
    assert recipe.get("model") == (None if folder_of(path) == ANY_MODEL else folder_of(path))
    assert recipe["to"] in LAYER_TYPES
    for model in ANY_MODEL_CONFIGS if folder_of(path) == ANY_MODEL else [recipe["model"]]:
        _check_against(path, recipe, model_config(model))


def _check_against(path: Path, recipe: dict, config_of_model) -> None:
    config = DistillConfig(**{key: value for key, value in recipe.items() if key in DistillConfig.field_names()})
    SelectSettings.from_mapping(recipe.get("select"))
    LinearAttentionSpec.from_dict(recipe.get("layer_spec") or {})
    layers = parse_layer_spec(str(recipe.get("layers") or "every:4"), config_of_model.num_hidden_layers)
    assert layers.needs_scoring or 0 < len(layers.indices) < config_of_model.num_hidden_layers
    converted = layer_count(layers.fraction, config_of_model.num_hidden_layers) if layers.needs_scoring \
        else len(layers.indices)
    named = re.search(r"(\d+)of(\d+)", path.stem)  # kda-12of24: the name says how many of how many layers
    assert named is None or (converted, config_of_model.num_hidden_layers) == tuple(map(int, named.groups()))
    assert config.longest_window <= config_of_model.max_position_embeddings
    config.stage2_curriculum()  # shares > 0 summing to 1, lengths >= 2: ValueError otherwise
    plan = Plan.from_config(config)
    # Whole steps round the budget up: never under it, and over it by less than one step of each phase and stage 1.
    slack = plan.tokens_per_step + sum(phase.tokens_per_step for phase in plan.phases)
    assert config.tokens <= plan.tokens_trained < config.tokens + slack


@pytest.mark.parametrize("path", RECIPES, ids=recipe_id)
def test_recipe_says_how_to_run_itself(path: Path):
    """Each recipe's comment shows the command that converts with it, under its own name (a copied recipe that still
    names its source would send a reader to the wrong file)."""
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    named = re.findall(r"--recipe (\S+)", header)
    assert named and set(named) == {name_of(path)}, named


@pytest.mark.parametrize("model", ["llama3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("recipe", ["any/kda-quarter", "any/kda-half"])
def test_the_recipes_for_any_model_fit_an_80_gb_gpu_at_7_8b(recipe, model):
    """What the README's quickstart converts: planned from the shapes (no weight read), with the recipe's bfloat16
    frozen weights and automatic activation checkpointing, each peak under the 72 GiB a 80 GiB GPU leaves (seen
    2026-12-06: Llama-3-8B 29.75 / 35.55 GiB, Qwen2.5-7B 27.16 / 29.81 GiB for a quarter / a half)."""
    from retrofit.convert.pipeline import plan

    memory = plan(model, recipe=recipe, device="cuda", device_memory="80GiB")
    assert memory.fits and memory.refusal() is None
    assert 20 * 2 ** 30 < memory.peak.peak < 45 * 2 ** 30


def test_the_recommended_recipes_are_their_tuning_chains_written_out():
    """A recommended recipe names every setting (a reader needs no other file); each equals the end of the chain of
    archived recipes it came from, plus the changes its comment names."""
    assert load_recipe("smollm2-135m/kda-8of30-50m-b16") == {
        **load_recipe("smollm2-135m/kda-8of30-30m-1k70"), "tokens": 50_000_000, "batch_size": 16, "grad_accum": 1}
    chain_end = load_recipe("smollm2-135m/kda-15of30-b16")
    assert load_recipe("smollm2-135m/kda-15of30-copyrank") == {
        **chain_end, "tokens": 48_000_000, "select": {**chain_end["select"], "copy_weight": 0.5}}
    for path in RECIPES:  # in a folder with a tuning history, the recipes to pick stand alone
        if (RECIPES_DIR / folder_of(path) / "archive").is_dir() and path.parent.name != "archive":
            assert "base:" not in path.read_text(), path


@pytest.mark.parametrize("folder", sorted({folder_of(path) for path in RECIPES}))
def test_each_recipe_folder_says_which_recipe_to_pick(folder):
    """A README per folder names each recipe at its top (the ones to pick) and what each gives."""
    readme = (RECIPES_DIR / folder / "README.md").read_text()
    for path in sorted((RECIPES_DIR / folder).glob("*.yaml")):
        assert f"`{name_of(path)}`" in readme, (folder, path.stem)


def test_the_lever_recipes_add_the_window_the_cpu_table_chose_to_their_bases():
    """SmolLM2 22 of 30 and Qwen 18 of 24 with a softmax window of 64 keys and 4 sinks inside each converted layer
    (the best row of the CPU table of the levers), every other setting their base recipe's but the layers and
    the token budget."""
    for name, base in (("smollm2-135m/kda-22of30-levers", "smollm2-135m/kda-15of30-copyrank"),
                       ("qwen2.5-0.5b/kda-18of24-levers", "qwen2.5-0.5b/kda-12of24")):
        recipe, inherited = load_recipe(name), load_recipe(base)
        spec = LinearAttentionSpec.from_dict(recipe["layer_spec"])
        assert (spec.window, spec.sink_tokens) == (64, 4), name
        assert set(recipe) - set(inherited) == {"layer_spec"}, name
        kept = set(inherited) - {"layers", "tokens"}
        assert {key: recipe[key] for key in kept} == {key: inherited[key] for key in kept}, name


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_recipe_changes_only_what_it_names_on_its_base(tmp_path):
    _write(tmp_path, "root", "model: smollm2-135m\nto: kda\ntokens: 1000000\nlr_stage2: 3.0e-4\n"
                             "select:\n  align_steps: 60\n  retrieval_weight: 0.5\n")
    child = _write(tmp_path, "child", "base: root\ntokens: 2000000\nselect:\n  retrieval_weight: 0.25\n")
    grandchild = _write(tmp_path, "grandchild", f"base: {child}\nto: gdn\n")  # a path works as well as a name
    assert load_recipe(child) == {"model": "smollm2-135m", "to": "kda", "tokens": 2000000, "lr_stage2": 3.0e-4,
                                  "select": {"align_steps": 60, "retrieval_weight": 0.25}}
    assert load_recipe(grandchild) == {**load_recipe(child), "to": "gdn"}


def test_a_shipped_base_is_found_from_any_folder(tmp_path):
    derived = _write(tmp_path, "mine", "base: smollm2-135m/kda-8of30-50m-b16\ntokens: 8000000\n")
    assert load_recipe(derived) == {**load_recipe("smollm2-135m/kda-8of30-50m-b16"), "tokens": 8000000}
    archived = _write(tmp_path, "older", "base: smollm2-135m/kda-8of30-24m\ntokens: 8000000\n")  # in archive/
    assert load_recipe(archived) == {**load_recipe("recipes/smollm2-135m/archive/kda-8of30-24m.yaml"),
                                     "tokens": 8000000}


def test_a_base_in_the_folders_archive_is_found_by_its_bare_name(tmp_path):
    """A recipe written beside the recommended ones may build on an archived one by its bare name, as before the
    archive existed."""
    (tmp_path / "archive").mkdir()
    _write(tmp_path / "archive", "old", "model: smollm2-135m\nto: gdn\ntokens: 1000\n")
    assert load_recipe(_write(tmp_path, "new", "base: old\nto: kda\n")) == {"model": "smollm2-135m", "to": "kda",
                                                                             "tokens": 1000}


def test_bad_bases_are_refused_in_one_line(tmp_path):
    from retrofit.errors import RetrofitError

    _write(tmp_path, "a", "base: b\ntokens: 1000\n")
    looped = _write(tmp_path, "b", "base: a\n")
    with pytest.raises(RetrofitError, match=r"^recipe .*a\.yaml: base b leads back to .*b\.yaml") as looped_error:
        load_recipe(looped)
    missing = _write(tmp_path, "c", "base: nowhere/none\n")
    with pytest.raises(RetrofitError, match=r"^recipe .*c\.yaml: base recipe nowhere/none not found") as missing_error:
        load_recipe(missing)
    wrong = _write(tmp_path, "d", "base: 3\n")
    with pytest.raises(RetrofitError, match=r"^recipe .*d\.yaml: base must name a recipe, got 3$"):
        load_recipe(wrong)
    assert "\n" not in str(looped_error.value) + str(missing_error.value)
