// The rollout-ledger audit page: hand-written, no framework, no build step, nothing loaded
// from anywhere but the ledger that served it.  Data comes from /ui/api/* (audit scope).
"use strict";

const TOKEN_KEY = "rollout-ledger-audit-token";
const SVG = "http://www.w3.org/2000/svg";
const REASON_SWATCHES = 6;
const REASON_COLORS = ["#e8590c", "#c2255c", "#7048e8", "#f59f00", "#0c8599", "#5c940d"];

// ------------------------------------------------------------------ small helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

function fmtTime(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (isNaN(d)) return iso;
  return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}

function rolloutLink(id) {
  return h("a", { href: `#/rollout/${encodeURIComponent(id)}`, class: "mono" }, id);
}

function table(headers, rows, opts = {}) {
  return h("table", { class: opts.class || "" },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length, class: "muted" }, opts.empty || "none"))));
}

// ------------------------------------------------------------------ API + token

class AuthNeeded extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const resp = await fetch(path, { headers });
  let body = null;
  try { body = await resp.json(); } catch (_) { body = null; }
  if (resp.status === 401 || resp.status === 403) {
    throw new AuthNeeded((body && body.error && body.error.message) || `HTTP ${resp.status}`);
  }
  if (!resp.ok) {
    const msg = (body && body.error && body.error.message) || `HTTP ${resp.status}`;
    throw new Error(msg);
  }
  return body;
}

function askToken(why) {
  const dialog = document.getElementById("token-dialog");
  const whyEl = document.getElementById("token-why");
  if (why) {
    whyEl.replaceChildren(
      "The ledger answered: ", h("b", {}, why), ". Enter a bearer token with the ",
      h("code", {}, "audit"), " scope; it is kept in this tab only (sessionStorage).");
  }
  document.getElementById("token-input").value = "";
  if (!dialog.open) dialog.showModal();
}

function setupToken() {
  document.getElementById("token-button").addEventListener("click", () => askToken(null));
  document.getElementById("token-form").addEventListener("submit", () => {
    const value = document.getElementById("token-input").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    route();
  });
  document.getElementById("token-clear").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    document.getElementById("token-dialog").close();
    route();
  });
}

async function guarded(render) {
  const main = document.getElementById("main");
  try {
    await render(main);
  } catch (err) {
    if (err instanceof AuthNeeded) {
      main.replaceChildren(h("section", { class: "card" },
        h("p", { class: "error", id: "auth-error" }, `Not authorised: ${err.message}`),
        h("button", { type: "button", onclick: () => askToken(err.message) }, "Enter token")));
      askToken(err.message);
    } else {
      main.replaceChildren(h("section", { class: "card" }, h("p", { class: "error" }, String(err.message || err))));
    }
  }
}

// ------------------------------------------------------------------ overview

const state = {
  window: "24h",
  filters: { state: "", outcome: "", reason: "", consumer: "", window: "", id_prefix: "" },
};

function reasonColor(reasons, r) {
  const i = reasons.indexOf(r);
  return REASON_COLORS[(i < 0 ? 0 : i) % REASON_COLORS.length];
}

