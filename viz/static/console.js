// The console's script (viz/console.py inlines it): follows the server's live figures (/stats as server-sent
// events: a whole reading, then only what changed, on one long request) and paints the drawing's live
// figures, fills the panels, and runs the playground's chat through the OpenAI route. No library, no build.
//
// The page stays open beside a server decoding on the same machine, so each update touches only what
// changed: texts, classes and attributes are compared before they are written (an equal write still
// invalidates style, layout and paint), table rows are kept and their cells rewritten in place rather than
// rebuilt, painting waits for the next animation frame, and a hidden tab closes the feed.
"use strict";

const CONFIG = JSON.parse(document.getElementById("console-config").textContent);
const KEY_ITEM = "flow.apiKey";
const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------ the API key (this tab's session only)
function apiKey() { return sessionStorage.getItem(KEY_ITEM); }

function headers(extra) {
  const out = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) out["authorization"] = "Bearer " + key;
  return out;
}

let keyWaiters = [];
function askForKey(refused) {
  $("key-error").hidden = !refused;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

// Escape would close the dialog and leave the page waiting for a key forever: nothing works without one.
$("key-dialog").addEventListener("cancel", (event) => event.preventDefault());

$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY_ITEM, $("api-key").value.trim());
  $("api-key").value = "";
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
});

// A call to the server with the key; a 401 asks for the key (again) and retries.
async function call(path, init) {
  for (;;) {
    const response = await fetch(path, Object.assign({}, init || {}, {headers: headers((init || {}).headers)}));
    if (response.status !== 401) return response;
    await askForKey(apiKey() !== null);
  }
}

// ------------------------------------------------------------------ formatting
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function fmtRate(x) { return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2).replace(/\.?0+$/, ""); }

// ------------------------------------------------------------------ writes that happen only on change
function setText(el, text) {
  if (el.textContent !== text) el.textContent = text;
}
function setClass(el, cls) {
  if (el.getAttribute("class") !== cls) el.setAttribute("class", cls);
}

// A table cell's content, as the panels describe it: its text, class, and optionally a badge or a progress bar.
function cell(text, cls) {
  return {text: text === null || text === undefined ? "–" : String(text), cls: cls || ""};
}
function badgeCell(text, badgeClass) { return {text: text, cls: "", badge: "badge " + (badgeClass || "")}; }
function progressCell(value, max) { return {text: "", cls: "", progress: [value, max]}; }

function paintCell(td, spec) {
  setClass(td, spec.cls);
  const kind = spec.badge ? "badge" : spec.progress ? "progress" : "text";
  if (td.dataset.kind !== kind) {  // a new shape: build the cell's one child once
    td.dataset.kind = kind;
    td.replaceChildren(...(kind === "text" ? [] : [document.createElement(kind === "badge" ? "span" : "progress")]));
  }
  if (kind === "text") { setText(td, spec.text); return; }
  const child = td.firstElementChild;
  if (kind === "badge") {
    setClass(child, spec.badge);
    setText(child, spec.text);
  } else {
    if (child.max !== spec.progress[1]) child.max = spec.progress[1];
    if (child.value !== spec.progress[0]) child.value = spec.progress[0];
  }
}

// The table's body becomes ``rows`` ({cls, cells}), reusing its rows and cells: only changed text is written.
function syncRows(tbody, rows) {
  while (tbody.rows.length > rows.length) tbody.lastElementChild.remove();
  rows.forEach((row, i) => {
    const tr = tbody.rows[i] || tbody.appendChild(document.createElement("tr"));
    setClass(tr, row.cls || "");
    while (tr.cells.length > row.cells.length) tr.lastElementChild.remove();
    row.cells.forEach((spec, j) => paintCell(tr.cells[j] || tr.appendChild(document.createElement("td")), spec));
  });
}

