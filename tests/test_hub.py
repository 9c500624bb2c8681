"""``--model ORG/NAME``: config.json from a fake Hugging Face cache built in tmp_path (never the network)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.clicheck import assert_one_line_error, run, run_json
from zeroplan.architectures.hf_config import read_hf_config
from zeroplan.hub import cached_config, hub_cache_dir, is_hub_name, with_revision
from zeroplan.presets import resolve_model

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
MAIN, OLD = "a" * 40, "b" * 40


def cache_model(cache: Path, repo_id: str, commit: str, config: str, ref: str | None = "main") -> Path:
    """One snapshot as huggingface_hub lays it out: the file in blobs/, a link to it in snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / f"{commit}-config"
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIGS / f"{config}.json", blob)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache holding Org/Tiny at two commits: refs/main -> tiny-llama, tag v0 -> tiny-qwen2 (older)."""
    root = tmp_path / "hub"
    old = cache_model(root, "Org/Tiny", OLD, "tiny-qwen2", ref="v0")
    cache_model(root, "Org/Tiny", MAIN, "tiny-llama")
    os.utime(old, (1, 1))  # the older snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


@pytest.mark.parametrize(
    ("environ", "expected"),
    [  # huggingface_hub 1.33 constants.py: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME
        ({"HF_HUB_CACHE": "/c/hub", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"}, "/c/hub"),
        ({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"}, "/legacy"),
        ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/hub"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
        ({}, os.path.expanduser("~/.cache/huggingface/hub")),
    ],
)
def test_cache_location_follows_huggingface_hub(environ, expected):
    assert hub_cache_dir(environ) == Path(expected)


def test_snapshot_of_refs_main_of_a_tag_and_of_a_commit(cache):
    assert cached_config("Org/Tiny") == cache / "models--Org--Tiny" / "snapshots" / MAIN / "config.json"
    assert cached_config("Org/Tiny@v0").parent.name == OLD  # a tag in refs/
    assert cached_config(f"Org/Tiny@{OLD}").parent.name == OLD  # a commit in snapshots/
    assert resolve_model("Org/Tiny") == read_hf_config(CONFIGS / "tiny-llama.json")
    assert resolve_model("Org/Tiny@v0") == read_hf_config(CONFIGS / "tiny-qwen2.json")


def test_without_refs_the_newest_snapshot(cache):
    (cache / "models--Org--Tiny" / "refs" / "main").unlink()
    assert cached_config("Org/Tiny").parent.name == MAIN  # newer mtime than OLD's
    os.utime(cache / "models--Org--Tiny" / "snapshots" / MAIN, (0, 0))
    assert cached_config("Org/Tiny").parent.name == OLD


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("Org/Missing", "models--Org--Missing/snapshots/<refs/main or newest>"),
        ("Org/Tiny@v9", "models--Org--Tiny/snapshots/v9"),
    ],
)
def test_a_name_not_in_the_cache_is_one_line_saying_where(cache, name, where):
    with pytest.raises(ValueError, match="no config.json in the Hugging Face cache") as info:
        cached_config(name)
    assert str(cache / where) in str(info.value) and "\n" not in str(info.value)


def test_names_paths_and_presets_are_told_apart(tmp_path):
    assert is_hub_name("Qwen/Qwen3-8B") and is_hub_name("meta-llama/Llama-3.1-8B@main")
    assert not is_hub_name("llama2-7b") and not is_hub_name("dir/config.json")
    (tmp_path / "Org").mkdir()
    (tmp_path / "Org" / "Name").write_text("{}")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not is_hub_name("Org/Name")  # an existing path is a path
    finally:
        os.chdir(cwd)


def test_revision_folds_into_the_name():
    assert with_revision("Org/Tiny", "v0") == "Org/Tiny@v0"
    assert with_revision("llama2-7b", None) == "llama2-7b"
    with pytest.raises(ValueError, match="--revision 'v0': needs --model ORG/NAME"):
        with_revision("llama2-7b", "v0")


def test_cli_reads_the_cache_as_it_reads_the_file(cache):
    by_name = run_json("estimate", "--model", "Org/Tiny", "--gpus", "2", "--seq-len", "8")
    by_path = run_json("estimate", "--model", str(CONFIGS / "tiny-llama.json"), "--gpus", "2", "--seq-len", "8")
    assert by_name["inputs"]["psi"] == by_path["inputs"]["psi"] == 47_760  # tiny-llama
    assert by_name["inputs"]["model"] == "Org/Tiny"
    assert [r["peak_bytes"] for r in by_name["stages"]] == [r["peak_bytes"] for r in by_path["stages"]]
    older = run_json("estimate", "--model", "Org/Tiny", "--revision", "v0", "--gpus", "2", "--seq-len", "8")
    assert older["inputs"]["psi"] == 27_632  # tiny-qwen2


def test_cli_refuses_in_one_line(cache):
    assert_one_line_error(run("estimate", "--model", "Org/Missing", "--gpus", "2"), "looked in")
    assert_one_line_error(run("estimate", "--model", "llama2-7b", "--revision", "v0"), "needs --model ORG/NAME")
    cache_model(cache, "deepseek-ai/DeepSeek-Tiny", MAIN, "tiny-deepseek-v3")
    assert_one_line_error(run("estimate", "--model", "deepseek-ai/DeepSeek-Tiny", "--gpus", "2"),
                          "model_type 'deepseek_v3': the reference runtime builds no routed experts")  # fmt: skip
