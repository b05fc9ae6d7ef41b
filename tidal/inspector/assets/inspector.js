// The rollout inspector's page logic: filters, the group view with coloured tokens, one prompt across
// steps, metric curves of several runs (drawn by Plotly) and the config diff. The data is the JSON that
// tidal/inspector/page.py embeds in the page (#tidal-data); nothing is fetched, so the page works from disk.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("tidal-data").textContent);
  const $ = (id) => document.getElementById(id);
  const MAX_ROWS = 300;
  const state = { run: 0, shown: [], record: null, filterKey: null };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }
  // A control's handler runs on "input" (typing, sliders) and on "change" (a select set by a script or a
  // test driver fires only that); the handlers redraw from the controls' values, so running twice is harmless.
  const on = (node, fn) => { node.addEventListener("input", fn); node.addEventListener("change", fn); };
  const num = (x) => (x === null || x === undefined ? "—" : String(x));
  const round4 = (x) => Math.round(x * 1e4) / 1e4;
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
  const run = () => DATA.runs[state.run];

  // ---- tabs --------------------------------------------------------------------------------------
  function showTab(name) {
    for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.id === "tab-" + name);
    for (const v of document.querySelectorAll(".view")) v.classList.toggle("active", v.id === "view-" + name);
    if (name === "curves") drawCurves();
    if (name === "history") drawHistory();
  }
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.id.slice(4)));

  // ---- filters -------------------------------------------------------------------------------------
  function fillSelect(select, values, keep) {
    const old = select.value;
    select.replaceChildren(...values.map(([v, label]) => el("option", { value: v, text: label })));
    if (keep && values.some(([v]) => v === old)) select.value = old;
  }
  function refreshRunOptions() {
    const r = run();
    const tasks = [...new Set(r.records.map((rec) => rec.prompt.task))].sort();
    fillSelect($("f-task"), [["", "any"], ...tasks.map((t) => [t, t])], true);
    const reasons = [...new Set(r.records.flatMap((rec) => rec.samples.map((s) => s.finish_reason)))].sort();
    fillSelect($("f-finish"), [["", "any"], ...reasons.map((t) => [t, t])], true);
  }
  function numberInput(id) {
    const v = $(id).value.trim();
    return v === "" ? null : Number(v);
  }
  function filters() {
    return {
      kind: $("f-kind").value, task: $("f-task").value, finish: $("f-finish").value,
      truncated: $("f-truncated").value, text: $("f-text").value.trim().toLowerCase(),
      stepMin: numberInput("f-step-min"), stepMax: numberInput("f-step-max"),
      rewardMin: numberInput("f-reward-min"), rewardMax: numberInput("f-reward-max"),
      staleMin: numberInput("f-stale-min"), staleMax: numberInput("f-stale-max"),
    };
  }
  function sampleMatches(rec, s, f) {
    if (f.kind && rec.kind !== f.kind) return false;
    if (f.task && rec.prompt.task !== f.task) return false;
    if (f.stepMin !== null && rec.step < f.stepMin) return false;
    if (f.stepMax !== null && rec.step > f.stepMax) return false;
    if (f.finish && s.finish_reason !== f.finish) return false;
    if (f.truncated === "yes" && s.finish_reason !== "length") return false;
    if (f.truncated === "no" && s.finish_reason === "length") return false;
    if (f.rewardMin !== null && !(s.reward >= f.rewardMin)) return false;
    if (f.rewardMax !== null && !(s.reward <= f.rewardMax)) return false;
    const stale = s.staleness === undefined ? null : s.staleness;  // eval samples have none
    if (f.staleMin !== null && !(stale !== null && stale >= f.staleMin)) return false;
    if (f.staleMax !== null && !(stale !== null && stale <= f.staleMax)) return false;
    if (f.text && !(rec.prompt.text.toLowerCase().includes(f.text) || s.text.toLowerCase().includes(f.text))) return false;
    return true;
  }

  function renderGroups() {
    const f = filters();
    const r = run();
    state.shown = [];
    let numSamples = 0;
    r.records.forEach((rec, i) => {
      const hits = rec.samples.filter((s) => sampleMatches(rec, s, f)).length;
      if (hits) { state.shown.push([i, hits]); numSamples += hits; }
    });
    const more = state.shown.length > MAX_ROWS ? ` (showing the first ${MAX_ROWS})` : "";
    $("match-count").textContent = `${state.shown.length} of ${r.records.length} prompts, ${numSamples} samples match${more}`;
    const body = $("groups").querySelector("tbody");
    body.replaceChildren(...state.shown.slice(0, MAX_ROWS).map(([i, hits]) => {
      const rec = r.records[i];
      const rewards = rec.samples.map((s) => s.reward).filter((x) => x !== null);
      const stale = rec.samples.map((s) => s.staleness).filter((x) => x !== undefined && x !== null);
      const reasons = {};
      for (const s of rec.samples) reasons[s.finish_reason] = (reasons[s.finish_reason] || 0) + 1;
      const row = el("tr", { class: "group-row", "data-rec": String(i), onclick: () => showGroup(i) },
        el("td", { class: "num", text: String(rec.step) }), el("td", { text: rec.kind }),
        el("td", { text: rec.prompt.task }), el("td", { class: "prompt-cell", text: rec.prompt.text }),
        responsesCell(rec, r.previews[i], f),
        el("td", { class: "num", text: `${hits}/${rec.samples.length}` }),
        el("td", { class: "num", text: num(rewards.length ? round4(mean(rewards)) : null) }),
        el("td", { text: Object.entries(reasons).map(([k, v]) => `${k} ${v}`).join(", ") }),
        el("td", { class: "num", text: stale.length ? String(Math.max(...stale)) : "—" }));
      if (i === state.record) row.classList.add("selected");
      return row;
    }));
  }

  function responsesCell(rec, previews, f) {
    // What the policy wrote, without opening the group: each sample's response as page.py cut it
    // (response_preview), its reward beside it; green at full reward as in "Prompt across steps", faded
    // when the sample does not match the filters.
    return el("td", { class: "responses-cell" }, ...rec.samples.map((s, k) => {
      const chip = el("span", { class: "ans resp " + ((s.reward || 0) >= 1 ? "right" : "wrong"), "data-sample": String(k),
        title: s.text }, el("span", { class: "resp-text", text: previews[k] }),
        el("span", { class: "resp-reward", text: num(s.reward === null || s.reward === undefined ? null : round4(s.reward)) }));
      if (!sampleMatches(rec, s, f)) chip.classList.add("dim");
      return chip;
    }));
  }

  // ---- the group view ------------------------------------------------------------------------------
  const COLOURS = {
    behav_logp: "behaviour log-prob: red = unlikely, green = likely (probability e^logp)",
    trainer_logp: "trainer log-prob: red = unlikely, green = likely (probability e^logp)",
    mismatch: "|trainer − behaviour| log-prob: white = equal, purple = 0.5 or more apart",
    advantage: "advantage: green = positive, red = negative (scaled to the group's largest |advantage|)",
  };
  function tokenAdvantage(s, j) {
    return Array.isArray(s.advantage) ? s.advantage[j] : s.advantage;
  }
  function colour(mode, s, j, maxAdv) {
    const grey = "#eeeeee";
    if (mode === "behav_logp" || mode === "trainer_logp") {
      const lp = s[mode] ? s[mode][j] : null;
      if (lp === null || lp === undefined || (s.policy_mask && !s.policy_mask[j])) return grey;
      return `hsl(${Math.round(120 * Math.exp(lp))}, 75%, 82%)`;
    }
    if (mode === "mismatch") {
      if (!s.trainer_logp || s.trainer_logp[j] === null || s.behav_logp[j] === null) return grey;
      if (s.policy_mask && !s.policy_mask[j]) return grey;
      const m = Math.min(Math.abs(s.trainer_logp[j] - s.behav_logp[j]) / 0.5, 1);
      return m === 0 ? "#ffffff" : `rgba(128, 0, 160, ${0.1 + 0.8 * m})`;
    }
    const a = tokenAdvantage(s, j);
    if (a === null || a === undefined || !maxAdv) return grey;
    const alpha = 0.15 + 0.7 * Math.abs(a) / maxAdv;
    return a >= 0 ? `rgba(0, 150, 0, ${alpha})` : `rgba(210, 0, 0, ${alpha})`;
  }
  function visible(tok) {
    return tok.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
  }
  function sampleHead(s, rec) {
    const items = [["index", "#" + s.index], ["reward", num(s.reward)]];
    if (rec.kind === "train") {
      items.push(["advantage", Array.isArray(s.advantage) ? "per token" : num(s.advantage)]);
      items.push(["staleness", num(s.staleness)]);
    } else {
      items.push(["correct", s.correct ? "yes" : "no"]);
    }
    items.push(["finish", s.finish_reason]);
    const versions = s.versions.filter((v) => v >= 0);
    if (versions.length) items.push(["versions", `${Math.min(...versions)}–${Math.max(...versions)}`]);
    if (s.episode) {
      items.push(["turns", num(s.episode.turns)], ["tool calls", num(s.episode.tool_calls)]);
      if (s.episode.tool_errors) items.push(["tool errors", num(s.episode.tool_errors)]);
    }
    return el("div", { class: "sample-head" },
      ...items.map(([k, v]) => el("span", { class: "f-" + k.replace(" ", "-") }, el("b", { text: k + " " }), v)));
  }
  function segments(s) {
    // Runs of tokens with the same policy_mask: a model turn (sampled) or an observation (not trained).
    if (!s.policy_mask) return [[0, s.tokens.length, true]];
    const out = [];
    let start = 0;
    for (let j = 1; j <= s.tokens.length; j++) {
      if (j === s.tokens.length || s.policy_mask[j] !== s.policy_mask[start]) {
        out.push([start, j, Boolean(s.policy_mask[start])]);
        start = j;
      }
    }
    return out;
  }
  // ---- a vision-language prompt: its images beside its tokens (record.py: prompt.images, prompt.tokens) --------
  const IMAGE_PAD = "<|image_pad|>";  // models/vlm.py's IMAGE_PAD: one per merged patch block of an image
  function padRunEnd(tokens, j, b) {
    // The end of the run of image-pad tokens starting at j (j itself when tokens[j] is not one)
    let e = j;
    while (e < b && tokens[e] === IMAGE_PAD) e++;
    return e;
  }
  function imageChip(k, a, b) {
    return el("span", { class: "img-chip", "data-image": String(k), title: `${b - a} ${IMAGE_PAD} tokens at positions ${a}–${b - 1}`,
      text: `image ${k}: ${b - a} token${b - a === 1 ? "" : "s"}` });
  }
  function imageFigure(im, k, cls, alt) {
    // One recorded image (record.py's entry: a data URL with its size, or an error) as a captioned picture
    const ok = typeof im.url === "string" && im.url.startsWith("data:image/");  // the page fetches nothing
    const size = im.width && im.height ? `${im.width}×${im.height}` : "";
    const caption = ok ? `image ${k}` + (size ? ` (${size}${im.thumbnail ? ", shown downscaled" : ""})` : "")
      : `image ${k}: not recorded (${im.error || "no data URL"})`;
    const fig = el("figure", { class: cls + (ok ? "" : " bad"), "data-image": String(k) });
    if (ok) fig.append(el("img", { src: im.url, alt: `${alt} ${k}` }));
    fig.append(el("figcaption", { text: caption }));
    return fig;
  }
  function promptImages(p) {
    const figures = (p.images || []).map((im, k) => imageFigure(im, k, "prompt-image", "prompt image"));
    const tokens = el("div", { class: "tokens prompt-tokens" });
    const toks = p.tokens || [];
    let image = 0;
    for (let j = 0; j < toks.length; j++) {
      const end = padRunEnd(toks, j, toks.length);
      if (end > j) {
        tokens.append(imageChip(image++, j, end));
        j = end - 1;
      } else {
        tokens.append(el("span", { class: "ptok", title: `id ${p.ids[j]}`, text: visible(toks[j]) }));
      }
    }
    return [el("div", { class: "image-list" }, ...figures), tokens];
  }
  function sampleCard(rec, s, k, mode, maxAdv, f) {
    const tokens = el("div", { class: "tokens" });
    // An episode's observation pictures (record.py: the sample's images, those after the prompt's) are drawn after
    // their chips; with them recorded, a run the policy sampled is text (train/vision.py), not a picture
    const own = Array.isArray(s.images) ? s.images : null;
    let turn = 0, image = (rec.prompt.images || []).length, seen = 0;
    for (const [a, b, sampled] of segments(s)) {
      const seg = el("div", { class: "seg " + (sampled ? "turn" : "obs") });
      if (s.policy_mask) {
        seg.append(el("span", { class: "seg-label", text: sampled ? `model turn ${++turn}` : "observation (not trained)" }));
      }
      for (let j = a; j < b; j++) {
        const end = padRunEnd(s.tokens, j, b);
        if (end > j) {  // an image an observation showed (numbered after the prompt's images)
          if (own && sampled) {
            seg.append(el("span", { class: "img-chip sampled", title: `${end - j} ${IMAGE_PAD} tokens the policy sampled `
              + `at positions ${j}–${end - 1}: text, no picture`, text: `sampled ${IMAGE_PAD} ×${end - j}` }));
          } else {
            seg.append(imageChip(image, j, end));
            if (own && seen < own.length) seg.append(imageFigure(own[seen++], image, "obs-image", "observation image"));
            image++;
          }
          j = end - 1;
          continue;
        }
        const span = el("span", { class: "tok", "data-sample": String(k), "data-j": String(j), text: visible(s.tokens[j]) });
        span.style.background = colour(mode, s, j, maxAdv);
        if (!sampled) span.classList.add("obs");
        else if (s.loss_mask && !s.loss_mask[j]) span.classList.add("masked");
        seg.append(span);
      }
      tokens.append(seg);
    }
    if (!s.tokens.length) tokens.append(el("span", { class: "muted", text: "(no tokens)" }));
    const card = el("div", { class: "sample", "data-sample": String(k) }, sampleHead(s, rec), tokens);
    if (s.details && Object.keys(s.details).length) card.append(el("div", { class: "details", text: "details " + JSON.stringify(s.details) }));
    if (!sampleMatches(rec, s, f)) card.classList.add("dim");
    return card;
  }
  function showGroup(i) {
    state.record = i;
    for (const row of document.querySelectorAll("#groups tr.group-row")) row.classList.toggle("selected", row.dataset.rec === String(i));
    const rec = run().records[i];
    const mode = $("color-mode").value;
    const advs = rec.samples.flatMap((s) => (Array.isArray(s.advantage) ? s.advantage : [s.advantage])).filter((a) => a !== null && a !== undefined);
    const maxAdv = advs.length ? Math.max(...advs.map(Math.abs)) : 0;
    const f = filters();
    const title = rec.kind === "train" ? `Step ${rec.step}: group ${rec.group} (${rec.trained ? "trained" : "not trained: every reward equal"})`
      : `Step ${rec.step}: held-out prompt (greedy)`;
    $("group-title").textContent = title;
    $("group-prompt").textContent = rec.prompt.text;
    $("group-answer").textContent = rec.prompt.answer;
    const withImages = Array.isArray(rec.prompt.images) && rec.prompt.images.length > 0;
    $("group-images").replaceChildren(...(withImages ? promptImages(rec.prompt) : []));
    $("group-images").style.display = withImages ? "flex" : "none";
    $("legend").textContent = COLOURS[mode] + ". Dotted underline: not in the loss (loss mask 0).";
    $("samples").replaceChildren(...rec.samples.map((s, k) => sampleCard(rec, s, k, mode, maxAdv, f)));
    $("group-view").style.display = "block";
  }
  $("color-mode").addEventListener("change", () => { if (state.record !== null) showGroup(state.record); });
  $("to-history").addEventListener("click", () => {
    if (state.record === null) return;
    $("h-prompt").value = run().records[state.record].prompt.text;
    showTab("history");
  });

  // ---- the token tooltip ---------------------------------------------------------------------------
  // An MoE sample's routes (record.py: shape [tokens, layers, k] and the uint8 ids in base64), decoded once
  const NO_ROUTE = 255;
  const decodedRoutes = new WeakMap();
  function experts(s, j) {
    if (!s.routes) return null;
    const [tokens, layers, k] = s.routes.shape;
    if (j >= tokens) return null;
    let ids = decodedRoutes.get(s);
    if (!ids) {
      const raw = atob(s.routes.uint8_b64);
      ids = Uint8Array.from(raw, (c) => c.charCodeAt(0));
      decodedRoutes.set(s, ids);
    }
    if (ids[j * layers * k] === NO_ROUTE) return "— (no route: not fed to the engine)";
    const per = [];
    for (let l = 0; l < layers; l++) per.push(`L${l}:` + Array.from(ids.subarray((j * layers + l) * k, (j * layers + l + 1) * k)).join(","));
    return per.join(" ");
  }
  const tip = $("tip");
  document.addEventListener("mouseover", (ev) => {
    const span = ev.target.closest ? ev.target.closest(".tok") : null;
    if (!span) { tip.style.display = "none"; return; }
    const s = run().records[state.record].samples[Number(span.dataset.sample)];
    const j = Number(span.dataset.j);
    const b = s.behav_logp[j], t = s.trainer_logp ? s.trainer_logp[j] : null;
    const observation = s.policy_mask && !s.policy_mask[j];
    const rows = [["token", JSON.stringify(s.tokens[j])], ["id", s.ids[j]], ["behav_logp", observation ? "—" : num(b)],
      ["trainer_logp", observation ? "—" : num(t)],
      ["mismatch", observation || t === null || b === null ? "—" : num(round4(Math.abs(t - b)))],
      ["version", s.versions[j]], ["loss_mask", s.loss_mask ? s.loss_mask[j] : "—"]];
    if (tokenAdvantage(s, j) !== undefined) rows.push(["advantage", num(tokenAdvantage(s, j))]);
    if (experts(s, j) !== null) rows.push(["experts", experts(s, j)]);
    if (observation) rows.push(["note", "observation: not trained"]);
    tip.replaceChildren(el("table", {}, ...rows.map(([k, v]) => el("tr", { "data-k": k }, el("th", { text: k }), el("td", { text: String(v) })))));
    tip.style.display = "block";
    const below = ev.clientY + 12 + tip.offsetHeight < window.innerHeight;  // else above the pointer
    tip.style.left = ev.pageX + 12 + "px";
    tip.style.top = (below ? ev.pageY + 12 : ev.pageY - 12 - tip.offsetHeight) + "px";
  });

  // ---- one prompt across steps ---------------------------------------------------------------------
  function refreshPrompts() {
    const counts = new Map();
    for (const rec of run().records) counts.set(rec.prompt.text, (counts.get(rec.prompt.text) || 0) + 1);
    const prompts = [...counts.entries()].sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    fillSelect($("h-prompt"), prompts.map(([p, n]) => [p, `${p}  (${n} record${n > 1 ? "s" : ""})`]), true);
  }
  function drawHistory() {
    const text = $("h-prompt").value;
    const recs = run().records.filter((rec) => rec.prompt.text === text).sort((a, b) => a.step - b.step);
    const traces = [];
    for (const kind of ["train", "eval"]) {
      const mine = recs.filter((r) => r.kind === kind);
      if (!mine.length) continue;
      traces.push({ x: mine.map((r) => r.step), y: mine.map((r) => mean(r.samples.map((s) => s.reward || 0))),
        mode: "lines+markers", name: kind === "train" ? "sampled (mean reward)" : "greedy (reward)" });
    }
    if (window.Plotly) {
      Plotly.react("h-chart", traces, { title: { text: "Reward of this prompt's answers by step" },
        xaxis: { title: { text: "step" } }, yaxis: { title: { text: "reward" } }, margin: { t: 40 } },
        { displaylogo: false, responsive: true });
    }
    $("h-list").querySelector("tbody").replaceChildren(...recs.map((rec) => el("tr", { class: "h-row" },
      el("td", { class: "num", text: String(rec.step) }), el("td", { text: rec.kind }),
      el("td", {}, ...rec.samples.map((s) => el("span", { class: "ans " + ((s.reward || 0) >= 1 ? "right" : "wrong"),
        title: `reward ${num(s.reward)}`, text: s.text === "" ? "∅" : s.text }))))));
  }
  $("h-prompt").addEventListener("change", drawHistory);

  // ---- metric curves of every run ----------------------------------------------------------------
  function ema(ys, w) {  // TensorBoard's smoothing: an exponential moving average, debiased at the start
    let last = 0;
    return ys.map((y, n) => { last = last * w + (1 - w) * y; return last / (1 - Math.pow(w, n + 1)); });
  }
  function points(r, key, xKey) {
    const xs = [], ys = [];
    for (const row of r.rows) {
      const x = xKey === "step" ? row.step : row[xKey];
      const y = row[key];
      if (typeof x === "number" && typeof y === "number") { xs.push(x); ys.push(y); }
    }
    return [xs, ys];
  }
  function drawCurves() {
    const key = $("c-key").value, xKey = $("c-x").value, w = Number($("c-smooth").value);
    $("c-smooth-val").textContent = w.toFixed(2);
    const traces = [], shapes = [], stats = [];
    DATA.runs.forEach((r, i) => {
      const [xs, ys] = points(r, key, xKey);
      const colour = PALETTE[i % PALETTE.length];
      if (w > 0) traces.push({ x: xs, y: ys, mode: "lines", line: { color: colour, width: 1 }, opacity: 0.3, showlegend: false, hoverinfo: "skip", name: r.name + " (raw)" });
      traces.push({ x: xs, y: w > 0 ? ema(ys, w) : ys, mode: xs.length <= 30 ? "lines+markers" : "lines", line: { color: colour }, name: r.name });
      for (const step of r.resumes) {
        const row = r.rows.find((x) => x.step === step);
        const x = xKey === "step" ? step - 1 : row && row[xKey];
        if (typeof x === "number") shapes.push({ type: "line", x0: x, x1: x, yref: "paper", y0: 0, y1: 1, line: { color: colour, dash: "dot", width: 1 } });
      }
      stats.push([r.name, ys.length, ys.length ? ys[ys.length - 1] : null, ys.length ? Math.min(...ys) : null, ys.length ? Math.max(...ys) : null]);
    });
    if (window.Plotly) {
      Plotly.react("c-chart", traces, { title: { text: key }, xaxis: { title: { text: xKey === "step" ? "step" : "RL wall time (s)" } },
        yaxis: { title: { text: key } }, shapes, margin: { t: 40 }, legend: { orientation: "h" } }, { displaylogo: false, responsive: true });
    }
    $("c-stats").querySelector("tbody").replaceChildren(...stats.map((row) => el("tr", {},
      ...row.map((v, k) => el("td", { class: k ? "num" : "", text: k > 1 && v !== null ? String(Number(v.toPrecision(6))) : k ? num(v) : v })))));
  }
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
  for (const id of ["c-key", "c-x", "c-smooth"]) on($(id), drawCurves);

  function refilter() {
    // An input fires "change" again when it loses focus, i.e. on the click into the table: redrawing the
    // table then would swallow that click, so nothing is redrawn unless the filters changed.
    const key = JSON.stringify([state.run, filters()]);
    if (key === state.filterKey) return;
    state.filterKey = key;
    renderGroups();
    if (state.record !== null) showGroup(state.record);
  }

  // ---- set up ------------------------------------------------------------------------------------
  fillSelect($("f-run"), DATA.runs.map((r, i) => [String(i), r.name]), false);
  $("f-run-wrap").style.display = DATA.runs.length > 1 ? "" : "none";
  $("f-run").addEventListener("change", () => {
    state.run = Number($("f-run").value);
    state.record = null;
    $("group-view").style.display = "none";
    refreshRunOptions();
    refreshPrompts();
    refilter();
  });
  for (const input of document.querySelectorAll(".filters input, .filters select")) {
    if (input.id !== "f-run") on(input, refilter);
  }
  const keys = [...new Set(DATA.runs.flatMap((r) => r.rows.flatMap((row) => Object.keys(row).filter((k) => k !== "step" && typeof row[k] === "number"))))].sort();
  fillSelect($("c-key"), keys.map((k) => [k, k]), false);
  if (keys.includes("reward/mean")) $("c-key").value = "reward/mean";
  refreshRunOptions();
  refreshPrompts();
  refilter();
})();