function healthChart(report) {
  const buckets = report.buckets;
  const reasons = Object.keys(report.totals.masked_by_reason);
  const W = Math.max(1180, buckets.length * 16), H = 150, CH = 60, pad = 26;
  const maxBuild = Math.max(1, ...buckets.map((b) => b.delivered + b.masked + b.failed));
  const maxCalls = Math.max(1, ...buckets.map((b) => b.calls_captured));
  const bw = (W - pad) / buckets.length;
  const svg = s("svg", { width: W, height: H + CH + 34, role: "img", "aria-label": "run health over time" });
  svg.append(s("text", { x: 0, y: 10 }, "builds"), s("text", { x: 0, y: H + 22 }, "calls"));
  svg.append(s("line", { x1: pad, x2: W, y1: H, y2: H, stroke: "#c4cbd4" }));
  buckets.forEach((b, i) => {
    const x = pad + i * bw + 1, w = Math.max(1, bw - 2);
    let y = H;
    const seg = (n, color, label) => {
      if (!n) return;
      const hgt = (n / maxBuild) * (H - 16);
      y -= hgt;
      svg.append(s("rect", { x, y, width: w, height: hgt, fill: color },
        s("title", {}, `${fmtTime(b.start)}: ${n} ${label}`)));
    };
    seg(b.delivered, "#2b8a3e", "delivered");
    // A build masked for several reasons counts under each; the bar shows masked rollouts once.
    let rest = b.masked;
    for (const r of reasons) {
      const n = Math.min(rest, b.masked_by_reason[r] || 0);
      seg(n, reasonColor(reasons, r), `masked: ${r}`);
      rest -= n;
    }
    seg(rest, REASON_COLORS[0], "masked");
    seg(b.failed, "#862e2e", "failed");
    if (b.calls_captured) {
      const ch = (b.calls_captured / maxCalls) * (CH - 6);
      svg.append(s("rect", { x, y: H + 14 + CH - ch, width: w, height: ch, fill: "#8aa8d6" },
        s("title", {}, `${fmtTime(b.start)}: ${b.calls_captured} calls captured`)));
    }
  });
  const last = buckets.length - 1;
  svg.append(
    s("text", { x: pad, y: H + CH + 30 }, fmtTime(buckets[0].start)),
    s("text", { x: W - 4, y: H + CH + 30, "text-anchor": "end" }, `${fmtTime(buckets[last].start)} (${report.bucket_s}s buckets)`),
    s("text", { x: pad - 4, y: 20, "text-anchor": "end" }, String(maxBuild)));
  const legend = h("div", { class: "legend" },
    h("span", {}, h("i", { class: "swatch-delivered" }), "delivered"),
    reasons.map((r, i) => h("span", {}, h("i", { class: `swatch-${i % REASON_SWATCHES}` }), `masked: ${r}`)),
    h("span", {}, h("i", { class: "swatch-failed" }), "failed"),
    h("span", {}, h("i", { class: "swatch-calls" }), "calls captured"));
  return [legend, h("div", { class: "chart" }, svg)];
}

function stat(value, label) {
  return h("div", { class: "stat" }, h("b", {}, value), h("span", {}, label));
}

async function renderHealth(box) {
  const report = await api(`/ui/api/health?window=${state.window}`);
  const t = report.totals;
  const built = t.delivered + t.masked + t.failed;
  const windowSel = h("select", { id: "health-window", onchange: (e) => { state.window = e.target.value; guarded(() => renderHealth(box)); } },
    ["1h", "6h", "24h", "7d", "30d"].map((w) => h("option", { value: w, selected: w === state.window }, `last ${w}`)));
  const reasons = Object.entries(t.masked_by_reason);
  const causes = Object.entries(report.incomplete_by_reason);
  box.replaceChildren(
    h("div", { class: "row" }, h("h2", {}, "Run health"), windowSel),
    h("div", { class: "stats", id: "health-totals" },
      stat(t.calls_captured, "calls captured"), stat(t.rollouts_started, "rollouts started"),
      stat(t.delivered, "delivered"), stat(t.masked, "masked"), stat(t.failed, "failed"),
      stat(built ? `${(((t.masked + t.failed) / built) * 100).toFixed(1)}%` : "–", "mask fraction")),
    ...healthChart(report),
    h("div", { class: "grid2" },
      h("div", {}, h("h2", {}, "Masked by reason"),
        table(["reason", "rollouts"], reasons.map(([r, n]) => h("tr", {}, h("td", {}, badge(r, "reason")), h("td", {}, n))), { empty: "nothing masked in this window" })),
      h("div", {}, h("h2", {}, "Incomplete causes"),
        table(["cause", "events"], causes.map(([r, n]) => h("tr", {}, h("td", {}, badge(r, "cause")), h("td", {}, n))), { empty: "no incomplete events in this window" }))));
  const reasonList = document.getElementById("reason-options");
  if (reasonList) {
    const all = new Set([...Object.keys(t.masked_by_reason), ...Object.keys(report.incomplete_by_reason)]);
    reasonList.replaceChildren(...[...all].sort().map((r) => h("option", { value: r })));
  }
  const consumerList = document.getElementById("consumer-options");
  if (consumerList) consumerList.replaceChildren(...report.consumers.map((c) => h("option", { value: c })));
}