// ------------------------------------------------------------------ the drawing
async function loadGraph() {
  const response = await call(CONFIG.graph_path);
  if (!response.ok) {
    $("graph").textContent = "The graph drawing is not available (" + response.status + ").";
    return;
  }
  const text = await response.text();
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const svg = doc.documentElement;
  if (svg.nodeName !== "svg") {
    $("graph").textContent = "The graph drawing could not be read.";
    return;
  }
  $("graph").replaceChildren(document.importNode(svg, true));
  // The drawing's live parts, found once: each poll writes only their texts and classes.
  const parts = (selector, key) => Array.from($("graph").querySelectorAll(selector), (group) =>
    ({group: group, id: group.dataset[key], live: group.querySelector("text.live")}));
  drawing = {stages: parts("g[data-stage]", "stage"), edges: parts("g[data-edge]", "edge"),
    resources: parts("g[data-resource]", "resource")};
}

let drawing = {stages: [], edges: [], resources: []};

function liveText(part, text) {
  if (part.live) setText(part.live, text);
}

// Edge rates are computed here from the counters' change between two paints: the last painted reading's
// counters (edge items, stage errors) and when it was painted.
let previous = null;

function countersOf(stats, at) {
  const items = {}, errors = {};
  for (const [id, edge] of Object.entries(stats.edges || {})) items[id] = edge.items;
  for (const [id, stage] of Object.entries(stats.stages || {})) errors[id] = stage.errors;
  return {items: items, errors: errors, at: at};
}

function paintGraph(stats, seconds) {
  for (const part of drawing.stages) {
    const group = part.group;
    const st = (stats.stages || {})[part.id];
    if (!st) { liveText(part, ""); continue; }
    const errorsBefore = previous ? previous.errors[part.id] : undefined;
    const parts = ["active " + st.active, "runs " + st.runs];
    if (st.errors) parts.push("errors " + st.errors);
    if (st.queued) parts.push("queued " + st.queued);
    liveText(part, parts.join(" · "));
    group.classList.toggle("busy", st.active > 0);
    group.classList.toggle("failing", errorsBefore !== undefined && st.errors > errorsBefore);
  }
  for (const part of drawing.edges) {
    const edge = (stats.edges || {})[part.id];
    if (!edge || !edge.items) { liveText(part, ""); continue; }  // never used yet: keep the drawing quiet
    const before = previous ? previous.items[part.id] : undefined;
    const rate = before !== undefined && seconds > 0 ? Math.max(0, edge.items - before) / seconds : 0;
    const parts = [fmtRate(rate) + " items/s"];
    if (edge.queued) parts.push("q " + edge.queued);
    liveText(part, parts.join(" · "));
    part.group.classList.toggle("flowing", rate > 0);
  }
  for (const part of drawing.resources) liveText(part, resourceLine(part.id, stats));
}

function resourceLine(rid, stats) {
  const model = Object.values(stats.models || {}).find((m) => m.resource === rid || m.id === rid);
  const res = (stats.resources || {})[rid];
  if (res && res.type === "prefix_cache") {
    const disk = res.disk ? res.disk.bytes : 0;
    return "hit " + (100 * (res.hit_rate || 0)).toFixed(0) + "% · hot " + fmtBytes(res.hot_bytes) +
      " · disk " + fmtBytes(disk);
  }
  if (res && res.type === "model_pool") return "loaded " + res.loaded.length + " · " + fmtBytes(res.loaded_bytes);
  if (res && "entries" in res) return res.entries + " entries · " + fmtBytes(res.bytes || 0);
  if (res && "agents" in res) return res.agents + " agents";
  if (res && res.state && res.state !== "ok") return res.state;
  if (model) {
    const e = model.engine;
    if (!e) return model.state || "";
    return "batch " + e.active + (e.waiting ? " +" + e.waiting + " waiting" : "") + " · " +
      fmtRate(e.recent_decode_tokens_per_second || 0) + " tok/s";
  }
  return "";
}

