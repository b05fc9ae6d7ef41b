"""Rows with images (issue 54): image columns and content-part prompts in jsonl, parquet and hf_disk data,
bad images skipped and counted by row and key, the per-row image limit, and a split that tells pictures apart."""

import io
import json

import pytest
from PIL import Image

from tidal.config import ConfigError, apply_overrides
from tidal.tasks import TASKS
from tidal.tasks.config import FieldMap, TaskConfig
from tidal.tasks.rows import BadRow, numbered, parse_rows, split_eval, to_prompt
from tidal.types import Prompt
from tidal.utils.images import as_data_url, load_image, to_data_url, to_png_bytes
from tidal.utils.seeding import stable_hash

QUESTION = "how many squares?"


def _picture(i: int, size: int = 8) -> Image.Image:
    """A distinct tiny picture per ``i`` (its colour encodes i)."""
    return Image.new("RGB", (size, size), (i % 256, (7 * i) % 256, (13 * i) % 256))


def _task(**overrides):
    cfg = apply_overrides(TaskConfig(), [f"{k}={v}" for k, v in overrides.items()])
    return TASKS.get(cfg.name)(cfg)


def _all(task) -> list[Prompt]:
    return [task.train_prompt(i) for i in range(task.num_train)] + task.eval_prompts()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pixel(url: str) -> tuple:
    return load_image(url).getpixel((0, 0))


def test_jsonl_relative_paths_resolve_beside_the_file_and_become_data_urls(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "imgs").mkdir(parents=True)
    for i in range(6):
        _picture(i).save(data / "imgs" / f"{i}.png")
    rows = [{"prompt": f"q{i}", "answer": str(i), "images": f"imgs/{i}.png"} for i in range(5)]
    rows.append({"prompt": "two", "answer": "2", "images": ["imgs/4.png", "imgs/5.png"]})
    rows.append({"prompt": "text only", "answer": "0"})  # no image column: a text row
    path = _write_jsonl(data / "d.jsonl", rows)
    monkeypatch.chdir(tmp_path)  # the run starts elsewhere: paths still resolve against data/
    prompts = {p.text: p for p in _all(_task(name="jsonl", path=path, num_eval=2))}
    assert all(u.startswith("data:image/png;base64,") for p in prompts.values() for u in p.images)
    assert _pixel(prompts["q3"].images[0]) == _picture(3).getpixel((0, 0))
    assert [_pixel(u) for u in prompts["two"].images] == [_picture(4).getpixel((0, 0)), _picture(5).getpixel((0, 0))]
    assert "images" not in prompts["text only"].meta
    json.dumps([p.meta for p in prompts.values()])  # JSON-safe


def test_jsonl_data_urls_and_a_renamed_column(tmp_path):
    rows = [{"q": QUESTION, "a": str(i), "pic": to_data_url(_picture(i))} for i in range(6)]
    task = _task(name="jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), num_eval=2,
                 **{"fields.prompt": "q", "fields.answer": "a", "fields.images": "pic"})
    prompts = _all(task)
    assert sorted(p.answer for p in prompts) == [str(i) for i in range(6)]
    for p in prompts:
        assert "pic" not in p.meta and _pixel(p.images[0]) == _picture(int(p.answer)).getpixel((0, 0))


