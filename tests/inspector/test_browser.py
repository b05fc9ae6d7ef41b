"""The inspector in a real headless Chromium (the OS's, driven by Selenium), on pages from real runs.

Each test opens a page from ``file://`` (no server), acts as a user would (filters, a click on a group,
the mouse over a token, the chart controls) and checks what the page shows against what the run
recorded in ``samples.jsonl`` and ``metrics.jsonl``. Screenshots go to ``$TIDAL_SCREENSHOTS`` (default: the
test's temporary directory). Without Chromium and chromedriver (``apt-get install chromium
chromium-driver``; ``.ci/run`` installs them) or Selenium (the ``dev`` extra) the tests skip, saying which.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from tidal.inspector.page import response_preview, write_inspector
from tidal.inspector.samples import read_samples

webdriver = pytest.importorskip("selenium.webdriver", reason="needs Selenium: pip install -e '.[dev]'")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROME = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROME is None or DRIVER is None,
    reason="needs Chromium and chromedriver from the OS packages: apt-get install chromium chromium-driver "
           "(.ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROME
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,1100"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    path = Path(os.environ.get("TIDAL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_page(driver, path):
    driver.get(Path(path).resolve().as_uri())
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def visible(token):  # how the page writes a token (inspector.js: visible)
    return token.replace("\n", "↵\n").replace("\t", "⇥")


def rows(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#groups tr.group-row")


def tip(driver):
    return {tr.get_attribute("data-k"): tr.find_element(By.TAG_NAME, "td").get_attribute("textContent")
            for tr in driver.find_elements(By.CSS_SELECTOR, "#tip tr")}


def same(shown, recorded):
    """A number as the tooltip shows it ("—" for none) equals the recorded one, exactly."""
    return shown == "—" if recorded is None else float(shown) == recorded


def test_filter_open_a_group_and_hover_its_tokens(browser, inspector_runs, shots):
    run = inspector_runs["a"]
    records, _ = read_samples(run / "samples.jsonl")
    open_page(browser, run / "inspect.html")
    assert len(rows(browser)) == len(records)

    index, rec = next((i, r) for i, r in enumerate(records) if r["kind"] == "train" and r["trained"])
    Select(browser.find_element(By.ID, "f-kind")).select_by_value("train")
    browser.find_element(By.ID, "f-step-min").send_keys(str(rec["step"]))
    browser.find_element(By.ID, "f-step-max").send_keys(str(rec["step"]))
    train = [(i, r) for i, r in enumerate(records) if r["kind"] == "train" and r["step"] == rec["step"]]
    shown = [int(tr.get_attribute("data-rec")) for tr in rows(browser)]
    assert shown == [i for i, _ in train] and index in shown
    num_samples = sum(len(r["samples"]) for _, r in train)
    assert browser.find_element(By.ID, "match-count").text.startswith(
        f"{len(train)} of {len(records)} prompts, {num_samples} samples match")

    browser.find_element(By.CSS_SELECTOR, f'#groups tr[data-rec="{index}"]').click()
    assert browser.find_element(By.ID, "group-title").text == f"Step {rec['step']}: group {rec['group']} (trained)"
    assert browser.find_element(By.ID, "group-prompt").text == rec["prompt"]["text"]
    cards = browser.find_elements(By.CSS_SELECTOR, "#samples .sample")
    assert len(cards) == len(rec["samples"])
    for card, s in zip(cards, rec["samples"]):
        spans = card.find_elements(By.CSS_SELECTOR, ".tok")
        assert [sp.get_attribute("textContent") for sp in spans] == [visible(t) for t in s["tokens"]]
        assert card.find_element(By.CSS_SELECTOR, ".f-reward").text == f"reward {s['reward']:g}"
        assert float(card.find_element(By.CSS_SELECTOR, ".f-advantage").text.split()[1]) == s["advantage"]
        for j, span in enumerate(spans):
            ActionChains(browser).move_to_element(span).perform()
            numbers = tip(browser)
            assert numbers["token"] == json.dumps(s["tokens"][j], ensure_ascii=False)
            assert int(numbers["id"]) == s["ids"][j] and int(numbers["version"]) == s["versions"][j]
            assert int(numbers["loss_mask"]) == s["loss_mask"][j]
            assert same(numbers["behav_logp"], s["behav_logp"][j])
            assert same(numbers["trainer_logp"], s["trainer_logp"][j])
            assert same(numbers["advantage"], s["advantage"])
            assert float(numbers["mismatch"]) == pytest.approx(abs(s["trainer_logp"][j] - s["behav_logp"][j]),
                                                               abs=1e-4)
    browser.save_screenshot(str(shots / "group_hover.png"))

    Select(browser.find_element(By.ID, "color-mode")).select_by_value("advantage")
    for card, s in zip(browser.find_elements(By.CSS_SELECTOR, "#samples .sample"), rec["samples"]):
        colour = card.find_element(By.CSS_SELECTOR, ".tok").value_of_css_property("background-color")
        assert colour.startswith("rgba(0, 150, 0" if s["advantage"] >= 0 else "rgba(210, 0, 0"), (colour, s)
    browser.save_screenshot(str(shots / "group_advantage.png"))


@pytest.mark.parametrize("name", ["a", "agent"])
def test_each_row_shows_its_responses_and_their_rewards(browser, inspector_runs, shots, name):
    run = inspector_runs[name]
    records, _ = read_samples(run / "samples.jsonl")
    open_page(browser, run / "inspect.html")
    assert len(rows(browser)) == len(records)
    for tr, rec in zip(rows(browser), records):
        chips = tr.find_elements(By.CSS_SELECTOR, "td.responses-cell .resp")
        assert len(chips) == len(rec["samples"])
        for chip, s in zip(chips, rec["samples"]):
            text = chip.find_element(By.CSS_SELECTOR, ".resp-text").get_attribute("textContent")
            assert text == response_preview(s["text"])
            assert chip.get_attribute("title") == s["text"]
            shown = chip.find_element(By.CSS_SELECTOR, ".resp-reward").get_attribute("textContent")
            assert float(shown) == pytest.approx(round(s["reward"], 4), abs=1e-9)
            assert ("right" in chip.get_attribute("class").split()) == (s["reward"] >= 1)
    browser.find_element(By.ID, "f-reward-min").send_keys("1")  # the rows that stay fade their samples below it
    for tr in rows(browser):
        rec = records[int(tr.get_attribute("data-rec"))]
        faded = ["dim" in c.get_attribute("class").split() for c in tr.find_elements(By.CSS_SELECTOR, ".resp")]
        assert faded == [not s["reward"] >= 1 for s in rec["samples"]]
    browser.save_screenshot(str(shots / f"rows_{name}.png"))


def test_reward_truncation_and_text_filters(browser, inspector_runs):
    run = inspector_runs["a"]
    records, _ = read_samples(run / "samples.jsonl")
    open_page(browser, run / "inspect.html")
    browser.find_element(By.ID, "f-reward-min").send_keys("0.25")
    Select(browser.find_element(By.ID, "f-truncated")).select_by_value("yes")
    expected = [i for i, r in enumerate(records)
                if any(s["reward"] >= 0.25 and s["finish_reason"] == "length" for s in r["samples"])]
    assert [int(tr.get_attribute("data-rec")) for tr in rows(browser)] == expected
    browser.find_element(By.ID, "f-reward-min").clear()
    Select(browser.find_element(By.ID, "f-truncated")).select_by_value("")
    prompt = records[0]["prompt"]["text"]
    browser.find_element(By.ID, "f-text").send_keys(prompt)
    expected = [i for i, r in enumerate(records)
                if prompt.lower() in r["prompt"]["text"].lower() or any(prompt in s["text"] for s in r["samples"])]
    assert [int(tr.get_attribute("data-rec")) for tr in rows(browser)] == expected


def test_the_same_prompt_across_steps(browser, inspector_runs, shots):
    run = inspector_runs["a"]
    records, _ = read_samples(run / "samples.jsonl")
    open_page(browser, run / "inspect.html")
    Select(browser.find_element(By.ID, "f-kind")).select_by_value("eval")
    rows(browser)[0].click()
    browser.find_element(By.ID, "to-history").click()
    prompt = browser.find_element(By.ID, "group-prompt").get_attribute("textContent")
    mine = sorted((r for r in records if r["prompt"]["text"] == prompt), key=lambda r: r["step"])
    history = browser.find_elements(By.CSS_SELECTOR, "#h-list tr.h-row")
    assert [tr.find_element(By.TAG_NAME, "td").text for tr in history] == [str(r["step"]) for r in mine]
    answers = [a.get_attribute("textContent") for tr in history for a in tr.find_elements(By.CSS_SELECTOR, ".ans")]
    assert answers == [s["text"] or "∅" for r in mine for s in r["samples"]]
    traces = browser.execute_script("return document.getElementById('h-chart').data.map(t => [t.x, t.y]);")
    assert [[r["step"] for r in mine], [r["samples"][0]["reward"] for r in mine]] in traces
    browser.save_screenshot(str(shots / "prompt_history.png"))


def ema(ys, w):
    out, last = [], 0.0
    for n, y in enumerate(ys, start=1):
        last = last * w + (1 - w) * y
        out.append(last / (1 - w**n))
    return out


def test_two_runs_curves_smoothing_wall_clock_and_config_diff(browser, inspector_runs, tmp_path, shots):
    page = write_inspector([inspector_runs["a"], inspector_runs["b"]], tmp_path / "compare.html")
    metrics = {name: [json.loads(x) for x in (inspector_runs[name] / "metrics.jsonl").read_text().splitlines()]
               for name in ("a", "b")}
    open_page(browser, page)
    browser.find_element(By.ID, "tab-curves").click()
    Select(browser.find_element(By.ID, "c-key")).select_by_value("train/loss")
    data = "return document.getElementById('c-chart').data.map(t => ({name: t.name, x: t.x, y: t.y}));"
    traces = browser.execute_script(data)
    for name, trace in zip(("a", "b"), traces):
        assert trace["name"] == name
        assert trace["x"] == [r["step"] for r in metrics[name] if "train/loss" in r]
        assert trace["y"] == pytest.approx([r["train/loss"] for r in metrics[name] if "train/loss" in r])

    slider = browser.find_element(By.ID, "c-smooth")
    browser.execute_script("arguments[0].value = 0.5; arguments[0].dispatchEvent(new Event('input'));", slider)
    traces = browser.execute_script(data)
    assert [t["name"] for t in traces] == ["a (raw)", "a", "b (raw)", "b"]
    ys = [r["train/loss"] for r in metrics["a"] if "train/loss" in r]
    assert traces[1]["y"] == pytest.approx(ema(ys, 0.5)) and traces[0]["y"] == pytest.approx(ys)

    Select(browser.find_element(By.ID, "c-x")).select_by_value("time/elapsed_s")
    traces = browser.execute_script(data)
    assert traces[1]["x"] == pytest.approx([r["time/elapsed_s"] for r in metrics["a"] if "train/loss" in r])
    browser.save_screenshot(str(shots / "curves_two_runs.png"))

    browser.find_element(By.ID, "tab-config").click()
    diff = browser.find_elements(By.CSS_SELECTOR, "#config-diff tbody tr")
    assert [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in diff] == [["seed", "0", "1"]]
    browser.save_screenshot(str(shots / "config_diff.png"))


def test_an_agent_episode_shows_turns_and_untrained_observations(browser, inspector_runs, shots):
    run = inspector_runs["agent"]
    records, _ = read_samples(run / "samples.jsonl")
    open_page(browser, run / "inspect.html")
    Select(browser.find_element(By.ID, "f-kind")).select_by_value("train")
    index, rec = next((i, r) for i, r in enumerate(records) if r["kind"] == "train")
    browser.find_element(By.CSS_SELECTOR, f'#groups tr[data-rec="{index}"]').click()
    card = browser.find_elements(By.CSS_SELECTOR, "#samples .sample")[0]
    s = rec["samples"][0]
    labels = [x.text for x in card.find_elements(By.CSS_SELECTOR, ".seg-label")]
    runs, start = [], 0  # expected segments: runs of the same policy_mask value
    for j in range(1, len(s["policy_mask"]) + 1):
        if j == len(s["policy_mask"]) or s["policy_mask"][j] != s["policy_mask"][start]:
            runs.append(s["policy_mask"][start])
            start = j
    turns = iter(range(1, len(runs) + 1))
    assert labels == [f"model turn {next(turns)}" if m else "observation (not trained)" for m in runs]
    obs = card.find_elements(By.CSS_SELECTOR, ".seg.obs .tok")
    assert len(obs) == s["policy_mask"].count(0) > 0
    ActionChains(browser).move_to_element(obs[0]).perform()
    numbers = tip(browser)
    assert numbers["note"] == "observation: not trained" and numbers["loss_mask"] == "0"
    assert numbers["behav_logp"] == "—" and numbers["version"] == "-1"
    assert card.find_element(By.CSS_SELECTOR, ".f-turns").text == f"turns {s['episode']['turns']}"
    browser.save_screenshot(str(shots / "agent_episode.png"))


def test_the_report_links_to_the_inspector(browser, inspector_runs, shots):
    open_page(browser, inspector_runs["a"] / "report.html")
    browser.save_screenshot(str(shots / "report.png"))
    browser.find_element(By.LINK_TEXT, "inspect.html").click()
    assert browser.title == "tidal inspector — a"
    assert rows(browser)


def test_an_moe_samples_token_shows_its_experts_per_layer(browser, tokenizer, tmp_path, shots):
    """A token's tooltip lists the experts the engine chose for it in each layer (``routes``); the last sampled
    token, never fed, has none."""
    from tidal.models import moe

    from .test_record import moe_samples

    trajs, records = moe_samples(tokenizer)
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    open_page(browser, write_inspector([tmp_path]))
    browser.find_element(By.CSS_SELECTOR, '#groups tr[data-rec="0"]').click()
    t, s = trajs[0], records[0]["samples"][0]
    routes = t.routes[len(t.prompt_ids):]
    spans = browser.find_elements(By.CSS_SELECTOR, "#samples .sample .tok")
    assert len(spans) == len(s["ids"]) == len(routes) > 1
    for j, span in enumerate(spans):
        ActionChains(browser).move_to_element(span).perform()
        shown = tip(browser)["experts"]
        if j == len(spans) - 1:
            assert (routes[j] == moe.NO_ROUTE).all() and shown.startswith("— (no route")
        else:
            layers = enumerate(routes[j].tolist())
            assert shown == " ".join(f"L{layer}:" + ",".join(map(str, ids)) for layer, ids in layers)
    browser.save_screenshot(str(shots / "moe_experts.png"))