// ------------------------------------------------------------------ the panels
function paintHeader(stats) {
  const graph = stats.graph || {};
  setText($("graph-name"), "graph " + graph.name + " v" + graph.version + " · up " +
    Math.round(stats.uptime_seconds) + " s");
  setText($("requests-total"), String(stats.requests.total));
  setText($("requests-active"), String(stats.requests.active));
  setText($("requests-failed"), String(stats.requests.failed));
  const engines = Object.values(stats.models || {}).map((m) => m.engine).filter((e) => e);
  const sum = (f) => engines.reduce((acc, e) => acc + (f(e) || 0), 0);
  setText($("decode-tps"), fmtRate(sum((e) => e.recent_decode_tokens_per_second)));
  setText($("engine-batch"), String(sum((e) => e.active)));
  const caches = Object.values(stats.resources || {}).filter((r) => r.type === "prefix_cache");
  setText($("prefix-hit"), caches.length ?
    (100 * caches.reduce((a, c) => a + (c.hit_rate || 0), 0) / caches.length).toFixed(0) + "%" : "–");
}

function paintModels(stats) {
  const rows = Object.values(stats.models || {}).map((m) => {
    const e = m.engine || {};
    const state = m.state === "loading" && m.loading_seconds !== undefined ?
      "loading " + (m.loading_fraction !== undefined ? Math.round(100 * m.loading_fraction) + "% · " : "") +
      Math.round(m.loading_seconds) + " s" : m.state;
    return {cells: [cell(m.id + (m.pinned ? " (pinned)" : "")), cell(state), cell(m.kind),
      cell(m.engine ? e.active + (e.waiting ? " +" + e.waiting : "") : null, "num"),
      cell(m.engine ? fmtRate(e.recent_decode_tokens_per_second || 0) : null, "num"),
      cell(m.context_length || m.max_input_tokens, "num"),
      cell(m.idle_seconds === undefined ? null : Math.round(m.idle_seconds) + " s", "num"), cell(m.loads, "num")]};
  });
  syncRows($("models").tBodies[0], rows);
  const pools = Object.entries(stats.resources || {}).filter(([, r]) => r.type === "model_pool");
  setText($("pool"), pools.map(([rid, p]) => rid + ": loaded " + (p.loaded.join(", ") || "none") +
    " (" + fmtBytes(p.loaded_bytes) + ")" + (p.pinned.length ? " · pinned " + p.pinned.join(", ") : "") +
    " · evictions " + p.evictions + " · idle unloads " + p.idle_unloads).join("\n"));
}

// The page's own reads are left out of the list: they would crowd out the requests worth seeing.
const OWN_ROUTES = new Set(["GET /", "GET " + CONFIG.graph_path, "GET " + CONFIG.library_path,
  "GET " + CONFIG.downloads_path, "GET " + CONFIG.models_path]);

function paintRecent(stats) {
  const rows = (stats.recent_requests || []).filter((r) => !OWN_ROUTES.has(r.route)).map((r) => {
    const tokens = r.completion_tokens === null ? (r.prompt_tokens === null ? null : r.prompt_tokens + " →")
      : r.prompt_tokens + " → " + r.completion_tokens;
    return {cls: r.running ? "running" : r.status >= 400 ? "failed" : "",
      cells: [cell(r.started), cell(r.route), cell(r.model), cell(tokens, "num"),
        cell(r.running && r.status === null ? "…" : r.status),
        cell(r.ttfb_ms === null ? null : r.ttfb_ms + " ms", "num"),
        cell(r.duration_ms === null ? "running" : r.duration_ms + " ms", "num")]};
  });
  syncRows($("recent").tBodies[0], rows);
}