def test_a_named_image_column_no_row_has_is_an_error(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(4)]
    with pytest.raises(ConfigError, match=r"task.fields.images='imgae' names a column no row has"):
        _task(name="jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), num_eval=1, **{"fields.images": "imgae"})


def test_parquet_bytes_and_datasets_image_dicts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    jpeg = io.BytesIO()
    _picture(9, 16).save(jpeg, format="JPEG")
    table = pa.table({
        "prompt": [f"q{i}" for i in range(4)],
        "answer": [str(i) for i in range(4)],
        "images": [to_png_bytes(_picture(i)) for i in range(3)] + [jpeg.getvalue()],
        "extra": [{"bytes": to_png_bytes(_picture(20 + i)), "path": None} for i in range(4)],
    })
    pq.write_table(table, tmp_path / "d.parquet")
    prompts = {p.text: p for p in _all(_task(name="parquet", path=tmp_path / "d.parquet", num_eval=1))}
    assert _pixel(prompts["q1"].images[0]) == _picture(1).getpixel((0, 0))
    assert prompts["q3"].images[0].startswith("data:image/jpeg;base64,")  # its own bytes, not re-encoded
    # A struct column in the datasets {"bytes", "path"} form, named as the image column.
    prompts = {p.text: p for p in _all(_task(name="parquet", path=tmp_path / "d.parquet", num_eval=1,
                                             **{"fields.images": "extra", "fields.meta": "[]"}))}
    assert _pixel(prompts["q2"].images[0]) == _picture(22).getpixel((0, 0)) and set(prompts["q2"].meta) == {"images"}


def test_hf_disk_with_an_image_feature(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"question": [QUESTION] * 6, "answer": [str(i) for i in range(6)],
         "image": [{"bytes": to_png_bytes(_picture(i)), "path": None} for i in range(6)]},
        features=datasets.Features({"question": datasets.Value("string"), "answer": datasets.Value("string"),
                                    "image": datasets.Image()}))
    ds.save_to_disk(str(tmp_path / "saved"))
    task = _task(name="hf_disk", path=tmp_path / "saved", num_eval=2,
                 **{"fields.prompt": "question", "fields.images": "image"})
    prompts = _all(task)
    assert (task.num_train, len(task.eval_prompts())) == (4, 2)  # same text, different pictures: none dropped
    for p in prompts:
        assert _pixel(p.images[0]) == _picture(int(p.answer)).getpixel((0, 0)) and "image" not in p.meta