function rolloutRow(r) {
  const reasons = [
    ...r.mask_reasons.map((x) => badge(x, "reason")),
    ...r.causes.filter((c) => !r.mask_reasons.includes(c)).map((x) => badge(x, "cause")),
  ];
  return h("tr", { "data-rollout": r.rollout_id },
    h("td", {}, rolloutLink(r.rollout_id)),
    h("td", {}, badge(r.state), r.incomplete ? badge("incomplete") : null),
    h("td", {}, r.outcome ? badge(r.outcome) : badge("none", "none")),
    h("td", { class: "reasons" }, reasons.length ? reasons : h("span", { class: "muted" }, "–")),
    h("td", {}, r.n_calls),
    h("td", { class: "mono" }, r.consumer || ""),
    h("td", { class: "mono" }, fmtTime(r.updated_at)));
}

function filtersForm(onApply) {
  const f = state.filters;
  const set = (k) => (e) => { f[k] = e.target.value.trim(); onApply(); };
  const keep = (k) => (e) => { f[k] = e.target.value.trim(); };  // text: applied on submit
  const sel = (k, label, options) => h("label", {}, label,
    h("select", { name: k, onchange: set(k) }, options.map(([v, t]) => h("option", { value: v, selected: f[k] === v }, t))));
  return h("form", { class: "row", id: "filters", onsubmit: (e) => { e.preventDefault(); onApply(); } },
    sel("state", "state", [["", "any"], ["open", "open"], ["frozen", "frozen"], ["retired", "retired"]]),
    sel("outcome", "latest build", [["", "any"], ["delivered", "delivered"], ["masked", "masked or failed"], ["failed", "failed"], ["none", "not built"]]),
    h("label", {}, "reason", h("input", { name: "reason", list: "reason-options", value: f.reason, placeholder: "e.g. capture_incomplete", oninput: keep("reason") })),
    h("datalist", { id: "reason-options" }),
    h("label", {}, "consumer", h("input", { name: "consumer", list: "consumer-options", value: f.consumer, oninput: keep("consumer") })),
    h("datalist", { id: "consumer-options" }),
    sel("window", "changed", [["", "any time"], ["1h", "last hour"], ["24h", "last 24 h"], ["7d", "last 7 days"], ["30d", "last 30 days"]]),
    h("label", {}, "id starts with", h("input", { name: "id_prefix", value: f.id_prefix, oninput: keep("id_prefix") })),
    h("button", { type: "submit" }, "Filter"));
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v);
  return q.toString();
}

async function renderList(box) {
  const body = h("tbody", { id: "rollout-rows" });
  const more = h("button", { type: "button", id: "more", class: "link" }, "more…");
  const status = h("p", { class: "muted", id: "list-status" });
  let cursor = null;
  let generation = 0;  // a newer load (filters changed) supersedes one still in flight
  const load = async (reset) => {
    const mine = reset ? ++generation : generation;
    const page = await api(`/ui/api/rollouts?${query({ ...state.filters, cursor: reset ? null : cursor, limit: 50 })}`);
    if (mine !== generation) return;
    if (reset) body.replaceChildren();
    body.append(...page.items.map(rolloutRow));
    cursor = page.next_cursor;
    more.hidden = !cursor;
    status.textContent = body.children.length ? "" : "No rollout matches these filters.";
  };
  more.addEventListener("click", () => guarded(() => load(false)));
  box.replaceChildren(
    h("h2", {}, "Rollouts"),
    filtersForm(() => guarded(async () => { await load(true); })),
    h("table", { id: "rollouts" },
      h("thead", {}, h("tr", {}, ["rollout", "state", "latest build", "reasons and causes", "calls", "consumer", "last change"].map((x) => h("th", {}, x)))),
      body),
    status, more);
  await load(true);
}

async function renderOverview(main) {
  const health = h("section", { class: "card", id: "health" }, h("p", { class: "muted" }, "loading…"));
  const list = h("section", { class: "card", id: "list" });
  main.replaceChildren(health, list);
  await renderList(list);
  await renderHealth(health);
}