// ------------------------------------------------------------------ the library, downloads
async function loadLibrary() {
  const response = await call(CONFIG.library_path);
  if (response.status === 404) { $("library-panel").hidden = true; return; }
  if (!response.ok) return;
  const body = await response.json();
  setText($("library-note"), "(" + body.data.length + " local models" + (body.offline ? " · hub offline" : "") + ")");
  $("pull-button").disabled = !!body.offline;
  $("pull-repo").disabled = !!body.offline;
  syncRows($("library").tBodies[0], body.data.map((m) => {
    const a = m.assessment;
    const fit = a ? badgeCell(a.fits ? "fits" : "does not fit", a.fits ? "ok" : "no") :
      badgeCell(m.supported ? "–" : "unsupported");
    const kinds = [m.kind, ...["vision", "audio"].filter((flag) => m[flag] && m.kind !== flag)];  // a VLM: vision once
    return {cells: [cell(m.repo_id), cell(kinds.join(" · ")),
      cell(m.family), cell(fmtBytes(m.size_bytes), "num"), cell(m.quant_bits ? m.quant_bits + "-bit" : "–"), fit,
      cell(a ? a.max_safe_context : null, "num"), cell(a ? fmtRate(a.predicted_decode_tps) : null, "num"),
      m.serving ? badgeCell("serving", "serving") : {text: "", cls: ""}]};
  }));
}

let downloadsActive = false;
let downloadsLoading = false;

// The downloads resource's counts come with every reading: while one is queued or running, its progress is
// read once per reading; when the last one ends, once more (and the library, which now has the model).
function followDownloads(stats) {
  const active = Object.values(stats.resources || {}).some((r) => r.type === "downloads" && r.queued + r.running);
  if ((active || downloadsActive) && !downloadsLoading) {
    downloadsLoading = true;
    loadDownloads().finally(() => { downloadsLoading = false; });
  }
}

async function loadDownloads() {
  const response = await call(CONFIG.downloads_path);
  if (!response.ok) return;
  const body = await response.json();
  const wasActive = downloadsActive;
  downloadsActive = body.data.some((d) => d.state === "queued" || d.state === "running");
  syncRows($("downloads").tBodies[0], body.data.slice(0, 5).map((d) => ({cells: [
    cell(d.repo), cell(d.state), progressCell(d.received_bytes, d.total_bytes || 1),
    cell(fmtBytes(d.received_bytes) + " / " + fmtBytes(d.total_bytes), "num"),
    cell(d.files_done + "/" + d.files_total + " files", "num"),
    cell(d.state === "running" ? fmtBytes(d.bytes_per_sec) + "/s" : (d.error || ""), d.error ? "error" : "")]})));
  if (wasActive && !downloadsActive) loadLibrary();  // a finished download is in the library now
}

$("pull-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("pull-error").textContent = "";
  const response = await call(CONFIG.downloads_path, {method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({repo: $("pull-repo").value.trim()})});
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    $("pull-error").textContent = (body.error && body.error.message) || ("HTTP " + response.status);
    return;
  }
  $("pull-repo").value = "";
  downloadsActive = true;  // queued: a pull that is done before the next reading still refreshes the library
  loadDownloads();
});

// ------------------------------------------------------------------ server-sent events
// Calls onEvent(name, data) for each event of an SSE response's body (its data lines joined), until the body
// ends; what onEvent throws ends the reading. The feed and the playground's chat both read through it.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// ------------------------------------------------------------------ the live figures (/stats/events)
// "stats" events carry a whole reading; "change" events what changed since, merged in: objects key by key,
// anything else replaced. The server's uptime changes with every reading, so an event comes every interval
// and the rates drawn fall back to zero when the traffic stops.
let stats = null;
let feed = null;           // the open feed's AbortController
let paintPending = false;  // a paint is waiting for the next animation frame

function merge(target, change) {
  for (const [key, value] of Object.entries(change)) {
    const old = target[key];
    const objects = (x) => x !== null && typeof x === "object" && !Array.isArray(x);
    if (objects(value) && objects(old)) merge(old, value);
    else target[key] = value;
  }
}