def test_content_part_prompts_give_their_images_in_order_and_their_text(tmp_path):
    (tmp_path / "a.png").write_bytes(to_png_bytes(_picture(1)))
    parts = [{"type": "text", "text": "Compare"},
             {"type": "image_url", "image_url": {"url": to_data_url(_picture(2))}},
             {"type": "image", "image": "a.png"},  # relative to the data file
             {"type": "image"},  # a bare placeholder: the image column's next picture
             {"type": "text", "text": "Which is darker?"}]
    rows = [{"prompt": parts, "answer": "x", "images": [to_data_url(_picture(3)), to_data_url(_picture(4))]},
            {"prompt": [{"type": "text", "text": "plain"}], "answer": "y"}]
    task = _task(name="jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), num_eval=1)
    prompts = {p.answer: p for p in _all(task)}
    assert prompts["x"].text == "Compare\nWhich is darker?"
    assert [_pixel(u) for u in prompts["x"].images] == [_picture(i).getpixel((0, 0)) for i in (2, 1, 3, 4)]
    assert prompts["y"].text == "plain" and prompts["y"].images == []


def test_content_parts_from_parquet_structs_go_by_their_values(tmp_path):
    """Parquet gives each part every struct field, the absent ones None."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    parts = [[{"type": "image_url", "text": None, "image_url": {"url": to_data_url(_picture(i))}},
              {"type": "text", "text": QUESTION, "image_url": None}] for i in range(4)]
    pq.write_table(pa.table({"prompt": parts, "answer": [str(i) for i in range(4)]}), tmp_path / "d.parquet")
    prompts = _all(_task(name="parquet", path=tmp_path / "d.parquet", num_eval=1))
    assert {p.text for p in prompts} == {QUESTION}
    assert all(_pixel(p.images[0]) == _picture(int(p.answer)).getpixel((0, 0)) for p in prompts)


def test_bad_images_are_skipped_counted_and_named(tmp_path):
    good = [{"prompt": f"q{i}", "answer": "1", "images": to_data_url(_picture(i))} for i in range(4)]
    bad = [
        {"prompt": "b1", "answer": "1", "images": "missing.png"},
        {"prompt": "b2", "answer": "1", "images": [to_data_url(_picture(1)), "data:image/png;base64,aGVsbG8="]},
        {"prompt": "b3", "answer": "1", "images": "https://example.com/a.png"},
        {"prompt": [{"type": "text", "text": "b4"}, {"type": "image_url", "image_url": {"url": "nope.jpg"}}],
         "answer": "1"},
        {"prompt": [{"type": "text", "text": "b5"}, {"type": "image"}], "answer": "1"},
        {"prompt": "b6", "answer": "1", "images": 17},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", good + bad)
    with pytest.warns(UserWarning) as record:
        task = _task(name="jsonl", path=path, num_eval=1)
    message = str(record[0].message)
    assert "skipped 6 of 10 rows" in message and task.num_skipped == 6 and task.num_train == 3
    assert f"row 5: 'images': no image file at '{tmp_path / 'missing.png'}'" in message
    assert "row 6: 'images'[1]: unreadable image (5 bytes)" in message
    assert "row 7: 'images': 'https://example.com/a.png' is a remote URL; tidal never downloads" in message
    assert "row 8: 'prompt' content[1]: no image file at" in message
    assert "row 9: 'prompt': content[1]: an image part with no image" in message
    assert "and 1 more" in message


def test_bad_image_names_its_key_on_the_bad_row():
    with pytest.raises(BadRow, match=r"'pic': unreadable image") as info:
        to_prompt({"prompt": "q", "answer": "1", "pic": b"not a png"}, FieldMap(images="pic"), None)
    assert info.value.key == "pic"


def test_a_list_of_chat_messages_is_a_named_bad_row():
    row = {"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "answer": "1"}
    with pytest.raises(BadRow, match=r"'prompt': a list of chat messages; give the user turn's content parts"):
        to_prompt(row, FieldMap(), None)


def test_more_images_than_max_images_is_a_counted_bad_row(tmp_path):
    urls = [to_data_url(_picture(i)) for i in range(3)]
    rows = [{"prompt": f"q{i}", "answer": "1", "images": urls[:2]} for i in range(3)]
    rows.append({"prompt": "many", "answer": "1", "images": urls})
    rows.append({"prompt": [{"type": "image_url", "image_url": {"url": u}} for u in urls] +
                 [{"type": "text", "text": "parts"}], "answer": "1"})
    with pytest.warns(UserWarning) as record:
        task = _task(name="jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), num_eval=1, max_images=2)
    message = str(record[0].message)
    assert "row 4: 'images': 3 images, more than task.max_images=2" in message
    assert "row 5: 'prompt': 3 images, more than task.max_images=2" in message
    assert task.num_skipped == 2
    with pytest.raises(ConfigError, match=r"task.max_images=-1 must be >= 0"):
        parse_rows(numbered(rows), FieldMap(), None, "src", max_images=-1)


def test_split_tells_pictures_apart_and_keeps_text_rows_where_they_were():
    # Every row asks the same question about a different picture: they must not all land on one side.
    pictured = [Prompt("", QUESTION, str(i), {"images": [to_data_url(_picture(i))]}) for i in range(40)]
    train, evals = split_eval(pictured, TaskConfig(eval_fraction=0.5), "src")
    assert 0 < len(evals) < 40 and len(train) + len(evals) == 40  # no training row dropped as an eval's twin
    train, evals = split_eval(pictured, TaskConfig(num_eval=5), "src")
    assert (len(train), len(evals)) == (35, 5)
    # The same picture in another row with the same text is the same problem: it follows its twin.
    twin = Prompt("", QUESTION, "twin", {"images": list(evals[0].images)})
    train, _ = split_eval([*pictured, twin], TaskConfig(num_eval=5), "src")
    assert twin not in train  # held out with it, or dropped as an eval problem's duplicate
    # Text rows hash exactly as before images existed, so their splits do not move.
    texts = [Prompt("", f"{i}+{i}=", str(2 * i)) for i in range(100)]
    cfg = TaskConfig(num_eval=10, seed=3)
    expected = sorted(range(100), key=lambda i: stable_hash(3, "eval", texts[i].text))[:10]
    assert [p.text for p in split_eval(texts, cfg, "src")[1]] == [texts[i].text for i in sorted(expected)]
    cut = 0.3 * 2**63
    expected = [p.text for p in texts if stable_hash(3, "eval", p.text) < cut]
    assert [p.text for p in split_eval(texts, TaskConfig(eval_fraction=0.3, seed=3), "src")[1]] == expected


def test_as_data_url_keeps_encoded_bytes_and_writes_pil_images_as_png():
    png = to_png_bytes(_picture(5))
    assert as_data_url(png) == to_data_url(_picture(5))
    assert as_data_url(_picture(5).convert("L")).startswith("data:image/png;base64,")
    assert as_data_url({"bytes": png, "path": None}) == as_data_url(png)