// ------------------------------------------------------------------ one rollout

function layoutGraph(calls, edges) {
  const layoutParent = {};
  for (const e of edges) {
    const prior = layoutParent[e.child];
    if (!prior || (prior.status !== "verified" && e.status === "verified")) layoutParent[e.child] = e;
  }
  const depth = {}, order = {};
  const byDepth = [];
  for (const c of calls) {
    const id = c.model_call_id;
    const p = (layoutParent[id] && layoutParent[id].parent) || c.parent_call_id;
    depth[id] = p && depth[p] !== undefined ? depth[p] + 1 : 0;
    (byDepth[depth[id]] = byDepth[depth[id]] || []).push(id);
    order[id] = byDepth[depth[id]].length - 1;
  }
  return { depth, order, byDepth };
}

function callGraph(detail, onSelect) {
  const calls = detail.calls, edges = detail.edges;
  if (!calls.length) return h("p", { class: "muted" }, "No calls recorded.");
  const { depth, order, byDepth } = layoutGraph(calls, edges);
  const NW = 190, NH = 46, GX = 40, GY = 70, M = 16;
  const cols = Math.max(...byDepth.map((l) => l.length));
  // Extra room on the right for the edge labels of the last column.
  const W = M * 2 + cols * NW + (cols - 1) * GX + 190, H = M * 2 + byDepth.length * NH + (byDepth.length - 1) * GY;
  const pos = (id) => ({ x: M + order[id] * (NW + GX), y: M + depth[id] * (NH + GY) });
  const svg = s("svg", { width: W, height: H, role: "img", "aria-label": "calls and lineage edges" });
  svg.append(s("defs", {}, ["verified", "drifted", "ambiguous"].map((k) =>
    s("marker", { id: `arrow-${k}`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      s("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: k === "verified" ? "#2b8a3e" : k === "drifted" ? "#c92a2a" : "#e67700" })))));
  for (const e of edges) {
    if (!(e.parent in depth) || !(e.child in depth)) continue;
    const a = pos(e.parent), b = pos(e.child);
    const x1 = a.x + NW / 2, y1 = a.y + NH, x2 = b.x + NW / 2, y2 = b.y;
    const my = (y1 + y2) / 2;
    svg.append(s("path", { class: `edge ${e.status}`, d: `M ${x1} ${y1} C ${x1} ${my}, ${x2} ${my}, ${x2} ${y2 - 2}`, "marker-end": `url(#arrow-${e.status})` },
      s("title", {}, `${e.parent} → ${e.child}: ${e.method} (${e.status}), shared ${e.shared_len} tokens`)));
    const label = e.status === "drifted"
      ? `drift @ ${e.mismatch_pos} (${e.method})`
      : `${e.method}${e.status === "verified" ? "" : ` (${e.status})`}`;
    svg.append(s("text", { class: `elabel ${e.status}`, x: (x1 + x2) / 2 + 6, y: my + 4 }, label));
  }
  for (const c of calls) {
    const p = pos(c.model_call_id);
    const id = c.model_call_id.length > 26 ? `${c.model_call_id.slice(0, 25)}…` : c.model_call_id;
    const lens = c.status === "captured" ? `prompt ${c.prompt_len} · gen ${c.generation_len}${c.prompt_is_delta ? " · delta" : ""}` : c.status;
    svg.append(s("g", { class: `node ${c.status}`, "data-call": c.model_call_id, transform: `translate(${p.x},${p.y})`, onclick: () => onSelect(c.model_call_id) },
      s("title", {}, `${c.model_call_id}\n${c.route || ""}\n${c.model || ""}`),
      s("rect", { width: NW, height: NH, rx: 6 }),
      s("text", { x: 8, y: 18, class: "mono" }, id),
      s("text", { x: 8, y: 36, fill: "#5f6b7a" }, lens)));
  }
  return h("div", { class: "graph", id: "call-graph" }, svg);
}

// Whitespace made visible, so a token that is only a space or a newline can be seen.
function visible(text) {
  return text.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u2192") || "\u2205";
}

function tokenChips(tokens, firstIndex) {
  return tokens.map((t, i) => h("span", { class: `tok${i === firstIndex ? " first" : ""}`, title: `id ${t.id}` },
    t.text !== undefined ? visible(t.text) : String(t.id),
    t.text !== undefined ? h("small", {}, t.id) : null));
}

function driftPanel(w, tokenizer) {
  const head = h("div", { class: "where" },
    "Call ", h("span", { class: "mono" }, w.child), " continues ", h("span", { class: "mono" }, w.parent),
    " by conversation, but its prompt departs from that call's tokens at position ",
    h("span", { class: "drift-pos" }, String(w.position)), ` (${w.kind || "mismatch"}).`);
  if (w.unavailable) return h("div", { class: "drift" }, head, h("p", { class: "muted" }, `Tokens not shown: ${w.unavailable}`));
  const rows = [
    h("div", { class: "tokens" }, h("span", { class: "side" }, `shared [${w.shared_start}, ${w.position})`), tokenChips(w.shared, -1)),
    h("div", { class: "tokens parent-side" }, h("span", { class: "side" }, "parent continues"), tokenChips(w.parent_next, 0)),
    h("div", { class: "tokens child-side" }, h("span", { class: "side" }, "child's prompt has"), w.child_next.length ? tokenChips(w.child_next, 0) : h("span", { class: "muted" }, "(prompt ends here)")),
  ];
  const decoded = w.decoded
    ? [h("div", { class: "muted" }, "decoded (parent, then child):"),
       h("div", { class: "decoded" }, w.decoded.shared, h("mark", {}, w.decoded.parent_next)),
       h("div", { class: "decoded" }, w.decoded.shared, h("mark", {}, w.decoded.child_next))]
    : [h("p", { class: "muted" }, tokenizer ? "" : "Token ids only: start the page with --tokenizer tokenizer.json (or ROLLOUT_LEDGER_TOKENIZER) to see text.")];
  return h("div", { class: "drift" }, head, rows, decoded);
}

function json(v) {
  return h("details", {}, h("summary", {}, "show"), h("pre", {}, JSON.stringify(v, null, 2)));
}

async function renderRollout(main, rolloutId) {
  main.replaceChildren(h("p", { class: "muted" }, "loading…"));
  const d = await api(`/ui/api/rollouts/${encodeURIComponent(rolloutId)}`);
  const r = d.rollout;
  const proof = {};
  for (const e of d.edges) (proof[e.child] = proof[e.child] || []).push(e);
  const latest = d.deliveries[d.deliveries.length - 1];
  let callsTable;
  const select = (id) => {
    for (const el of document.querySelectorAll("[data-call]")) el.classList.toggle("selected", el.dataset.call === id);
    const row = callsTable.querySelector(`tr[data-call="${CSS.escape(id)}"]`);
    if (row) row.scrollIntoView({ block: "nearest" });
  };
  callsTable = table(["call", "status", "route", "model", "prompt", "gen", "cumulative", "parent (proof)", "recorded"],
    d.calls.map((c) => h("tr", { "data-call": c.model_call_id },
      h("td", { class: "mono" }, c.model_call_id),
      h("td", {}, badge(c.status)),
      h("td", { class: "mono" }, c.route || ""),
      h("td", {}, c.model || ""),
      h("td", {}, c.prompt_len ?? "", c.prompt_is_delta ? h("span", { class: "muted" }, " (delta)") : null),
      h("td", {}, c.generation_len ?? ""),
      h("td", {}, c.cumulative_len ?? ""),
      h("td", {}, c.status === "captured" && !proof[c.model_call_id] ? h("span", { class: "muted" }, "root (no earlier call's tokens prefix its prompt)") : null,
        (proof[c.model_call_id] || []).map((e) => h("div", {},
        h("span", { class: "mono" }, e.parent), " ", badge(e.method, e.status), " ", badge(e.status),
        e.status === "drifted" ? ` @ ${e.mismatch_pos}` : ""))),
      h("td", { class: "mono" }, fmtTime(c.recorded_at || c.registered_at)))), { empty: "no calls" });
  callsTable.id = "calls";
  main.replaceChildren(
    h("p", {}, h("a", { href: "#/" }, "← all rollouts")),
    h("h1", {}, "Rollout ", h("span", { class: "mono", id: "rollout-id" }, r.rollout_id)),
    h("section", { class: "card" },
      h("div", { class: "row" }, badge(r.state), r.incomplete ? badge("incomplete") : null,
        latest ? badge(latest.outcome) : badge("not built", "none"),
        (latest ? latest.mask_reasons : []).map((x) => badge(x, "reason")),
        [...new Set(d.incomplete_events.map((e) => e.reason))].map((x) => badge(x, "cause"))),
      h("dl", { class: "kv" },
        h("dt", {}, "version"), h("dd", {}, r.version),
        h("dt", {}, "snapshot"), h("dd", { class: "mono" }, r.snapshot_id || "–"),
        h("dt", {}, "created"), h("dd", {}, fmtTime(r.created_at)),
        h("dt", {}, "frozen"), h("dd", {}, fmtTime(r.frozen_at) || "–"),
        h("dt", {}, "retired"), h("dd", {}, fmtTime(r.retired_at) || "–"),
        h("dt", {}, "tokenizer"), h("dd", {}, d.tokenizer || "none (ids only)"))),
    h("section", { class: "card" }, h("h2", {}, `Calls and lineage (${d.calls.length} calls, ${d.edges.length} edges)`),
      h("div", { class: "legend" }, h("span", {}, "green: proven by tokens"), h("span", {}, "red dashed: drifted (continues by conversation, tokens differ)"), h("span", {}, "orange: ambiguous")),
      callGraph(d, select)),
    h("section", { class: "card", id: "drift" }, h("h2", {}, "Drift"),
      d.drift.length ? d.drift.map((w) => driftPanel(w, d.tokenizer)) : h("p", { class: "muted" }, "No drifted edge: every continuation extends its parent's tokens.")),
    h("section", { class: "card" }, h("h2", {}, "Calls"), callsTable),
    h("section", { class: "card" }, h("h2", {}, "Incomplete events"),
      table(["call", "cause", "detail", "time"], d.incomplete_events.map((e) => h("tr", {},
        h("td", { class: "mono" }, e.model_call_id || "–"), h("td", {}, badge(e.reason, "cause")), h("td", {}, e.detail), h("td", { class: "mono" }, fmtTime(e.created_at)))))),
    h("section", { class: "card", id: "quarantines" }, h("h2", {}, "Quarantines"),
      table(["call", "reason", "detail", "build", "time"], d.quarantines.map((q) => h("tr", {},
        h("td", { class: "mono" }, q.model_call_id), h("td", {}, badge(q.reason, "reason")), h("td", {}, q.detail),
        h("td", {}, q.delivery_id ?? "–"), h("td", { class: "mono" }, fmtTime(q.created_at)))))),
    h("section", { class: "card", id: "deliveries" }, h("h2", {}, "Deliveries and receipts"),
      table(["build", "outcome", "reasons", "consumer", "idempotency key", "built", "handed off", "durable ack", "retired", "metrics"],
        d.deliveries.map((x) => h("tr", {},
          h("td", {}, x.id), h("td", {}, badge(x.outcome)), h("td", {}, (x.mask_reasons || []).map((m) => badge(m, "reason"))),
          h("td", { class: "mono" }, x.consumer || "–"), h("td", { class: "mono" }, x.idempotency_key || "–"),
          h("td", { class: "mono" }, fmtTime(x.built_at)), h("td", { class: "mono" }, fmtTime(x.handed_off_at) || "–"),
          h("td", { class: "mono" }, fmtTime(x.durable_ack_at) || "–"), h("td", { class: "mono" }, fmtTime(x.retired_at) || "–"),
          h("td", {}, json({ metrics: x.metrics, terminal: x.terminal })))), { empty: "never built" })));
}

// ------------------------------------------------------------------ routing

function route() {
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/rollout\/(.+)$/);
  if (m) guarded((main) => renderRollout(main, decodeURIComponent(m[1])));
  else guarded(renderOverview);
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", () => { setupToken(); route(); });