// All of what arrived before the next frame is painted in that frame: one style, layout and paint pass.
function schedulePaint() {
  if (paintPending) return;
  paintPending = true;
  requestAnimationFrame(paint);
}

function paint() {
  paintPending = false;
  const now = performance.now();
  const seconds = previous ? (now - previous.at) / 1000 : 0;
  paintHeader(stats);
  paintGraph(stats, seconds);
  paintModels(stats);
  paintRecent(stats);
  followDownloads(stats);
  previous = countersOf(stats, now);
  setText($("conn"), "live");
  setClass($("conn"), "conn ok");
}

async function openFeed() {
  if (feed !== null || document.hidden) return;
  const controller = feed = new AbortController();
  try {
    const response = await call(CONFIG.stats_feed_path + "?interval=" + CONFIG.update_seconds,
      {signal: controller.signal});
    if (!response.ok) throw new Error(CONFIG.stats_feed_path + " answered " + response.status);
    await readEvents(response, (name, data) => {
      if (name === "stats") stats = JSON.parse(data);
      else if (name === "change" && stats !== null) merge(stats, JSON.parse(data));
      else return;
      schedulePaint();
    });
    throw new Error("the server closed the feed");
  } catch (err) {
    if (controller.signal.aborted) return;  // closed on purpose: the tab is hidden
    setText($("conn"), "offline: " + err.message);
    setClass($("conn"), "conn bad");
  } finally {
    if (feed === controller) feed = null;
  }
  setTimeout(openFeed, 2000);  // the server restarts, or comes back: follow it again
}

document.addEventListener("visibilitychange", () => {
  if (document.hidden) {  // nobody looks: the server sends nothing, the page paints nothing
    if (feed !== null) feed.abort();
    feed = null;
    return;
  }
  previous = null;  // rates over the hidden time would be averages, not what happens now
  openFeed();
});

// ------------------------------------------------------------------ the playground
async function loadModels() {
  const response = await call(CONFIG.models_path);
  if (!response.ok) return;
  const body = await response.json();
  const select = $("chat-model");
  const ids = (body.data || []).filter((m) => !m.kind || m.kind === "text" || m.kind === "vision").map((m) => m.id);
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
}

let running = null;

async function sendChat() {
  const text = $("chat-input").value.trim();
  if (!text || running) return;
  const output = $("chat-output");
  output.textContent = "";
  output.classList.remove("error");
  $("chat-info").textContent = "";
  running = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const started = performance.now();
  let first = null;
  let chunks = 0;
  try {
    const response = await call(CONFIG.chat_path, {
      method: "POST", signal: running.signal, headers: {"content-type": "application/json"},
      body: JSON.stringify({model: $("chat-model").value || "default", stream: true,
        max_tokens: Number($("chat-max").value) || 128, messages: [{role: "user", content: text}]}),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || ("HTTP " + response.status));
    }
    await readEvents(response, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const piece = (delta.reasoning_content || "") + (delta.content || "");
        if (piece) {
          if (first === null) first = performance.now();
          chunks++;
          output.textContent += piece;
        }
      }
    });
    const ttft = first === null ? "–" : Math.round(first - started) + " ms";
    $("chat-info").textContent = chunks + " chunks · first token " + ttft + " · " +
      Math.round(performance.now() - started) + " ms";
  } catch (err) {
    if (err.name !== "AbortError") {
      output.classList.add("error");
      output.textContent += (output.textContent ? "\n" : "") + "Error: " + err.message;
    }
  } finally {
    running = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

$("chat-send").addEventListener("click", sendChat);
$("chat-stop").addEventListener("click", () => { if (running) running.abort(); });
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) sendChat();
});

// ------------------------------------------------------------------ start
(async () => {
  await loadGraph();
  openFeed();
  loadModels();
  loadLibrary();
  loadDownloads();
  setInterval(loadLibrary, 30000);  // the server rescans at most every 30 s
})();
