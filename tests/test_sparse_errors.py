"""Bad input to sparse decoding: one clear RetrofitError each (no model needed), and the CLI's k=v parsing."""
from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from retrofit.errors import RetrofitError
from retrofit.sparse import METHODS, build_method, parse_sparse_args
from retrofit.sparse.methods.seer import SeerGates


def test_unknown_method_suggests_the_closest_name():
    with pytest.raises(RetrofitError, match=r"unknown sparse method 'qest' \(did you mean 'quest'\?\)"):
        build_method("qest", 256)


@pytest.mark.parametrize("name", METHODS.names())
@pytest.mark.parametrize("budget", [0, -5], ids=["zero", "negative"])
def test_non_positive_budget(name, budget):
    with pytest.raises(RetrofitError, match=rf"budget={budget} is invalid"):
        build_method(name, budget)


def test_page_size_must_divide_budget():
    with pytest.raises(RetrofitError, match=r"page_size=48 is invalid: expected a divisor of budget=1000"):
        build_method("quest", 1000, page_size=48)


def test_seer_needs_a_gate_file(tmp_path):
    with pytest.raises(RetrofitError, match=r"gate_path=None is invalid.*retrofit gates"):
        build_method("seer", 256)
    missing = tmp_path / "nothing.gates"
    with pytest.raises(RetrofitError, match=r"does not exist"):
        build_method("seer", 256, gate_path=str(missing))
    junk = tmp_path / "junk.gates"
    junk.write_text("not a gate file")
    with pytest.raises(RetrofitError, match=r"cannot read seer gates, the file is damaged"):
        build_method("seer", 256, gate_path=str(junk))


def test_seer_budget_below_block_size(tmp_path):
    path = tmp_path / "g.gates"
    SeerGates([0, 1], 9, 3, 64, hidden=8, block_size=64).save(path)
    assert not (tmp_path / "g.gates.tmp").exists()  # atomic save leaves no temp file
    with pytest.raises(RetrofitError, match=r"budget=32 is invalid: expected at least the gate block size 64"):
        build_method("seer", 32, gate_path=str(path))
    assert build_method("seer", "128", gate_path=str(path)).block_size == 64


def test_retrieval_without_faiss(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError
    with pytest.raises(RetrofitError, match=r"'retrieval' needs faiss: pip install faiss-cpu"):
        build_method("retrieval", 256)


def test_retrieval_bad_index_and_budget():
    with pytest.raises(RetrofitError, match=r"index='Nope42' is invalid"):
        build_method("retrieval", 256, index="Nope42")
    with pytest.raises(RetrofitError, match=r"budget=60 is invalid: expected more than n_sink \+ window = 68"):
        build_method("retrieval", 60)


def test_streaming_window_and_unknown_parameter():
    with pytest.raises(RetrofitError, match=r"window=300 is invalid"):
        build_method("streaming", 256, window=300)
    with pytest.raises(RetrofitError, match=r"unknown parameter 'page_size' for sparse method 'streaming'"):
        build_method("streaming", 256, page_size=16)
    assert build_method("streaming", 256).window == 252


def test_parse_sparse_args_types_values_by_the_dataclass_fields():
    assert parse_sparse_args(["page_size=8", "dense_layers=0,1,5"], method="quest") == {
        "page_size": 8, "dense_layers": (0, 1, 5)}
    assert parse_sparse_args(["index=HNSW32", "ef_search=64", "nprobe=none"], method="retrieval") == {
        "index": "HNSW32", "ef_search": 64, "nprobe": None}
    raw = parse_sparse_args(["page_size=8"])  # untyped without a method; build_method converts later
    assert raw == {"page_size": "8"} and build_method("quest", "64", **raw).page_size == 8
    assert build_method("quest", 64, dense_layers="").dense_layers == ()
    with pytest.raises(RetrofitError, match=r"--sparse-arg 'page_size' is not of the form key=value"):
        parse_sparse_args(["page_size"])
    with pytest.raises(RetrofitError, match=r"page_size='big' is invalid: expected int"):
        parse_sparse_args(["page_size=big"], method="quest")


def test_cli_generate_rejects_bad_sparse_options_before_loading():
    from retrofit._entry import cli_module

    runner = CliRunner()
    main = cli_module().main
    result = runner.invoke(main, ["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "qest"])
    assert result.exit_code == 2 and "did you mean 'quest'" in result.output
    result = runner.invoke(main, ["generate", "smollm2-135m", "--prompt", "hi", "--sparse", "quest", "--budget", "0"])
    assert result.exit_code == 2 and "budget=0 is invalid" in result.output
    result = runner.invoke(main, ["generate", "smollm2-135m", "--prompt", "hi", "--sparse-arg", "page_size=8"])
    assert result.exit_code == 2 and "--sparse-arg needs --sparse METHOD" in result.output


def test_layers_must_be_softmax_attention_layers(smollm2):
    from retrofit.sparse import sparse_decoding

    model, _ = smollm2
    with pytest.raises(RetrofitError, match=r"layers=\[30\] are not softmax-attention layers of LlamaForCausalLM"):
        with sparse_decoding(model, method="quest", budget=64, layers=[0, 30]):
            pass
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("head_dim, page", [(128, 16), (256, 16), (96, 8), (64, 4), (32, 1), (8, 1)])
def test_quest_page_size_follows_the_head_dimension(head_dim, page):
    # the rule measured at 128 -> 16 (the authors') and 64 -> 4 (SmolLM2); between and beyond, its interpolation
    from retrofit.sparse.methods.quest import default_page_size

    assert default_page_size(head_dim) == page


def test_quest_takes_its_page_size_from_the_model(smollm2):
    from retrofit.sparse import sparse_decoding

    model, _ = smollm2
    with sparse_decoding(model, method="quest", budget=256) as session:
        assert session.method.page_size == 4  # SmolLM2's head_dim is 64
