"""A vision-language prompt's images in samples.jsonl and on the inspector page (issue 54): stored once per
record as PNG data URLs (a downscaled copy past ``THUMB_SIDE``), shown beside the prompt's tokens with each run
of ``<|image_pad|>`` as one chip; a text prompt's record is byte-for-byte what it was; a bad image is an error
entry and a count, never a crash of the run's recording. An agent episode's observation pictures
(``Trajectory.images`` past the prompt's) are stored once per sample and drawn after their chips in its token view;
a single-turn image sample's record is byte-for-byte what it was."""

import json
import logging
import shutil

import pytest
from PIL import Image

from tests.vlm_support import BOARD, SEEN
from tidal.inspector.page import load_run, write_inspector
from tidal.inspector.record import THUMB_SIDE, SampleRecorder, image_entry, prompt_record, sample_record, token_texts
from tidal.inspector.samples import SampleLog, SampleLogConfig, read_samples
from tidal.models import vlm
from tidal.types import Group, Prompt, Trajectory
from tidal.utils.images import load_image, to_data_url

IMAGE_PAD = vlm.IMAGE_PAD


@pytest.fixture(scope="module")
def tokenizer():
    return vlm.build_vlm_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return vlm.build_processor(vlm.VLMConfig(), tokenizer)


def squares(size=(56, 56)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste((200, 30, 30), (5, 5, 20, 20))
    image.paste((30, 30, 200), (30, 28, 50, 51))
    return image


def group(prompt: Prompt, prompt_ids: list[int], tokenizer, n: int = 3) -> Group:
    trajs = []
    for k in range(n):
        ids = tokenizer.encode(str(k + 1), add_special_tokens=False)
        trajs.append(Trajectory(prompt.uid, k, list(prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), "stop",
                                text=str(k + 1), reward=float(k == 1)))
    return Group(prompt, trajs)


def record(tmp_path, groups, tokenizer, step=1):
    """``groups`` recorded as a step's batch (none trained), read back through the reader."""
    recorder = SampleRecorder(SampleLog(tmp_path / "samples.jsonl", 100.0), SampleLogConfig(every=1, groups=8),
                              tokenizer, "count_squares")
    recorder.record_train(step, step - 1, groups, None, None)
    records, skipped = read_samples(tmp_path / "samples.jsonl")
    assert skipped == 0
    return recorder, records


def vision_prompt(processor, images, uid="p0", text="How many squares?"):
    ids = vlm.encode_prompt(processor, text, images)["input_ids"][0].tolist()
    return Prompt(uid, text, "2", {"images": list(images)}), ids


def test_a_groups_image_is_stored_once_and_decodes_to_the_same_pixels(tmp_path, tokenizer, processor):
    image = squares()
    prompt, ids = vision_prompt(processor, [to_data_url(image)])  # as count_squares stores it
    recorder, (rec,) = record(tmp_path, [group(prompt, ids, tokenizer)], tokenizer)
    assert recorder.bad_images == 0
    (entry,) = rec["prompt"]["images"]
    assert entry["width"] == entry["height"] == 56 and "thumbnail" not in entry
    assert entry["url"].startswith("data:image/png;base64,")
    assert load_image(entry["url"]).tobytes() == image.tobytes()
    # the prompt's tokens, aligned with its ids: the processor widened the placeholder to 4 image tokens (56x56)
    assert rec["prompt"]["tokens"] == token_texts(tokenizer, ids) and len(rec["prompt"]["tokens"]) == len(ids)
    assert rec["prompt"]["tokens"].count(IMAGE_PAD) == 4
    # once per record (the group's three samples share it), not once per sample
    line = (tmp_path / "samples.jsonl").read_text()
    assert line.count("data:image/png") == 1 and len(rec["samples"]) == 3
    assert all("images" not in s for s in rec["samples"])


def test_every_form_load_image_reads_is_stored_as_a_png_data_url(tmp_path, tokenizer, processor):
    image = squares()
    path = tmp_path / "squares.png"
    image.save(path)
    jpeg = tmp_path / "squares.jpg"
    image.save(jpeg, quality=95)
    forms = [image, str(path), path.read_bytes(), {"bytes": path.read_bytes(), "path": None}, str(jpeg)]
    prompt, ids = vision_prompt(processor, forms)
    (tmp_path / "out").mkdir()
    _, (rec,) = record(tmp_path / "out", [group(prompt, ids, tokenizer)], tokenizer)
    entries = rec["prompt"]["images"]
    assert [e["url"][:22] for e in entries] == ["data:image/png;base64,"] * 5
    for e in entries[:4]:  # lossless sources: the same pixels
        assert load_image(e["url"]).tobytes() == image.tobytes()
    assert load_image(entries[4]["url"]).tobytes() == load_image(str(jpeg)).tobytes()  # the JPEG's own pixels
    assert rec["prompt"]["tokens"].count(IMAGE_PAD) == 5 * 4


def test_a_large_image_is_stored_as_a_marked_thumbnail(tmp_path):
    big = squares((600, 300))
    entry = image_entry(big)
    assert entry["thumbnail"] is True and (entry["width"], entry["height"]) == (600, 300)
    thumb = load_image(entry["url"])
    assert thumb.size == (THUMB_SIDE, THUMB_SIDE // 2)
    assert big.size == (600, 300)  # the prompt's own image is not resized in place
    exact = image_entry(squares((THUMB_SIDE, 40)))
    assert "thumbnail" not in exact and load_image(exact["url"]).size == (THUMB_SIDE, 40)


def test_text_records_are_byte_identical_to_before_images(tmp_path, tokenizer):
    prompt = Prompt("t0", "1+1=", "2", {"task": "addition"})
    ids = tokenizer.encode("1+1=", add_special_tokens=False)
    g = group(prompt, ids, tokenizer)
    record(tmp_path, [g, group(Prompt("t1", "2+2=", "4", {"images": []}), ids, tokenizer)], tokenizer, step=3)
    # what record.py wrote before issue 54: the prompt's five fields, no tokens, no images
    expected = {"step": 3, "kind": "train", "group": 0, "trained": False,
                "prompt": {"uid": "t0", "text": "1+1=", "answer": "2", "ids": ids, "task": "addition"},
                "samples": [sample_record(t, token_texts(tokenizer, t.token_ids), staleness=2 - t.oldest_version,
                                          trainer_logp=None, advantage=None, loss_mask=[0] * len(t.token_ids))
                            for t in g.trajectories]}
    first, second = (tmp_path / "samples.jsonl").read_bytes().splitlines(keepends=True)
    assert first == (json.dumps(expected, separators=(",", ":"), allow_nan=False) + "\n").encode()
    # "images": [] is a text prompt too
    assert b'"tokens":["' not in second.split(b'"samples"')[0] and b"images" not in second


def test_the_page_shows_the_image_beside_the_tokens(tmp_path, tokenizer, processor):
    image = squares()
    prompt, ids = vision_prompt(processor, [image])
    record(tmp_path, [group(prompt, ids, tokenizer), group(Prompt("t", "1+1=", "2"), [5, 6], tokenizer)], tokenizer)
    page = write_inspector([tmp_path]).read_text()
    url = to_data_url(image)
    assert url in page  # embedded in the page's data, drawn as <img src=...> by the script
    assert 'id="group-images"' in page and "imageChip" in page and 'const IMAGE_PAD = "<|image_pad|>"' in page
    run = load_run(tmp_path)
    assert [bool(r["prompt"].get("images")) for r in run["records"]] == [True, False]
    assert not [n for n in run["notes"] if "image" in n]


def test_a_bad_image_is_an_error_entry_and_a_count_not_a_crash(tmp_path, tokenizer, processor, caplog):
    good = squares()
    prompt, ids = vision_prompt(processor, [good, good, good])
    prompt.meta["images"] = ["data:image/png;base64,!!notbase64", good, b"not an image"]
    broken = Prompt("p1", "How many?", "1", {"images": 42})  # not even a list
    with caplog.at_level(logging.WARNING, logger="tidal.inspector.record"):
        recorder, (rec, rec2) = record(tmp_path, [group(prompt, ids, tokenizer), group(broken, [5], tokenizer)],
                                       tokenizer)
    bad, ok, worse = rec["prompt"]["images"]
    assert "bad base64" in bad["error"] and "unreadable image" in worse["error"] and "url" not in bad
    assert load_image(ok["url"]).tobytes() == good.tobytes()
    assert "error" in rec2["prompt"]["images"][0] and len(rec2["samples"]) == 3  # its samples are still recorded
    assert recorder.bad_images == 3
    assert len([r for r in caplog.records if "could not be recorded" in r.getMessage()]) == 1
    recorder.record_train(2, 1, [group(prompt, ids, tokenizer)], None, None)  # the next step: counted, not re-warned
    assert recorder.bad_images == 5
    assert len([r for r in caplog.records if "could not be recorded" in r.getMessage()]) == 1
    run = load_run(tmp_path)
    assert any("5 prompt image(s) could not be recorded" in n for n in run["notes"])


def test_the_reader_skips_a_record_whose_image_is_not_a_data_url(tmp_path):
    sample = {"text": "1", "ids": [1], "tokens": ["1"], "behav_logp": [0.0], "versions": [0]}
    base = {"step": 1, "kind": "eval", "samples": [sample]}
    lines = [dict(base, prompt={"text": "q", "ids": [1], "images": [{"url": "data:image/png;base64,AAAA"}]}),
             dict(base, prompt={"text": "q", "ids": [1], "images": [{"url": "https://example.com/x.png"}]}),
             dict(base, prompt={"text": "q", "ids": [1, 2], "tokens": ["a"], "images": []}),
             dict(base, prompt={"text": "q", "ids": [1], "images": "data:image/png;base64,AAAA"})]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, skipped = read_samples(tmp_path / "samples.jsonl")
    assert len(records) == 1 and skipped == 3


def chromium():
    """A headless Chromium driven by Selenium (the OS's Chromium and chromedriver; the test skips without them)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs Selenium: pip install -e '.[dev]'")
    chrome = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if chrome is None or shutil.which("chromedriver") is None:
        pytest.skip("needs Chromium and chromedriver: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,1100"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def test_a_chromium_draws_the_image_and_one_chip_per_image(tmp_path, tokenizer, processor):
    from selenium.webdriver.common.by import By

    prompt, ids = vision_prompt(processor, [squares(), squares((600, 300))])
    record(tmp_path, [group(prompt, ids, tokenizer)], tokenizer)
    page = write_inspector([tmp_path])
    driver = chromium()
    try:
        driver.get(page.resolve().as_uri())
        driver.find_element(By.CSS_SELECTOR, "#groups tr.group-row").click()
        figures = driver.find_elements(By.CSS_SELECTOR, "#group-images figure.prompt-image")
        assert [f.find_element(By.TAG_NAME, "figcaption").text for f in figures] == [
            "image 0 (56×56)", "image 1 (600×300, shown downscaled)"]
        widths = [driver.execute_script("return arguments[0].naturalWidth", f.find_element(By.TAG_NAME, "img"))
                  for f in figures]
        assert widths == [56, THUMB_SIDE]  # decoded from the data URLs: nothing fetched
        chips = driver.find_elements(By.CSS_SELECTOR, "#group-images .img-chip")
        n1 = ids.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) - 4
        assert [c.text for c in chips] == ["image 0: 4 tokens", f"image 1: {n1} tokens"]
        shown = driver.find_elements(By.CSS_SELECTOR, "#group-images .ptok")
        assert len(shown) == len(ids) - 4 - n1  # every other prompt token, one each
        assert "image" not in driver.find_element(By.ID, "notes").text
    finally:
        driver.quit()


# ---- an agent episode's observation pictures (Trajectory.images past the prompt's) ----------------------------

def episode(prompt: Prompt, prompt_ids: list[int], tokenizer, processor, k: int, seen=SEEN, answer="3",
            sampled_pad: bool = False) -> Trajectory:
    """Sample ``k`` of a two-turn episode: a zoom call, an observation showing ``seen`` (rendered as the chat
    renderer renders it: the processor's widening of the whole conversation), then the answer; ``sampled_pad``: the
    answer starts with an image-pad token the policy sampled (text, not a picture)."""
    call = "<zoom>1</zoom>"
    turn1 = tokenizer.encode(call, add_special_tokens=False)
    obs = [{"type": "text", "text": "zoom 1:"}, {"type": "image_url", "image_url": {"url": SEEN}}]
    messages = [*vlm.user_message(prompt.text, 1), {"role": "assistant", "content": call},
                {"role": "tool", "content": obs}]
    whole = vlm.encode_messages(processor, messages, [BOARD])["input_ids"][0].tolist()
    observation = whole[len(prompt_ids) + len(turn1):]
    assert whole[:len(prompt_ids)] == prompt_ids and observation.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 4
    turn2 = ([tokenizer.convert_tokens_to_ids(IMAGE_PAD)] if sampled_pad else []) + \
        tokenizer.encode(answer, add_special_tokens=False)
    ids = [*turn1, *observation, *turn2]
    mask = [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    return Trajectory(prompt.uid, k, list(prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), "stop",
                      text=call + answer, reward=1.0, loss_mask=mask, images=[BOARD, seen],
                      episode={"turns": 2, "tool_calls": 1, "tool_errors": 0})


def board_prompt(processor):
    prompt = Prompt("e0", "how many squares?", "3", {"images": [BOARD]})
    return prompt, vlm.prompt_ids(processor, prompt.text, [BOARD])


def test_an_episodes_observation_picture_is_recorded_once_per_sample(tmp_path, tokenizer, processor):
    prompt, ids = board_prompt(processor)
    trajs = [episode(prompt, ids, tokenizer, processor, k) for k in range(2)]
    recorder, (rec,) = record(tmp_path, [Group(prompt, trajs)], tokenizer)
    assert recorder.bad_images == 0
    (board,) = rec["prompt"]["images"]  # the prompt's picture: once per record, as before
    assert load_image(board["url"]).tobytes() == load_image(BOARD).tobytes()
    for s in rec["samples"]:
        (seen,) = s["images"]  # the observation's: the pictures after the prompt's, once per sample
        assert seen["url"].startswith("data:image/png;base64,") and "thumbnail" not in seen
        assert (seen["width"], seen["height"]) == load_image(SEEN).size
        assert load_image(seen["url"]).tobytes() == load_image(SEEN).tobytes()  # read back: the same pixels
        assert s["policy_mask"] == trajs[0].loss_mask and s["tokens"].count(IMAGE_PAD) == 4
    line = (tmp_path / "samples.jsonl").read_text()
    assert line.count("data:image/png") == 1 + 2
    # an evaluation's episode too
    recorder.record_eval(2, [prompt], [trajs[0]])
    records, skipped = read_samples(tmp_path / "samples.jsonl")
    assert skipped == 0 and records[-1]["kind"] == "eval"
    assert records[-1]["samples"][0]["images"] == rec["samples"][0]["images"]


def test_single_turn_image_samples_are_recorded_byte_identical_to_before(tmp_path, tokenizer, processor):
    prompt, ids = board_prompt(processor)
    g = group(prompt, ids, tokenizer)
    g.trajectories[1].images = [BOARD]  # a trajectory naming just its prompt's pictures: nothing of its own
    record(tmp_path, [g], tokenizer)
    (line,) = (tmp_path / "samples.jsonl").read_bytes().splitlines(keepends=True)
    # what record.py wrote before observation pictures: no sample has "images", its fields in this order
    samples = [{"index": t.sample_index, "text": t.text, "ids": t.token_ids,
                "tokens": token_texts(tokenizer, t.token_ids), "behav_logp": t.logprobs, "versions": t.versions,
                "policy_mask": None, "reward": t.reward, "details": {}, "finish_reason": "stop", "episode": None,
                "staleness": 0, "trainer_logp": None, "advantage": None, "loss_mask": [0] * len(t.token_ids)}
               for t in g.trajectories]
    expected = {"step": 1, "kind": "train", "group": 0, "trained": False,
                "prompt": prompt_record(prompt, ids, "count_squares", tokenizer), "samples": samples}
    assert line == (json.dumps(expected, separators=(",", ":"), allow_nan=False) + "\n").encode()
    assert line.count(b"data:image/png") == 1


def test_the_page_draws_an_observation_picture_after_its_chip(tmp_path, tokenizer, processor):
    prompt, ids = board_prompt(processor)
    record(tmp_path, [Group(prompt, [episode(prompt, ids, tokenizer, processor, 0)])], tokenizer)
    (rec,) = read_samples(tmp_path / "samples.jsonl")[0]
    page = write_inspector([tmp_path]).read_text()
    assert rec["samples"][0]["images"][0]["url"] in page and to_data_url(load_image(SEEN)) in page
    assert "obs-image" in page and "imageFigure" in page
    run = load_run(tmp_path)
    assert not [n for n in run["notes"] if "image" in n]


def test_a_bad_observation_image_is_an_error_entry_and_a_count(tmp_path, tokenizer, processor, caplog):
    prompt, ids = board_prompt(processor)
    trajs = [episode(prompt, ids, tokenizer, processor, 0, seen="data:image/png;base64,!!notbase64"),
             episode(prompt, ids, tokenizer, processor, 1)]
    with caplog.at_level(logging.WARNING, logger="tidal.inspector.record"):
        recorder, (rec,) = record(tmp_path, [Group(prompt, trajs)], tokenizer)
    (bad,), (ok,) = (s["images"] for s in rec["samples"])
    assert "bad base64" in bad["error"] and "url" not in bad and "sample 0 image 1" in bad["error"]
    assert load_image(ok["url"]).tobytes() == load_image(SEEN).tobytes()
    assert recorder.bad_images == 1 and "error" not in rec["prompt"]["images"][0]
    (warning,) = [r for r in caplog.records if "could not be recorded" in r.getMessage()]
    assert "bad base64" in warning.getMessage()
    notes = load_run(tmp_path)["notes"]
    assert notes == ["no metrics.jsonl: no curves", "no config.yaml",
                     "1 observation image(s) could not be recorded (shown as errors at their chips)"]


def test_the_reader_skips_a_sample_whose_observation_image_is_not_a_data_url(tmp_path):
    sample = {"text": "1", "ids": [1], "tokens": ["1"], "behav_logp": [0.0], "versions": [0]}
    prompt = {"text": "q", "ids": [1]}
    lines = [{"step": 1, "kind": "eval", "prompt": prompt, "samples": [dict(sample, images=images)]}
             for images in ([{"url": "data:image/png;base64,AAAA"}, {"error": "x"}],
                            [{"url": "https://example.com/x.png"}], "data:image/png;base64,AAAA")]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, skipped = read_samples(tmp_path / "samples.jsonl")
    assert len(records) == 1 and skipped == 2


def test_a_chromium_draws_an_observation_picture_after_its_chip(tmp_path, tokenizer, processor):
    from selenium.webdriver.common.by import By

    prompt, ids = board_prompt(processor)
    trajs = [episode(prompt, ids, tokenizer, processor, 0, sampled_pad=True),
             episode(prompt, ids, tokenizer, processor, 1, seen="data:image/png;base64,!!notbase64")]
    record(tmp_path, [Group(prompt, trajs)], tokenizer)
    page = write_inspector([tmp_path])
    driver = chromium()
    try:
        driver.get(page.resolve().as_uri())
        driver.find_element(By.CSS_SELECTOR, "#groups tr.group-row").click()
        first, second = driver.find_elements(By.CSS_SELECTOR, "#samples .sample")
        obs = first.find_element(By.CSS_SELECTOR, ".seg.obs")
        chip = obs.find_element(By.CSS_SELECTOR, ".img-chip")
        assert chip.text == "image 1: 4 tokens"  # numbered after the prompt's image 0
        (fig,) = obs.find_elements(By.CSS_SELECTOR, "figure.obs-image")
        assert fig.find_element(By.TAG_NAME, "figcaption").text == "image 1 (56×56)"
        img = fig.find_element(By.TAG_NAME, "img")
        assert driver.execute_script("return arguments[0].naturalWidth", img) == 56  # decoded: nothing fetched
        assert driver.execute_script("return arguments[0].previousElementSibling === arguments[1]", fig, chip)
        # the image-pad token the policy sampled: a chip of its own, no picture, no image number
        (sampled,) = first.find_elements(By.CSS_SELECTOR, ".seg.turn .img-chip")
        assert "sampled" in sampled.get_attribute("class").split() and sampled.text.startswith("sampled")
        (bad,) = second.find_elements(By.CSS_SELECTOR, "figure.obs-image")
        assert "bad" in bad.get_attribute("class").split() and not bad.find_elements(By.TAG_NAME, "img")
        assert bad.text.startswith("image 1: not recorded (ImageError") and "bad base64" in bad.text
        assert "1 observation image(s) could not be recorded" in driver.find_element(By.ID, "notes").text
    finally:
        driver.quit()
